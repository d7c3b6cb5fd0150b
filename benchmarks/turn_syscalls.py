"""System calls and CPU per relayed TURN datagram at one fixed rate, side by side.

    .venv/bin/python benchmarks/turn_syscalls.py [--rate 50000] [--trials 5] [--before DIR]

Where :mod:`turn_saturation` says how much CPU a datagram costs, this says which
system calls it costs: the same servers, the same load (``turn_load.c``, 32
allocations, ChannelData and Send/Data indications both ways) at one offered
rate, and ``perf stat`` counting the server process tree's ``sendmmsg``,
``recvmmsg``, ``sendto``, ``recvfrom`` and ``epoll_wait``/``epoll_pwait`` calls
(kernel tracepoints: ``perf`` from the Debian package ``linux-perf``, as root)
during a measured window. Printed per delivered datagram, for crossroads
(``--workers 1``), optionally another source tree (``--before DIR``, as in
turn_saturation.py) and the bare C forwarder, ``--trials`` times interleaved,
then the medians. ``--no-perf`` measures CPU only (the tracepoints cost a
little per call). Loopback only; every process is stopped at the end.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import turn_saturation as saturation  # noqa: E402

SYSCALLS = ("sendmmsg", "recvmmsg", "sendto", "recvfrom", "epoll_wait", "epoll_pwait")


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (a supervisor's workers)."""
    found = [pid]
    for parent in found:
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                found += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
    return found


def count_calls(pids: list[int], seconds: float) -> subprocess.Popen[str]:
    """``perf stat`` of the syscall tracepoints of ``pids`` for ``seconds``."""
    events = ",".join(f"syscalls:sys_enter_{name}" for name in SYSCALLS)
    command = ["perf", "stat", "-x,", "-e", events, "-p", ",".join(map(str, pids))]
    return subprocess.Popen(
        [*command, "--", "sleep", str(seconds)], stderr=subprocess.PIPE, text=True
    )


def parse_counts(text: str) -> dict[str, int]:
    counts = {}
    for line in text.splitlines():
        fields = line.split(",")
        if len(fields) > 2 and "sys_enter_" in fields[2] and fields[0].isdigit():
            counts[fields[2].split("sys_enter_")[1]] = int(fields[0])
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=50_000)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0, help="measured/trial")
    parser.add_argument(
        "--before", type=Path, help="a crossroads source tree (DIR/src)"
    )
    parser.add_argument("--no-perf", action="store_true", help="CPU only")
    options = parser.parse_args()
    if not options.no_perf and shutil.which("perf") is None:
        raise SystemExit("perf (Debian: linux-perf) is needed, or --no-perf")
    step_args = argparse.Namespace(
        warmup=0.5, seconds=options.seconds, drain=0.3, payload=100
    )
    with tempfile.TemporaryDirectory() as workdir:
        binaries = saturation.build(Path(workdir))
        starters: list[tuple[str, Callable[[], saturation.Target]]] = [
            ("crossroads --workers 1", lambda: saturation.start_crossroads_turn(1))
        ]
        if options.before is not None:
            before = saturation.Variant(" (before)", source=options.before.resolve())
            starters.append(
                (
                    "crossroads --workers 1 (before)",
                    lambda: saturation.start_crossroads_turn(1, before),
                )
            )
        starters.append(
            (
                "bare forwarder",
                lambda: saturation.start_bare(
                    binaries["bare_forwarder"], 32, pairs=False
                ),
            )
        )
        rows: dict[str, list[dict[str, float]]] = {}
        for trial in range(options.trials):
            for label, starter in starters:
                with ExitStack() as stack:
                    target = starter()
                    stack.callback(saturation.stop, target.process)
                    flows = target.flows(stack, 32, step_args.payload)
                    pids = process_tree(target.process.pid)
                    # The window opens with the load's warm-up over: perf
                    # starts at the same moment as the step's CPU window.
                    perf = (
                        None
                        if options.no_perf
                        else count_calls(pids, step_args.warmup + options.seconds)
                    )
                    step = saturation.run_step(
                        binaries["turn_load"], target, flows, options.rate, step_args, 1
                    )
                    counts = parse_counts(perf.communicate()[1]) if perf else {}
                # perf counted over warm-up + window, at the delivered rate.
                packets = step.delivered * (step_args.warmup + options.seconds)
                row = {"us CPU": step.us_per_packet, "loss %": step.loss}
                row.update({name: n / packets for name, n in counts.items() if n})
                rows.setdefault(label, []).append(row)
                shown = "  ".join(f"{k} {v:.3f}" for k, v in row.items())
                print(f"trial {trial + 1}  {label:<32} {shown}", flush=True)
    print(f"\nmedians at {options.rate:.0f}/s, per delivered datagram:")
    for label, trials in rows.items():
        keys = sorted({key for row in trials for key in row})
        medians = {k: statistics.median(r.get(k, 0.0) for r in trials) for k in keys}
        print(f"  {label:<32} " + "  ".join(f"{k} {v:.3f}" for k, v in medians.items()))


if __name__ == "__main__":
    main()
