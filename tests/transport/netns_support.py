"""Network namespaces joined by veth, entered per call by this thread (setns).

A socket keeps the namespace it was made in, so one test process can hold
sockets in several namespaces and load an eBPF program into one of them.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import subprocess
from collections.abc import Iterator

CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), "setns")


@contextlib.contextmanager
def inside(ns: str) -> Iterator[None]:
    """Run the body in namespace ``ns`` (this thread only)."""
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(f"/var/run/netns/{ns}", os.O_RDONLY)
    try:
        _setns(target)
        try:
            yield
        finally:
            _setns(home)
    finally:
        os.close(target)
        os.close(home)


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def can_netns() -> bool:
    return os.geteuid() == 0 and os.path.isdir("/sys/fs/bpf") or os.geteuid() == 0


@contextlib.contextmanager
def relay_lab(prefix: str) -> Iterator[dict[str, str]]:
    """client (192.0.2.2) -- server (192.0.2.1 | 198.51.100.1) -- peer (198.51.100.2),
    and in IPv6 client (2001:db8:2::2) -- (2001:db8:2::1 | 2001:db8:3::1) --
    peer (2001:db8:3::2).

    Yields the namespace names: ``client``, ``server``, ``peer``; the server's
    devices are ``toc`` (client side) and ``top`` (peer side)."""
    names = {
        role: f"{prefix}{role[0]}{os.getpid() % 10000}"
        for role in ("client", "server", "peer")
    }
    c, s, p = names["client"], names["server"], names["peer"]
    try:
        for ns in names.values():
            ip("netns", "add", ns)
            ip("-n", ns, "link", "set", "lo", "up")
        ip(
            "-n",
            s,
            "link",
            "add",
            "toc",
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            c,
        )
        ip(
            "-n",
            s,
            "link",
            "add",
            "top",
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            p,
        )
        for ns, dev, addr in (
            (c, "eth0", "192.0.2.2/24"),
            (s, "toc", "192.0.2.1/24"),
            (s, "top", "198.51.100.1/24"),
            (p, "eth0", "198.51.100.2/24"),
        ):
            ip("-n", ns, "addr", "add", addr, "dev", dev)
            ip("-n", ns, "link", "set", dev, "up")
        for ns, dev, addr in (
            (c, "eth0", "2001:db8:2::2/64"),
            (s, "toc", "2001:db8:2::1/64"),
            (s, "top", "2001:db8:3::1/64"),
            (p, "eth0", "2001:db8:3::2/64"),
        ):
            ip("-n", ns, "addr", "add", addr, "dev", dev, "nodad")
        yield names
    finally:
        for ns in names.values():
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)


#: SIOCETHTOOL and ETHTOOL_STXCSUM (include/uapi/linux/sockios.h, ethtool.h).
_SIOCETHTOOL = 0x8946
_ETHTOOL_STXCSUM = 0x17


def tx_checksum(ns: str, device: str, on: bool) -> None:
    """Turn a device's transmit checksum offload on or off (``ethtool -K
    DEV tx on|off``, through the ioctl): off, its local senders' datagrams
    leave with full checksums, as from a wire, instead of CHECKSUM_PARTIAL."""
    import array
    import fcntl
    import socket
    import struct

    value = array.array("I", [_ETHTOOL_STXCSUM, int(on)])
    address, _ = value.buffer_info()
    request = struct.pack("16sP", device.encode(), address) + bytes(16)
    with inside(ns), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        fcntl.ioctl(sock.fileno(), _SIOCETHTOOL, request)


def device_attribute(ns: str, device: str, name: str) -> str:
    """``/sys/class/net/DEVICE/NAME`` as namespace ``ns`` sees it."""
    return subprocess.run(
        ["ip", "netns", "exec", ns, "cat", f"/sys/class/net/{device}/{name}"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()


def mac_of(ns: str, device: str) -> bytes:
    """``device``'s link-layer address in namespace ``ns``."""
    return bytes.fromhex(device_attribute(ns, device, "address").replace(":", ""))


def ifindex_of(ns: str, device: str) -> int:
    """``device``'s index in namespace ``ns``."""
    return int(device_attribute(ns, device, "ifindex"))


def internet_checksum(data: bytes) -> int:
    """RFC 1071's checksum of ``data``: the one's complement of its 16-bit
    one's complement sum."""
    if len(data) % 2:
        data += b"\0"
    total = sum(int.from_bytes(data[i : i + 2], "big") for i in range(0, len(data), 2))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def ipv4_udp_frame(
    src_mac: bytes,
    dst_mac: bytes,
    source: tuple[str, int],
    dest: tuple[str, int],
    payload: bytes,
    *,
    udp_checksum: bool = True,
) -> bytes:
    """An Ethernet + IPv4 + UDP frame as a NIC delivers it: both checksums
    finished (``udp_checksum=False``: the UDP one 0, "none", RFC 768)."""
    import socket
    import struct

    saddr, daddr = socket.inet_aton(source[0]), socket.inet_aton(dest[0])
    length = 8 + len(payload)
    udp = struct.pack("!HHHH", source[1], dest[1], length, 0) + payload
    if udp_checksum:
        pseudo = saddr + daddr + struct.pack("!BBH", 0, socket.IPPROTO_UDP, length)
        check = (
            internet_checksum(pseudo + udp) or 0xFFFF
        )  # a sum of 0 is sent as all ones
        udp = udp[:6] + struct.pack("!H", check) + udp[8:]
    ip = struct.pack(
        "!BBHHHBBH4s4s", 0x45, 0, 20 + length, 0, 0x4000, 64, socket.IPPROTO_UDP, 0,
        saddr, daddr,
    )  # fmt: skip
    ip = ip[:10] + struct.pack("!H", internet_checksum(ip)) + ip[12:]
    return dst_mac + src_mac + b"\x08\x00" + ip + udp
