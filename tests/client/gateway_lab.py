"""A home gateway with real miniupnpd, in network namespaces the test creates.

Topology (names unique per test run, all prefixed ``xs-``)::

    lan ns  10.77.0.2 --- lan0 10.77.0.1 [gw ns: nftables masquerade + miniupnpd] wan0 203.0.113.1 --- 203.0.113.2/.3 wan ns

miniupnpd refuses to map when its external address is private or reserved (the
documentation range 203.0.113.0/24 is reserved) unless a STUN check shows a
1:1 full-cone path; so the wan namespace runs coturn as an RFC 5780 STUN server
on two addresses (``ext_perform_stun``), and miniupnpd then enables forwarding.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

_CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)

NFT_RULES = """
table inet filter {
  chain forward {
    type filter hook forward priority 0; policy accept;
    jump miniupnpd
  }
  chain miniupnpd {
  }
  chain prerouting {
    type nat hook prerouting priority -100; policy accept;
    jump prerouting_miniupnpd
  }
  chain postrouting {
    type nat hook postrouting priority 100; policy accept;
    jump postrouting_miniupnpd
    oifname "wan0" masquerade
  }
  chain prerouting_miniupnpd {
  }
  chain postrouting_miniupnpd {
  }
}
"""

LAN_IP = "10.77.0.2"
GW_LAN_IP = "10.77.0.1"
GW_WAN_IP = "203.0.113.1"
WAN_IP = "203.0.113.2"
WAN_IP2 = "203.0.113.3"


def run(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, timeout=20)


@contextlib.contextmanager
def inside(name: str) -> Iterator[None]:
    """Switch this thread into namespace ``name`` for the body (socket creation)."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if _libc.setns(target, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "setns")
        try:
            yield
        finally:
            _libc.setns(own, _CLONE_NEWNET)
    finally:
        os.close(target)
        os.close(own)


def available() -> str | None:
    """Why the lab cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root"
    for tool in ("ip", "nft", "miniupnpd", "turnserver"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    return None


class GatewayLab:
    def __init__(self) -> None:
        tag = secrets.token_hex(2)
        self.lan = f"xs-sdk{tag}-lan"
        self.gw = f"xs-sdk{tag}-gw"
        self.wan = f"xs-sdk{tag}-wan"
        self.tag = tag
        self.dir = Path(tempfile.mkdtemp(prefix="xs-sdk-"))
        self.processes: list[subprocess.Popen[bytes]] = []

    def up(self, miniupnpd: bool = True) -> None:
        t = self.tag
        for ns in (self.lan, self.gw, self.wan):
            run("ip", "netns", "add", ns)
        run("ip", "link", "add", f"xs{t}l0", "type", "veth", "peer", "name", f"xs{t}l1")
        run("ip", "link", "add", f"xs{t}w0", "type", "veth", "peer", "name", f"xs{t}w1")
        run("ip", "link", "set", f"xs{t}l0", "netns", self.lan)
        run("ip", "link", "set", f"xs{t}l1", "netns", self.gw)
        run("ip", "link", "set", f"xs{t}w0", "netns", self.gw)
        run("ip", "link", "set", f"xs{t}w1", "netns", self.wan)
        run("ip", "-n", self.lan, "link", "set", f"xs{t}l0", "name", "eth0")
        run("ip", "-n", self.gw, "link", "set", f"xs{t}l1", "name", "lan0")
        run("ip", "-n", self.gw, "link", "set", f"xs{t}w0", "name", "wan0")
        run("ip", "-n", self.wan, "link", "set", f"xs{t}w1", "name", "eth0")
        for ns, dev, addrs in (
            (self.lan, "eth0", [f"{LAN_IP}/24"]),
            (self.gw, "lan0", [f"{GW_LAN_IP}/24"]),
            (self.gw, "wan0", [f"{GW_WAN_IP}/24"]),
            (self.wan, "eth0", [f"{WAN_IP}/24", f"{WAN_IP2}/24"]),
        ):
            for addr in addrs:
                run("ip", "-n", ns, "addr", "add", addr, "dev", dev)
            run("ip", "-n", ns, "link", "set", dev, "up")
        for ns in (self.lan, self.gw, self.wan):
            run("ip", "-n", ns, "link", "set", "lo", "up")
        run("ip", "-n", self.lan, "route", "add", "default", "via", GW_LAN_IP)
        run("ip", "-n", self.wan, "route", "add", "default", "via", GW_WAN_IP)
        run("ip", "netns", "exec", self.gw, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        rules = self.dir / "rules.nft"
        rules.write_text(NFT_RULES)
        run("ip", "netns", "exec", self.gw, "nft", "-f", str(rules))
        if miniupnpd:
            self._start_stun()
            self._start_miniupnpd()

    def spawn(self, ns: str, *args: str, log: str) -> subprocess.Popen[bytes]:
        out = open(self.dir / log, "wb")  # noqa: SIM115 - closed with the process
        process = subprocess.Popen(
            ["ip", "netns", "exec", ns, *args], stdout=out, stderr=subprocess.STDOUT
        )
        self.processes.append(process)
        return process

    def _start_stun(self) -> None:
        self.spawn(
            self.wan,
            "turnserver",
            "-n",
            f"--listening-ip={WAN_IP}",
            f"--listening-ip={WAN_IP2}",
            "--listening-port=3478",
            "--alt-listening-port=3479",
            "--stun-only",
            "--no-cli",
            f"--pidfile={self.dir / 'turn.pid'}",
            "--log-file=stdout",
            log="turnserver.log",
        )
        self.wait_udp(self.wan, WAN_IP, 3478)

    def _start_miniupnpd(self) -> None:
        conf = self.dir / "miniupnpd.conf"
        conf.write_text(
            "\n".join(
                [
                    "ext_ifname=wan0",
                    "listening_ip=lan0",
                    "port=0",
                    "enable_natpmp=yes",
                    "enable_upnp=yes",
                    "secure_mode=yes",
                    "system_uptime=yes",
                    f"uuid=7e5c680d-09c6-44f6-b53b-3b23b6e1{self.tag}",
                    "ext_perform_stun=yes",
                    f"ext_stun_host={WAN_IP}",
                    "ext_stun_port=3478",
                    f"lease_file={self.dir / 'leases'}",
                    "allow 1024-65535 10.77.0.0/24 1024-65535",
                    "deny 0-65535 0.0.0.0/0 0-65535",
                    "",
                ]
            )
        )
        self.spawn(
            self.gw,
            "miniupnpd",
            "-f",
            str(conf),
            "-d",
            "-P",
            str(self.dir / "mini.pid"),
            log="miniupnpd.log",
        )
        log = self.dir / "miniupnpd.log"
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            text = log.read_text(errors="replace") if log.exists() else ""
            if "Listening for NAT-PMP/PCP traffic" in text:
                if "Port forwarding is now enabled" not in text:
                    raise RuntimeError(
                        "miniupnpd did not enable forwarding:\n" + text[-2000:]
                    )
                return
            time.sleep(0.1)
        raise RuntimeError("miniupnpd did not start")

    def wait_udp(self, ns: str, host: str, port: int) -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            out = subprocess.run(
                ["ip", "netns", "exec", ns, "ss", "-uln"],
                capture_output=True,
                text=True,
            ).stdout
            if f"{host}:{port}" in out:
                return
            time.sleep(0.1)
        raise RuntimeError(f"nothing listens on udp {host}:{port} in {ns}")

    def redirects(self) -> str:
        return subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                self.gw,
                "nft",
                "list",
                "chain",
                "inet",
                "filter",
                "prerouting_miniupnpd",
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout

    def socket(self, ns: str, host: str) -> socket.socket:
        with inside(ns):
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind((host, 0))
        sock.setblocking(False)
        return sock

    def down(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
        for process in self.processes:
            try:
                process.wait(5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for ns in (self.lan, self.gw, self.wan):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        shutil.rmtree(self.dir, ignore_errors=True)

    def log(self, name: str) -> str:
        path = self.dir / name
        return path.read_text(errors="replace") if path.exists() else ""
