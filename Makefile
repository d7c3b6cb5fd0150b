# The two commands: `make run` and `make test`. Both install what they need.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
DEBIAN_PACKAGES := redis-server coturn openttd openttd-opengfx miniupnpd iproute2 iptables nftables procps conntrack gcc libc6-dev stun-client chromium chromium-driver redis-sentinel prometheus systemd gnutls-bin libmbedtls-dev mmdebstrap podman runc pebble clang llvm libbpf-dev bpftool
ARGS ?=
IMAGE ?= localhost/crossroads:latest

.PHONY: install install-system install-python run test lint types pytest clean image image-test

install: install-system install-python

# Debian packages for the interop, Redis and NAT-lab tests. Idempotent: apt only
# runs when something is missing. chromium/chromium-driver drive the console
# test; redis-sentinel the failover test; prometheus brings promtool (on a host
# running systemd its package also enables a prometheus.service on :9090 —
# `systemctl disable --now prometheus` if unwanted); systemd brings
# systemd-analyze for the unit in deploy/.
# gnutls-bin brings gnutls-cli, libmbedtls-dev the mbedTLS library (UnityTLS's)
# for the Unity Relay DTLS interop tests.
# mmdebstrap builds the Debian trixie and sid trees that carry OpenTTD 14.1 and
# 15.1 (tests/interop/openttd_chroot.py, built by the tests on first use and
# cached outside the checkout) and the container image's base; podman builds
# the image (`make image`); runc runs it where crun cannot (hybrid cgroups:
# README, "Image").
# pebble is Let's Encrypt's test ACME CA, for --acme-domain (tests/test_acme.py).
install-system:
	@missing=""; for p in $(DEBIAN_PACKAGES); do \
	  dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  SUDO=""; [ "$$(id -u)" = 0 ] || SUDO=sudo; \
	  $$SUDO apt-get update -q && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q --no-install-recommends $$missing; \
	fi

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

install-python: $(BIN)/python
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'

run: $(BIN)/python
	@$(BIN)/python -c 'import crossroads' 2>/dev/null || $(MAKE) install-python
	CROSSROADS_TLS_DEV_CERT_DIR=$${CROSSROADS_TLS_DEV_CERT_DIR-.state/tls} \
		$(BIN)/crossroads serve $(ARGS)

lint:
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

types:
	$(BIN)/mypy --strict src

pytest:
	$(BIN)/pytest -q -p no:cacheprovider -rfE --durations=40 $(ARGS)

test: install lint types pytest

# The container image, localhost/crossroads:latest (Containerfile), from Debian's
# packages: nothing is pulled from a registry (README, "Image").
image: install-system
	deploy/container/build.sh $(IMAGE)

# Build it and run `crossroads serve` from it: STUN, TURN, the relay API, the
# health check (also part of `make test`).
image-test: install-system
	$(BIN)/pytest -q -p no:cacheprovider tests/test_image.py $(ARGS)

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
