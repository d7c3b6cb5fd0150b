"""Method ``openttd``: a real OpenTTD 13 dedicated server (``openttd -D``) on
host A and a real OpenTTD client on host B join by invite code through
crossroads' OpenTTD coordinator, STUN and TURN services on the lab server.

The coordinator decides the path exactly as it does for real players
(reference ``openttd-coordinator.md`` sections 6-7): its direct probe reaches the
server's game port (``direct``); otherwise both sides report their reflexive TCP
address to crossroads' OpenTTD STUN service and open TCP connections to each
other at once (TCP simultaneous open: ``punch``); when that fails too, both
connect to crossroads' OpenTTD TURN relay (``relay``). The client's log
(``-d net=5``) names the peer its game connection reached, which tells the three
apart; the server's log shows the join.

OpenTTD is all TCP, so ``udp-blocked`` does not matter. The lab NATs translate
TCP with Linux ``masquerade``, which keeps the source port (endpoint-independent
mapping in practice) except on ``symmetric-random`` (``fully-random``): hole
punching works unless a NATed side randomizes its ports, and TURN carries the
rest (:func:`expected_via`).

Each attempt costs two OpenTTD processes and ~10 s (start-up, a 64x64 map, the
join; more when STUN must fail first), so the default matrix runs only
:data:`CI_PAIRS`; ``crossroads lab matrix --methods openttd`` runs every pair.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import tempfile
import time
from pathlib import Path

from crossroads.lab.kinds import NatKind, every_pair
from crossroads.lab.matrix import Attempt, Method, Outcome, register
from crossroads.lab.topology import SERVER_IPS, Lab, Site

OPENTTD = shutil.which("openttd") or "/usr/games/openttd"
#: crossroads' OpenTTD ports on the lab server (DESIGN.md default ports).
COORDINATOR_PORT, STUN_PORT, TURN_PORT = 3976, 3975, 3974
#: OpenTTD's default game port; each lab host is its own namespace.
GAME_PORT = 3979
#: Start-up plus map generation take 3-11 s on a loaded 2-core machine
#: (reference section 10); the coordinator probe adds up to 7 s.
REGISTER_S = 40.0
#: The coordinator's own join limit is 20 s (``openttd.connect_timeout``), plus
#: the map download and the client's start-up.
JOIN_S = 45.0
#: The default matrix's pairs (one per path, the TCP-only firewall, the remap
#: routers).
CI_PAIRS = (
    ("open", "open"),
    ("full-cone", "port-restricted-cone"),
    ("symmetric-random", "symmetric-random"),
    ("open", "udp-blocked"),
    # TCP simultaneous open behind routers that answer a knocking SYN (docs/natneg.md)
    ("port-restricted-remap", "port-restricted-remap"),
)

_INVITE = re.compile(
    r"Connection type: +([^\n]+?)\s*\n.*?Invite code: +(\+[A-Za-z0-9]+)", re.S
)
_USING = re.compile(r"- using (\d+\.\d+\.\d+\.\d+):(\d+) \(IPv4\)")


def _config(directory: Path, network: dict[str, str]) -> Path:
    lines = ["[network]"] + [f"{k} = {v}" for k, v in network.items()]
    # A 64x64 map without AI: start-up in seconds (reference section 10).
    lines += ["[game_creation]", "map_x = 6", "map_y = 6"]
    lines += ["[difficulty]", "max_no_competitors = 0"]
    path = directory / "openttd.cfg"
    path.write_text("\n".join(lines) + "\n")
    return path


async def _spawn(
    lab: Lab, site: Site, argv: list[str], workdir: Path, name: str, cpu: int
) -> asyncio.subprocess.Process:
    """OpenTTD in ``site``'s host namespace, on one core under SCHED_BATCH
    (reference section 10, "OpenTTD 13 connect race"), in its own session."""
    home = workdir / f"home-{name}"
    home.mkdir()
    env = {
        **os.environ,
        "HOME": str(home),
        "OTTD_COORDINATOR_CS": f"{SERVER_IPS[0]}:{COORDINATOR_PORT}",
        "OTTD_STUN_CS": f"{SERVER_IPS[0]}:{STUN_PORT}",
    }
    command = ["ip", "netns", "exec", lab.host_ns(site)]
    command += ["taskset", "-c", str(cpu), "chrt", "-b", "0", OPENTTD, *argv]
    with (workdir / f"{name}.log").open("wb") as out:
        # The open stdin pipe keeps the dedicated server's console alive.
        return await asyncio.create_subprocess_exec(
            *command,
            stdin=asyncio.subprocess.PIPE,
            stdout=out,
            stderr=asyncio.subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )


async def _stop(process: asyncio.subprocess.Process) -> None:
    if process.returncode is not None:
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        try:
            await asyncio.wait_for(process.wait(), 3.0)
            return
        except TimeoutError:
            continue


async def _wait(
    log: Path,
    pattern: re.Pattern[str],
    timeout: float,
    process: asyncio.subprocess.Process,
) -> re.Match[str] | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace") if log.exists() else ""
        match = pattern.search(text)
        if match:
            return match
        if process.returncode is not None:
            return None
        await asyncio.sleep(0.2)
    return None


def classify(connection_type: str, used: list[tuple[str, int]], a: Site) -> str:
    """The path of the game connection: the client's last ``- using`` peer."""
    host, port = used[-1]
    if (host, port) == (SERVER_IPS[0], TURN_PORT):
        return "relay"
    if connection_type == "Public" and port == GAME_PORT:
        return "direct"
    return "punch"


async def run(attempt: Attempt) -> Outcome:
    lab, a, b = attempt.lab, attempt.a, attempt.b
    workdir = Path(tempfile.mkdtemp(prefix=f"openttd-{a.name}-{b.name}-"))
    processes: list[asyncio.subprocess.Process] = []
    try:
        server_cfg = workdir / "server"
        server_cfg.mkdir()
        config = _config(
            server_cfg,
            {
                "server_game_type": "invite-only",
                "server_port": str(GAME_PORT),
                "server_name": f"lab {a.name}",
                "client_name": "srv",
            },
        )
        argv = [
            "-D",
            f"{a.host_ip}:{GAME_PORT}",
            "-c",
            str(config),
            "-x",
            "-d",
            "net=3",
        ]
        server = await _spawn(lab, a, argv, workdir, "server", 0)
        processes.append(server)
        registered = await _wait(workdir / "server.log", _INVITE, REGISTER_S, server)
        if registered is None:
            return Outcome(False, detail="the server did not register")
        connection_type, code = registered.group(1), registered.group(2)
        started = time.monotonic()
        client_cfg = workdir / "client"
        client_cfg.mkdir()
        # use_relay_service lives in openttd.cfg in 13; "allow" answers the
        # relay question a GUI would ask.
        config = _config(
            client_cfg, {"client_name": "labclient", "use_relay_service": "allow"}
        )
        argv = ["-c", str(config), "-x", "-n", code, "-v", "null:ticks=100000000"]
        argv += ["-s", "null", "-m", "null", "-d", "net=5"]
        client = await _spawn(lab, b, argv, workdir, "client", 1)
        processes.append(client)
        joined = re.compile(r"labclient has joined the game")
        if await _wait(workdir / "server.log", joined, JOIN_S, server) is None:
            return Outcome(False, detail=f"no join (server: {connection_type})")
        seconds = time.monotonic() - started
        text = (workdir / "client.log").read_text(errors="replace")
        used = [(h, int(p)) for h, p in _USING.findall(text)]
        used = [u for u in used if u[1] not in (COORDINATOR_PORT, STUN_PORT)]
        if not used:
            return Outcome(False, detail="joined, but no game connection in the log")
        return Outcome(True, classify(connection_type, used, a), seconds)
    finally:
        await asyncio.gather(*(_stop(p) for p in processes))
        shutil.rmtree(workdir, ignore_errors=True)


def expected_via(server: NatKind, client: NatKind) -> str | None:
    """The path the coordinator must find, the server on ``server``'s site.

    Not predicted with a router that answers a knocking SYN
    (``accepts_unsolicited``): the SYNs cross when the coordinator's timing error
    (mostly the dedicated server's 0-30 ms game-tick phase, docs/natneg.md) stays
    below the delay between the two sites, else the knocked router sends a RST
    and TURN carries the game (5 of 6 runs punched with 20-80 ms per path)."""
    if not server.natted:
        return "direct"
    if "symmetric-random" in (server.name, client.name):
        return "relay"
    if server.accepts_unsolicited or client.accepts_unsolicited:
        return None
    return "punch"


METHOD = register(
    Method(
        name="openttd",
        summary="real OpenTTD 13 server and client, invite code through crossroads' "
        "coordinator (direct probe, STUN punch, TURN)",
        run=run,
        # OpenTTD is TCP only and TURN over TCP passes every lab site.
        expected=every_pair,
        timeout=100.0,
        max_parallel=1,
        needs=("openttd",),
        expected_via=expected_via,
        default_pairs=CI_PAIRS,
    )
)
