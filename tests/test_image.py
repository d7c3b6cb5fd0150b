"""The container image (Containerfile, deploy/container/build.sh).

The image is built here as ``make image`` builds it: the base root filesystem
from Debian's packages with mmdebstrap (cached in /var/cache/crossroads/image,
written atomically), imported into podman, then the Containerfile on it with
buildah's chroot isolation. Then ``crossroads serve`` runs from the image, as its
unprivileged user with the state directory as a volume, and answers STUN, TURN
(an allocation relays both ways) and the relay API (an allocation binds), passes
its own HEALTHCHECK, and stops cleanly on SIGTERM.

How the container is run on this kind of machine (README, "Image"): root without
CAP_SYS_RESOURCE cannot raise a limit above its own hard limit, so the limits
are given explicitly at or below ours (``--ulimit``); crun refuses a host with
hybrid cgroups (v1 controllers and a v2 mount), runc runs there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import resource
import shutil
import socket
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import httpx
import pytest

from crossroads.client.stun import stun_binding
from crossroads.client.turn import TurnClient, rest_credentials
from crossroads.config import SECTIONS, env_name, setting_info
from crossroads.services import load_service_modules
from tests.conftest import eventually
from tests.e2e.relay_support import (
    BIND_RECEIVED,
    RawPeer,
    endpoint_address,
    raw_bind,
)

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "deploy" / "container" / "build.sh"
#: Its own tag, so that the test never replaces an operator's image.
IMAGE = "localhost/crossroads:make-test"
#: The image's user (Containerfile).
UID = 10001
SERVICES = "stun,turn,relay"

pytestmark = pytest.mark.timeout(900)


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} missing: make install")
    return path


@pytest.fixture(scope="module")
def image() -> str:
    """Build the image (every step cached after the first build: mmdebstrap
    ~40 s, the build stage's compiler and dependencies ~90 s; then only the
    sources' layers, a few seconds)."""
    for name in ("mmdebstrap", "podman"):
        tool(name)
    started = time.monotonic()
    result = subprocess.run(
        [str(BUILD), IMAGE],
        capture_output=True,
        text=True,
        timeout=840,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    print(f"image built in {time.monotonic() - started:.1f} s")
    return IMAGE


def runtime_flags() -> list[str]:
    """What makes ``podman run`` work here (module docstring): runc when the
    machine has it, limits at or below our own hard limits."""
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if nofile == resource.RLIM_INFINITY or nofile > 1_048_576:
        nofile = 1_048_576
    flags = ["--ulimit", f"nofile={nofile}:{nofile}", "--ulimit", "nproc=4096:4096"]
    if shutil.which("runc"):
        flags = ["--runtime", "runc", *flags]
    return flags


def free_tcp_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def port_environment() -> dict[str, str]:
    """Every port of the services run set to 0 (the OS picks): no clash with
    another test or server on this machine's loopback."""
    load_service_modules()
    env = {}
    for section in SERVICES.split(","):
        for f in dataclasses.fields(SECTIONS[section]):
            if setting_info(f).kind == "port":
                env[env_name(section, f)] = "0"
    return env


@dataclasses.dataclass
class Container:
    name: str
    http: str
    state: Path

    def logs(self) -> str:
        result = subprocess.run(
            ["podman", "logs", self.name], capture_output=True, text=True, timeout=30
        )
        return result.stdout + result.stderr

    def stun_port(self) -> int:
        match = re.search(r"stun: udp 127\.0\.0\.1:(\d+)", self.logs())
        assert match is not None, self.logs()
        return int(match.group(1))


@pytest.fixture
def container(image: str, tmp_path: Path) -> Iterator[Container]:
    state = tmp_path / "state"
    state.mkdir()
    os.chown(state, UID, UID)
    http_port = free_tcp_port()
    name = f"crossroads-test-{os.getpid()}"
    # The HTTP port as the environment variable, not a flag: the image's
    # HEALTHCHECK reads it from there.
    env = {
        "CROSSROADS_HTTP_PORT": str(http_port),
        # SIGTERM drains: the test's relay session is still bound when it
        # stops the container, so the drain ends at this timeout.
        "CROSSROADS_DRAIN_TIMEOUT": "2",
        **port_environment(),
    }
    command = [
        "podman", "run", "--detach", "--name", name, "--network", "host",
        # The check is run below with `podman healthcheck run`; no systemd
        # timer (there is no systemd here to run one).
        "--health-interval", "disable",
        # As deploy/kubernetes runs it: readOnlyRootFilesystem.
        "--read-only",
        *runtime_flags(),
        "--volume", f"{state}:/var/lib/crossroads",
        *(arg for key, value in env.items() for arg in ("--env", f"{key}={value}")),
        image, "serve", "--host", "127.0.0.1", "--only", SERVICES,
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    running = Container(name, f"http://127.0.0.1:{http_port}", state)
    try:
        yield running
    finally:
        subprocess.run(
            ["podman", "rm", "--force", "--time", "5", name],
            capture_output=True,
            timeout=60,
        )


def healthy(url: str) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        with contextlib.suppress(httpx.HTTPError):
            async with httpx.AsyncClient(timeout=2) as http:
                return (await http.get(f"{url}/healthz")).status_code == 200
        return False

    return check


def test_image_config(image: str) -> None:
    result = subprocess.run(
        ["podman", "image", "inspect", image],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    inspected = json.loads(result.stdout)[0]
    config = inspected["Config"]
    assert config["User"] == f"{UID}:{UID}"
    assert "/var/lib/crossroads" in config["Volumes"]
    assert config["Env"].count("CROSSROADS_STATE_DIR=/var/lib/crossroads") == 1
    assert config["Entrypoint"] == ["crossroads"]
    assert config["Cmd"][0] == "serve"
    assert "/healthz" in " ".join(inspected["Healthcheck"]["Test"])
    assert config["StopSignal"] == "SIGTERM"


async def test_serve_from_the_image_answers_stun_turn_and_relay(
    container: Container,
) -> None:
    await eventually(healthy(container.http), "/healthz of the container", 60)
    # The first run wrote its credentials into the volume, as the image's user.
    credentials_file = container.state / "credentials.json"
    assert credentials_file.stat().st_uid == UID
    assert credentials_file.stat().st_mode & 0o077 == 0
    credentials = json.loads(credentials_file.read_text())
    # server.json (for `crossroads drain`) is written once start() returned,
    # which /healthz answers before.
    server_file = container.state / "server.json"

    async def server_file_written() -> bool:
        return server_file.exists()

    await eventually(server_file_written, "server.json in the volume", 30)

    # STUN: a Binding request is answered with our own address.
    stun = ("127.0.0.1", container.stun_port())
    binding = await stun_binding(stun)
    assert binding.mapped == binding.local

    # TURN: an allocation relays a datagram to a peer and the peer's answer back.
    peer = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    peer.bind(("127.0.0.1", 0))
    peer.settimeout(5)
    try:
        username, password = rest_credentials(credentials["turn_secret"], "dev")
        async with await TurnClient.connect(stun, username, password) as turn:
            relayed = await turn.allocate()
            await turn.create_permission(peer.getsockname())
            await turn.send(b"through the image", peer.getsockname())
            data, source = peer.recvfrom(2048)
            assert (data, source) == (b"through the image", relayed)
            peer.sendto(b"and back", relayed)
            assert await turn.receive(timeout=5) == (b"and back", peer.getsockname())
    finally:
        peer.close()

    # The relay API: an allocation whose relay endpoint binds.
    headers = {"Authorization": f"Bearer {credentials['relay_api_key']}"}
    async with httpx.AsyncClient(base_url=container.http, headers=headers) as http:
        response = await http.post("/v1/allocate", json={"maxConnections": 2})
        assert response.status_code == 201, response.text
        allocation = response.json()["data"]["allocation"]
    relay = RawPeer(endpoint_address(allocation, "udp"))
    try:
        assert await relay.request(raw_bind(allocation, nonce=0)) == BIND_RECEIVED
    finally:
        relay.close()

    # The image's own HEALTHCHECK passes.
    check = subprocess.run(
        ["podman", "healthcheck", "run", container.name],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert check.returncode == 0, check.stdout + check.stderr

    # SIGTERM (podman stop) drains: the bound relay session holds the
    # process until --drain-timeout (2 s here), then it exits cleanly, well
    # before podman's SIGKILL.
    stop = subprocess.run(
        ["podman", "stop", "--time", "30", container.name],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert stop.returncode == 0, stop.stderr
    inspect = subprocess.run(
        ["podman", "inspect", "--format", "{{.State.ExitCode}}", container.name],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert inspect.stdout.strip() == "0", container.logs()
    assert "INFO crossroads: stopped" in container.logs()
