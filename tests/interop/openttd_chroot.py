"""Debian root filesystems that carry newer OpenTTD releases than the host's.

The host (Debian bookworm) ships OpenTTD 13.0; trixie ships 14.1 and sid 15.1.
Each is a ``mmdebstrap --variant=minbase`` tree with ``openttd`` and
``openttd-opengfx`` (about 50 s and 400-520 MB each from the Debian mirror),
cached outside the checkout so that later runs reuse it:

- the cache is ``$CROSSROADS_CHROOT_CACHE`` or ``/var/cache/crossroads/chroots``;
- a tree's directory name carries a hash of its recipe (suite, mirror,
  packages, options), so a changed recipe builds a new tree;
- a build goes to a ``.partial`` directory renamed into place when mmdebstrap
  succeeded, so an interrupted build is never reused, and runs under an
  exclusive ``flock`` so parallel test workers build a tree once;
- mmdebstrap runs in a private mount namespace (``unshare -m``): the /proc and
  /dev mounts it makes inside the tree vanish with it, even when it is killed.

:func:`ChrootOpenTTD.command` runs the tree's ``openttd`` with the host's
network (loopback, or the network namespace the caller is in): a private mount
namespace mounts /dev, /proc, an empty /tmp and the test's work directory (at
the same path) inside the tree and then ``chroot``s, so the process is the
Popen's own pid (every step ``exec``s) and its mounts end with it.

Run ``python -m tests.interop.openttd_chroot`` to build the trees by hand.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

#: Debian suite carrying each OpenTTD release (packages.debian.org, observed:
#: trixie 14.1-1+b1, sid 15.1-1+b1).
SUITES = {"14.1": "trixie", "15.1": "sid"}
MIRROR = os.environ.get("CROSSROADS_DEBIAN_MIRROR", "http://deb.debian.org/debian")
PACKAGES = ("openttd", "openttd-opengfx")
OPTIONS = (
    "--variant=minbase",
    # A mirror frozen at a date (snapshot.debian.org, or a CI mirror that is not
    # refreshed) serves Release files past their Valid-Until (sid's expire after
    # a week): apt refuses them unless told not to check. The files are still
    # verified against the archive keyring.
    '--aptopt=Acquire::Check-Valid-Until "false"',
    # Documentation, manual pages and translations are ~10 % of the tree and
    # never read here.
    "--dpkgopt=path-exclude=/usr/share/man/*",
    "--dpkgopt=path-exclude=/usr/share/doc/*",
    "--dpkgopt=path-exclude=/usr/share/locale/*",
)
OPENTTD = "/usr/games/openttd"

#: Inside a private mount namespace: mount what OpenTTD needs, then chroot.
#: $1 is the tree, $2 the work directory to share (same path inside), then
#: the command. /tmp is a fresh tmpfs so nothing a run writes stays in the
#: cached tree.
_ENTER = """
set -e
root=$1; work=$2; shift 2
mount --rbind /dev "$root/dev"
mount --rbind /proc "$root/proc"
mount -t tmpfs -o size=64m,mode=1777 crossroads-tmp "$root/tmp"
mkdir -p "$root$work"
mount --bind "$work" "$root$work"
exec chroot "$root" "$@"
"""


def cache_dir() -> Path:
    return Path(
        os.environ.get("CROSSROADS_CHROOT_CACHE", "/var/cache/crossroads/chroots")
    )


def missing_requirement() -> str | None:
    """Why chroots cannot be built or entered here, or None."""
    if os.geteuid() != 0:
        return "OpenTTD chroots need root (mount namespaces and chroot)"
    for tool in ("mmdebstrap", "unshare", "chroot"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (make install)"
    return None


def recipe_name(suite: str) -> str:
    """The tree's directory name: the suite and a hash of everything that
    shapes it."""
    recipe = "\n".join((suite, MIRROR, *PACKAGES, *OPTIONS))
    return f"{suite}-{hashlib.sha256(recipe.encode()).hexdigest()[:12]}"


def _mounted_under(path: Path) -> list[str]:
    prefix = str(path).rstrip("/") + "/"
    with open("/proc/self/mountinfo") as mounts:
        points = [line.split()[4] for line in mounts]
    return [p for p in points if p == str(path) or p.startswith(prefix)]


def _remove(path: Path) -> None:
    """Delete a tree that may be a leftover of a killed build; never follow a
    mount out of it."""
    if not path.exists():
        return
    if _mounted_under(path):
        raise RuntimeError(f"{path} still has mounts: {_mounted_under(path)}")
    subprocess.run(["rm", "-rf", "--one-file-system", str(path)], check=True)


def ensure_tree(suite: str, say: Callable[[str], None] = print) -> Path:
    """The cached tree for ``suite``, built first if needed (see module doc)."""
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    name = recipe_name(suite)
    tree = cache / name
    if (tree / OPENTTD.lstrip("/")).exists():
        return tree
    with open(cache / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (tree / OPENTTD.lstrip("/")).exists():  # another worker built it
            return tree
        for stale in cache.glob(f".{name}.partial-*"):
            say(f"[chroot {suite}] removing an interrupted build {stale.name}")
            _remove(stale)
        partial = cache / f".{name}.partial-{os.getpid()}"
        command = [
            "unshare", "-m", "--propagation", "private",
            "mmdebstrap", *OPTIONS, f"--include={','.join(PACKAGES)}",
            suite, str(partial), MIRROR,
        ]  # fmt: skip
        say(f"[chroot {suite}] building {tree} from {MIRROR} (about a minute)")
        started = time.monotonic()
        # mmdebstrap inherits the lock: should this process be killed, another
        # worker waits until the orphaned build is over (it ends soon: its
        # output pipe is gone) before it removes the partial tree.
        process = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            pass_fds=(lock.fileno(),),
        )
        assert process.stdout is not None
        output: list[str] = []
        try:
            for line in process.stdout:
                output.append(line)
                if line.startswith(("I:", "E:", "W:")):
                    say(f"[chroot {suite}] {line.rstrip()}")
        except BaseException:  # interrupted: stop mmdebstrap (it cleans up on TERM)
            process.terminate()
            process.wait()
            _remove(partial)
            raise
        if process.wait() != 0:
            _remove(partial)
            raise RuntimeError(
                f"mmdebstrap {suite} failed ({process.returncode}):\n"
                + "".join(output[-40:])
            )
        os.rename(partial, tree)
        say(f"[chroot {suite}] ready in {time.monotonic() - started:.0f} s: {tree}")
        return tree


@dataclass(frozen=True)
class ChrootOpenTTD:
    """The ``openttd`` of one cached tree."""

    root: Path

    def command(self, argv: list[str], workdir: Path) -> list[str]:
        """``argv`` (starting with the binary's path inside the tree) run in
        the tree, with ``workdir`` shared at the same path."""
        return [
            "unshare", "-m", "--propagation", "private",
            "sh", "-c", _ENTER, "openttd-chroot", str(self.root), str(workdir),
            *argv,
        ]  # fmt: skip

    def version(self) -> str:
        """The release the binary prints (``OpenTTD 14.1``)."""
        done = subprocess.run(
            self.command([OPENTTD, "-h"], Path("/tmp")),
            capture_output=True,
            text=True,
            timeout=30,
        )
        match = re.search(r"OpenTTD (\S+)", done.stdout)
        if match is None:
            raise RuntimeError(f"no version in openttd -h:\n{done.stdout}{done.stderr}")
        return match.group(1)


def main() -> int:
    problem = missing_requirement()
    if problem:
        print(problem, file=sys.stderr)
        return 1
    for release, suite in SUITES.items():
        tree = ensure_tree(suite)
        print(f"OpenTTD {release}: {tree} -> {ChrootOpenTTD(tree).version()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
