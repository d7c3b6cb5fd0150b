"""Linux network namespaces: run commands in them, and open sockets inside them.

Two ways into a namespace, both used by the lab:

- a *process* runs in a namespace through ``ip netns exec NAME argv...`` (OpenTTD,
  miniupnpd, ``crossroads serve``, any command a user gives ``crossroads lab exec``);
- a *socket* is created in a namespace by switching the calling thread into it with
  ``setns(2)`` for the duration of the ``socket()`` call only. A socket stays in the
  namespace it was created in, so one asyncio process can hold sockets in every lab
  host at once and drive hundreds of probes without starting a process per probe.
  Nothing awaits while the thread is switched, so the event loop never runs in a
  foreign namespace.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import socket
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

#: Where ``ip netns add`` keeps its bind mounts (iproute2's NETNS_RUN_DIR).
NETNS_DIR = Path("/run/netns")

#: ``CLONE_NEWNET`` from <sched.h>: the namespace type argument of setns(2).
_CLONE_NEWNET = 0x40000000

_libc = ctypes.CDLL(None, use_errno=True)


class CommandError(RuntimeError):
    """A command run by the lab failed; the message carries its output."""


def _setns(fd: int) -> None:
    if _libc.setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


@contextlib.contextmanager
def entered(name: str) -> Iterator[None]:
    """Run the body with the calling thread inside namespace ``name``.

    The body must not await or block for long: it is meant for ``socket()`` calls.
    """
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        target = os.open(NETNS_DIR / name, os.O_RDONLY)
        try:
            _setns(target)
            try:
                yield
            finally:
                _setns(own)
        finally:
            os.close(target)
    finally:
        os.close(own)


def socket_in(
    name: str,
    kind: int = socket.SOCK_DGRAM,
    bind: tuple[str, int] | None = None,
    family: int = socket.AF_INET,
) -> socket.socket:
    """A non-blocking socket (IPv4 unless asked) living in namespace ``name``,
    bound if asked."""
    with entered(name):
        sock = socket.socket(family, kind)
    try:
        sock.setblocking(False)
        if kind == socket.SOCK_STREAM:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if bind is not None:
            sock.bind(bind)
    except BaseException:
        sock.close()
        raise
    return sock


def exists(name: str) -> bool:
    """Whether namespace ``name`` exists."""
    return (NETNS_DIR / name).exists()


def names(prefix: str) -> list[str]:
    """Every namespace whose name starts with ``prefix`` followed by ``-``."""
    if not NETNS_DIR.is_dir():
        return []
    return sorted(
        entry.name
        for entry in NETNS_DIR.iterdir()
        if entry.name.startswith(prefix + "-")
    )


async def run(
    argv: Sequence[str],
    *,
    input: bytes | None = None,
    check: bool = True,
    timeout: float = 30.0,
) -> str:
    """Run a command to completion; return its stdout (stderr joined on failure)."""
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(input), timeout)
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        raise
    if check and proc.returncode != 0:
        raise CommandError(
            f"{' '.join(argv)} exited {proc.returncode}: "
            f"{err.decode(errors='replace').strip()}"
        )
    return out.decode(errors="replace")


async def run_in(name: str, argv: Sequence[str], **kwargs: object) -> str:
    """:func:`run` inside namespace ``name``."""
    return await run(["ip", "netns", "exec", name, *argv], **kwargs)  # type: ignore[arg-type]


async def ip_batch(lines: Sequence[str], netns: str | None = None) -> None:
    """Run many ``ip`` commands in one process (``ip -batch``), optionally in a netns."""
    if not lines:
        return
    argv = ["ip"]
    if netns is not None:
        argv += ["-n", netns]
    argv += ["-batch", "-"]
    await run(argv, input=("\n".join(lines) + "\n").encode())


def write_sysctl(name: str, values: dict[str, str]) -> None:
    """Set ``net.*`` sysctls of namespace ``name`` (``/proc/sys/net`` is per netns)."""
    with entered(name):
        for key, value in values.items():
            path = Path("/proc/sys") / key.replace(".", "/")
            path.write_text(value)


def spawn(
    name: str,
    argv: Sequence[str],
    *,
    log: Path,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> int:
    """Start a long-running process in namespace ``name``; return its pid.

    It gets its own session (so :func:`kill_group` stops it and its children), and
    its output goes to ``log``. ``ip netns exec`` execs the command, so the pid is
    the command's own.
    """
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            ["ip", "netns", "exec", name, *argv],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
            cwd=cwd,
        )
    return proc.pid


def alive(pid: int) -> bool:
    """Whether a process with this pid exists (and is not a zombie of ours)."""
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return False
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


async def kill_group(pid: int, grace: float = 2.0) -> None:
    """Stop the session led by ``pid``: SIGTERM, then SIGKILL after ``grace``."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 1.0)):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        except PermissionError:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = asyncio.get_running_loop().time() + wait
        while alive(pid):
            if asyncio.get_running_loop().time() > deadline:
                break
            await asyncio.sleep(0.05)
        else:
            return
