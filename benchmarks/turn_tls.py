"""TURN over TLS throughput: crossroads against coturn, same certificate, same load.

The load of ``benchmarks/turn.py`` (coturn's ``turnutils_uclient -c -z I -m M``
with ``turnutils_peer`` as the echo peer: M sessions, each a 120-byte message
every I ms (``--interval``, default 1) through a channel to the peer and back,
M x 2000 / I relayed datagrams/s offered) but with ``-t -S``: each client talks TURN over TLS (TCP)
to the server's TLS port; the peer side stays UDP. Both servers get the same
self-signed certificate (made by crossroads' development-certificate helper),
one process / one relay thread each, pinned to CPU 0, the load to CPU 1.

Figures: the highest relayed rate under 0.5 % loss, and the server CPU per
packet at the highest load both passed (the figure that compares the servers
on a machine where the generator saturates first).

Usage::

    .venv/bin/python benchmarks/turn_tls.py                    # default steps
    .venv/bin/python benchmarks/turn_tls.py --steps 5,10 --rounds 1

Everything runs on 127.0.0.1 with ephemeral ports and is bounded in time.
DTLS is not measured: crossroads does not serve TURN over DTLS yet.
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
    args = parser.parse_args()
    steps, server_cpus, load_cpus = prepare(
        args, "TURN over TLS", f"-t -S -c -z {args.interval}"
    )
    label_c, label_x = "coturn TLS (1 thread)", "crossroads TLS (1 proc)"
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
            ("-t", "-S"),
            args.interval,
        )
    finally:
        for _, server in servers:
            server.stop()
        shutil.rmtree(certificate_dir, ignore_errors=True)
    summarize(label_c, label_x, results)


if __name__ == "__main__":
    main()
