"""TURN over TLS and DTLS throughput: crossroads against coturn, same
certificate, same load.

The load of ``benchmarks/turn.py`` (coturn's ``turnutils_uclient -c -z I -m M``
with ``turnutils_peer`` as the echo peer: M sessions, each a 120-byte message
every I ms (``--interval``, default 1) through a channel to the peer and back,
M x 2000 / I relayed datagrams/s offered) but with ``-t -S``: each client talks TURN over TLS (TCP)
to the server's TLS port; the peer side stays UDP. ``--transport dtls`` runs
``-S`` instead: TURN over DTLS (UDP) to the same port number. Both servers get the same
self-signed certificate (made by crossroads' development-certificate helper),
one process / one relay thread each, pinned to CPU 0, the load to CPU 1.

Figures: the highest relayed rate under 0.5 % loss, and the server CPU per
packet at the highest load both passed (the figure that compares the servers
on a machine where the generator saturates first).

Usage::

    .venv/bin/python benchmarks/turn_tls.py                    # default steps
    .venv/bin/python benchmarks/turn_tls.py --steps 5,10 --rounds 1

    .venv/bin/python benchmarks/turn_tls.py --transport dtls --interval 5

Everything runs on 127.0.0.1 with ephemeral ports and is bounded in time.
uclient picks DTLS 1.0 or 1.2 at random per connection; both servers refuse
1.0 on this machine's OpenSSL and uclient retries with 1.2, so the DTLS runs
measure DTLS 1.2 on both.
"""

from __future__ import annotations

import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from crossroads.transport.tls import development_certificate  # noqa: E402
from turn import (  # noqa: E402
    EXTRA_ARGS,
    Server,
    argument_parser,
    interleaved,
    prepare,
    start_coturn,
    start_crossroads,
    summarize,
)


def wait_tls_listening(server: Server, timeout: float = 15.0) -> None:
    """Until the server's TLS port accepts a TCP connection."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", server.client_port), 0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{server.name}: TLS port {server.client_port} never listened")


def main() -> None:
    parser = argument_parser(__doc__, "5,10,20")
    parser.add_argument(
        "--interval",
        type=int,
        default=1,
        help="ms between two messages of a session (uclient -z)",
    )
    parser.add_argument(
        "--transport",
        choices=("tls", "dtls"),
        default="tls",
        help="tls: uclient -t -S (TCP); dtls: uclient -S (UDP)",
    )
    args = parser.parse_args()
    if args.transport == "dtls":
        # Every uclient session comes from 127.0.0.1 and leaves its allocation
        # (and DTLS session) to expire: over a run of steps that is more than
        # the per-IP session cap and allocation quotas. coturn has neither by
        # default (over TLS, closing the connection ends the allocation).
        EXTRA_ARGS.extend(
            [
                "--stun-tcp-max-connections-per-ip", "100000",
                "--turn-user-quota", "0", "--turn-ip-quota", "0",
            ]
        )  # fmt: skip
    name = args.transport.upper()
    flags = ("-t", "-S") if args.transport == "tls" else ("-S",)
    steps, server_cpus, load_cpus = prepare(
        args, f"TURN over {name}", f"{' '.join(flags)} -c -z {args.interval}"
    )
    label_c, label_x = f"coturn {name} (1 thread)", f"crossroads {name} (1 proc)"
    certificate_dir = Path(tempfile.mkdtemp(prefix="bench-tls-"))
    tls = development_certificate(certificate_dir)
    servers: list[tuple[str, Server]] = []
    try:
        servers.append((label_c, start_coturn(1, server_cpus, tls)))
        servers.append((label_x, start_crossroads(1, server_cpus, tls)))
        for _, server in servers:
            wait_tls_listening(server)
        print()
        results = interleaved(
            servers,
            steps,
            args.messages,
            load_cpus,
            args.rounds,
            flags,
            args.interval,
        )
    finally:
        for _, server in servers:
            server.stop()
        shutil.rmtree(certificate_dir, ignore_errors=True)
    summarize(label_c, label_x, results)


if __name__ == "__main__":
    main()
