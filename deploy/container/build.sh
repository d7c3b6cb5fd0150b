#!/bin/sh
# Build the crossroads container image without pulling anything from a
# registry: the base root filesystem comes from Debian's packages (mmdebstrap),
# is cached as a tarball, imported into podman's storage, then the Containerfile
# is built on it.  Usage: deploy/container/build.sh [IMAGE]  (default
# localhost/crossroads:latest).  `make image` runs this; tests/test_image.py too.
#
# Environment:
#   CROSSROADS_IMAGE_CACHE   where base tarballs are kept (/var/cache/crossroads/image)
#   CROSSROADS_DEBIAN_MIRROR Debian mirror (http://deb.debian.org/debian)
#   CROSSROADS_DEBIAN_SECURITY  security mirror (http://deb.debian.org/debian-security)
#   CROSSROADS_BASE_MAX_AGE  days before the base is rebuilt (7: security updates)
#   PIP_CERT, PIP_INDEX_URL  handed to pip in the build stage (a proxy's CA bundle,
#                            a PyPI mirror): the bundle is mounted read-only for
#                            the build, never copied into the image
set -eu
IMAGE=${1:-localhost/crossroads:latest}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
SUITE=bookworm
CACHE=${CROSSROADS_IMAGE_CACHE:-/var/cache/crossroads/image}
MIRROR=${CROSSROADS_DEBIAN_MIRROR:-http://deb.debian.org/debian}
SECURITY=${CROSSROADS_DEBIAN_SECURITY:-http://deb.debian.org/debian-security}
MAX_AGE=${CROSSROADS_BASE_MAX_AGE:-7}
# python3-venv: the build stage makes /opt/crossroads with it; ca-certificates:
# TLS to a Redis or an ACME CA. apt stays (variant apt) so that the build stage
# can add the compiler.
PACKAGES=python3,python3-venv,ca-certificates
BASE=localhost/crossroads-base:$SUITE

# The cache key names everything the tarball depends on.
key=$(printf '%s\n' v1 "$SUITE" "$MIRROR" "$SECURITY" "$PACKAGES" | sha256sum | cut -c1-16)
tarball=$CACHE/base-$SUITE-$key.tar
mkdir -p "$CACHE"
find "$CACHE" -maxdepth 1 -name "base-$SUITE-*.tar" -mtime +"$MAX_AGE" -delete
if [ ! -s "$tarball" ]; then
    # Built beside its final name and renamed into place: a run that stops
    # half-way (or two at once) never leaves a half tarball under that name.
    work=$(mktemp -d "$CACHE/.base-XXXXXX")
    trap 'rm -rf "$work"' EXIT
    echo "base: mmdebstrap $SUITE ($PACKAGES) -> $tarball" >&2
    mmdebstrap --quiet --variant=apt --include="$PACKAGES" \
        --dpkgopt='path-exclude=/usr/share/doc/*' \
        --dpkgopt='path-exclude=/usr/share/man/*' \
        --dpkgopt='path-exclude=/usr/share/locale/*' \
        --dpkgopt='path-include=/usr/share/doc/*/copyright' \
        "$SUITE" "$work/base.tar" \
        "deb $MIRROR $SUITE main" \
        "deb $MIRROR $SUITE-updates main" \
        "deb $SECURITY $SUITE-security main"
    mv -f "$work/base.tar" "$tarball"
    rm -rf "$work"
    trap - EXIT
fi
# Imported once per tarball: the label says which one the image holds.
have=$(podman image inspect --format '{{index .Labels "crossroads.base"}}' "$BASE" 2>/dev/null || true)
if [ "$have" != "$key" ]; then
    echo "base: podman import $tarball as $BASE" >&2
    podman import --quiet --change "LABEL crossroads.base=$key" \
        --change 'CMD ["/bin/bash"]' "$tarball" "$BASE" >/dev/null
fi
# chroot isolation: RUN steps run without an OCI runtime, so neither the
# runtime's rlimits nor its cgroup setup get in the way (README, "Image").
# docker format: the OCI image format has no HEALTHCHECK.
set --
if [ -n "${PIP_CERT:-}" ]; then
    set -- "$@" --volume "$PIP_CERT:/run/crossroads-build-ca.pem:ro" \
        --build-arg PIP_CERT=/run/crossroads-build-ca.pem
fi
if [ -n "${PIP_INDEX_URL:-}" ]; then
    set -- "$@" --build-arg "PIP_INDEX_URL=$PIP_INDEX_URL"
fi
exec podman build --isolation=chroot --format=docker --build-arg "BASE=$BASE" "$@" \
    --tag "$IMAGE" --file "$ROOT/Containerfile" "$ROOT"
