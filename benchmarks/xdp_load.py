"""An in-kernel load generator and sink for benchmarks/kernel_plane.py.

See ``xdp_load.bpf.c`` for the programs. This module builds the object with
clang (as ``make install`` builds the relay's), loads it through libbpf
(ctypes, as crossroads.transport.kernelplane does), attaches the sink and
pass programs, gives a veth its own NAPI thread on a chosen CPU, and runs
the generator from a thread of this process pinned to the generator's CPU
and entered into the sender's namespace.

Why threaded NAPI: a veth receives frames in the NAPI poll of the CPU that
transmitted them, so the relay's work would run on the generator's core and
"per server core" would mean nothing. With ``/sys/class/net/DEV/threaded``
the poll runs in a kernel thread (``napi/DEV-ID``) that can be pinned:
the server's receive device gets its own thread on the server core, where
everything the relay does to a packet (the eBPF program, or the stack and a
relay process pinned there too) is then charged.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
import struct
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tests.transport.netns_support import ifindex_of

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "xdp_load.bpf.c"

#: include/uapi/linux/if_link.h
XDP_FLAGS_DRV_MODE = 1 << 2
#: include/uapi/linux/bpf.h (Linux 5.18)
BPF_F_TEST_XDP_LIVE_FRAMES = 1 << 1
#: Iterations of the generator per BPF_PROG_TEST_RUN call. A live-frames
#: call costs ~28 ms of setup and teardown on this machine (its page pool)
#: whatever its length, during which nothing is sent; 2^23 iterations (a
#: paced one, dropped in place, takes ~80 ns) keep that gap to a few percent
#: of a call. A gap only lowers the offered rate, which is measured.
ITERATIONS = 1 << 23
#: Frames per transmit flush (the kernel's NAPI budget, its default too).
BATCH = 64


def build(workdir: Path) -> Path:
    out = workdir / "xdp_load.bpf.o"
    subprocess.run(
        [
            "clang", "-I/usr/include/x86_64-linux-gnu", "-O2", "-g", "-Wall",
            "-target", "bpf", "-c", str(SOURCE), "-o", str(out),
        ],
        check=True,
    )  # fmt: skip
    return out


class _TestRunOpts(ctypes.Structure):
    _fields_ = [
        ("sz", ctypes.c_size_t),
        ("data_in", ctypes.c_void_p),
        ("data_out", ctypes.c_void_p),
        ("data_size_in", ctypes.c_uint32),
        ("data_size_out", ctypes.c_uint32),
        ("ctx_in", ctypes.c_void_p),
        ("ctx_out", ctypes.c_void_p),
        ("ctx_size_in", ctypes.c_uint32),
        ("ctx_size_out", ctypes.c_uint32),
        ("retval", ctypes.c_uint32),
        ("repeat", ctypes.c_int),
        ("duration", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("cpu", ctypes.c_uint32),
        ("batch_size", ctypes.c_uint32),
    ]


def _lib() -> ctypes.CDLL:
    lib = ctypes.CDLL(ctypes.util.find_library("bpf") or "libbpf.so.1", use_errno=True)
    vp, cp, i, u32 = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint32
    for name, args, res in (
        ("bpf_object__open_file", [cp, vp], vp),
        ("bpf_object__load", [vp], i),
        ("bpf_object__close", [vp], None),
        ("bpf_object__find_program_by_name", [vp, cp], vp),
        ("bpf_object__find_map_by_name", [vp, cp], vp),
        ("bpf_program__fd", [vp], i),
        ("bpf_map__fd", [vp], i),
        ("bpf_map_update_elem", [i, vp, vp, ctypes.c_uint64], i),
        ("bpf_map_lookup_elem", [i, vp, vp], i),
        ("bpf_xdp_attach", [i, i, u32, vp], i),
        ("bpf_xdp_detach", [i, u32, vp], i),
        ("bpf_prog_test_run_opts", [i, vp], i),
        ("libbpf_num_possible_cpus", [], i),
    ):
        func = getattr(lib, name)
        func.argtypes = args
        func.restype = res
    return lib


_STATE = struct.Struct("=QQQQIIII")  # struct gen_state
#: struct flow's frame (xdp_load.bpf.c FRAME_MAX).
FRAME_MAX = 1536


def napi_threads() -> dict[int, str]:
    threads = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                name = (entry / "comm").read_text().strip()
                if name.startswith("napi/"):
                    threads[int(entry.name)] = name
    return threads


def thread_ticks(pid: int) -> int:
    """utime + stime of a (kernel) thread, in clock ticks."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


@dataclass(eq=False)
class Loader:
    """The loaded object; attachments are undone by :meth:`close`."""

    lib: ctypes.CDLL
    obj: int
    _attached: list[tuple[str, int]] = field(default_factory=list)

    @classmethod
    def load(cls, path: Path) -> Loader:
        lib = _lib()
        obj = lib.bpf_object__open_file(str(path).encode(), None)
        if not obj:
            raise OSError(ctypes.get_errno(), f"open {path}")
        if lib.bpf_object__load(obj):
            lib.bpf_object__close(obj)
            raise OSError(ctypes.get_errno(), f"load {path}")
        return cls(lib, obj)

    def prog_fd(self, name: str) -> int:
        prog = self.lib.bpf_object__find_program_by_name(self.obj, name.encode())
        return int(self.lib.bpf_program__fd(prog))

    def map_fd(self, name: str) -> int:
        found = self.lib.bpf_object__find_map_by_name(self.obj, name.encode())
        return int(self.lib.bpf_map__fd(found))

    def attach(self, ns: str, device: str, program: str) -> None:
        """Attach ``program`` in driver mode to ``device`` of namespace ``ns``."""
        from tests.transport.netns_support import inside

        index = ifindex_of(ns, device)
        with inside(ns):
            rc = self.lib.bpf_xdp_attach(
                index, self.prog_fd(program), XDP_FLAGS_DRV_MODE, None
            )
        if rc:
            raise OSError(-rc, f"XDP attach {program} to {ns}/{device}")
        self._attached.append((ns, index))

    def detach(self, ns: str, device: str) -> None:
        from tests.transport.netns_support import inside

        index = ifindex_of(ns, device)
        with inside(ns):
            self.lib.bpf_xdp_detach(index, XDP_FLAGS_DRV_MODE, None)
        self._attached.remove((ns, index))

    def close(self) -> None:
        from tests.transport.netns_support import inside

        for ns, index in self._attached:
            with inside(ns), contextlib.suppress(OSError):
                self.lib.bpf_xdp_detach(index, XDP_FLAGS_DRV_MODE, None)
        self._attached.clear()
        self.lib.bpf_object__close(self.obj)

    # -------------------------------------------------------------- counters

    def sunk(self) -> int:
        cpus = int(self.lib.libbpf_num_possible_cpus())
        values = (ctypes.c_uint64 * cpus)()
        key = ctypes.c_uint32(0)
        if self.lib.bpf_map_lookup_elem(
            self.map_fd("sunk"), ctypes.byref(key), ctypes.byref(values)
        ):
            raise OSError(ctypes.get_errno(), "sunk")
        return sum(values)

    def sinking(self, on: bool) -> None:
        key, value = ctypes.c_uint32(0), ctypes.c_uint32(int(on))
        fd = self.map_fd("sinking")
        if self.lib.bpf_map_update_elem(fd, ctypes.byref(key), ctypes.byref(value), 0):
            raise OSError(ctypes.get_errno(), "sinking")

    def state(self) -> tuple[int, int, int, int, int, int, int, int]:
        buf = ctypes.create_string_buffer(_STATE.size)
        key = ctypes.c_uint32(0)
        if self.lib.bpf_map_lookup_elem(self.map_fd("gen"), ctypes.byref(key), buf):
            raise OSError(ctypes.get_errno(), "gen")
        return _STATE.unpack(buf.raw)  # type: ignore[return-value]

    def sent(self) -> int:
        return self.state()[2]

    def configure(self, interval_ns: int, frames: Sequence[bytes]) -> None:
        """Send ``frames`` in turn (one per flow, all of one length), one
        every ``interval_ns`` (0: as fast as the device takes them)."""
        if (
            not frames
            or len({len(f) for f in frames}) != 1
            or len(frames[0]) > FRAME_MAX
        ):
            raise ValueError(f"frames of one length <= {FRAME_MAX} bytes")
        fd = self.map_fd("flows")
        for index, frame in enumerate(frames):
            key = ctypes.c_uint32(index)
            value = ctypes.create_string_buffer(
                frame.ljust(FRAME_MAX, b"\0"), FRAME_MAX
            )
            if self.lib.bpf_map_update_elem(fd, ctypes.byref(key), value, 0):
                raise OSError(ctypes.get_errno(), "flows")
        sent = self.state()[2]
        value = ctypes.create_string_buffer(
            _STATE.pack(interval_ns, 0, sent, 0, len(frames), 0, len(frames[0]), 0),
            _STATE.size,
        )
        key = ctypes.c_uint32(0)
        if self.lib.bpf_map_update_elem(
            self.map_fd("gen"), ctypes.byref(key), value, 0
        ):
            raise OSError(ctypes.get_errno(), "gen")


@dataclass(eq=False)
class Generator:
    """Runs ``load_gen`` over a template in a thread until :meth:`stop`."""

    loader: Loader
    ns: str
    device: str
    cpu: int
    template: bytes
    _thread: threading.Thread | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(10)
        if self.error:
            raise self.error

    def _run(self) -> None:
        from tests.transport.netns_support import inside

        try:
            os.sched_setaffinity(0, {self.cpu})
            index = ifindex_of(self.ns, self.device)
            data = ctypes.create_string_buffer(self.template, len(self.template))
            # struct xdp_md: data, data_end, data_meta, ingress_ifindex, rx_queue_index
            ctx = (ctypes.c_uint32 * 6)(0, len(self.template), 0, index, 0, 0)
            opts = _TestRunOpts(
                sz=ctypes.sizeof(_TestRunOpts),
                data_in=ctypes.cast(data, ctypes.c_void_p),
                data_size_in=len(self.template),
                ctx_in=ctypes.cast(ctx, ctypes.c_void_p),
                ctx_size_in=ctypes.sizeof(ctx),
                repeat=ITERATIONS,
                flags=BPF_F_TEST_XDP_LIVE_FRAMES,
                batch_size=BATCH,
            )
            fd = self.loader.prog_fd("load_gen")
            with inside(self.ns):
                while not self._stop.is_set():
                    rc = self.loader.lib.bpf_prog_test_run_opts(fd, ctypes.byref(opts))
                    if rc == -errno.EINTR:
                        continue  # a signal (a child's SIGCHLD): run on
                    if rc:
                        raise OSError(-rc, "BPF_PROG_TEST_RUN (live frames)")
        except BaseException as exc:  # reported by stop()
            self.error = exc


#: SCHED_FIFO priority of a sink's NAPI thread: at normal priority it would
#: wait for its time slice behind the busy generator on the same CPU, and a
#: veth ring holds only 256 frames. (A server's NAPI thread stays at normal
#: priority: under overload it then shares the core with the relay process
#: as ksoftirqd would, instead of starving it.)
SINK_PRIORITY = 50


@contextlib.contextmanager
def napi_thread(
    ns: str, device: str, cpu: int, fifo_priority: int | None = None
) -> Iterator[int]:
    """Give ``device`` (which must have NAPI: an XDP program attached) a
    threaded NAPI poll pinned to ``cpu`` (at ``fifo_priority`` in
    SCHED_FIFO, else at normal priority); yields the thread's pid."""
    before = napi_threads()
    path = f"/sys/class/net/{device}/threaded"
    subprocess.run(
        ["ip", "netns", "exec", ns, "sh", "-c", f"echo 1 > {path}"], check=True
    )
    try:
        deadline = time.monotonic() + 2
        new: list[int] = []
        while not new and time.monotonic() < deadline:
            new = [pid for pid, name in napi_threads().items() if pid not in before]
            time.sleep(0.01)
        if len(new) != 1:
            raise RuntimeError(f"expected one NAPI thread for {ns}/{device}, got {new}")
        os.sched_setaffinity(new[0], {cpu})
        if fifo_priority is not None:
            os.sched_setscheduler(new[0], os.SCHED_FIFO, os.sched_param(fifo_priority))
        yield new[0]
    finally:
        subprocess.run(
            ["ip", "netns", "exec", ns, "sh", "-c", f"echo 0 > {path}"], check=False
        )
