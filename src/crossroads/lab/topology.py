"""The lab: an "internet", a server with two public addresses, and one site per NAT
kind and letter (``full-cone-a``, ``full-cone-b``, ...), each a host behind its own
router (two routers for ``cgnat``), all in network namespaces.

Theory of operation::

    {p}-inet   bridge br0, 198.51.100.1/24 + 203.0.113.1/24: routes between the two,
               and between sites (each has a /32 and this router as its only neighbour)
      |-- {p}-srv         203.0.113.10 + 203.0.113.20: crossroads serve, coturn STUN
      |-- {p}-open-a      198.51.100.10 (a host with a public address, no router)
      |-- {p}-KIND-a-r    198.51.100.N  router: nftables NAT of KIND (+ miniupnpd)
      |     `-- {p}-KIND-a       192.168.M.2 host behind it
      `-- {p}-cgnat-a-c   198.51.100.N  carrier-grade NAT
            `-- {p}-cgnat-a-r   100.64.M.2  home router
                  `-- {p}-cgnat-a   192.168.M.2

Namespace names carry the lab prefix (``xr`` by default) so several labs can live
on one machine; interface names (``wan``, ``lan``, ``vN``, ``br0``) exist only inside
their namespaces. Every address is a documentation (RFC 5737), private (RFC 1918)
or shared (RFC 6598) address that exists only in these namespaces; the lab has no
link to the machine's own network, so nothing it sends can leave the machine.

``up`` is idempotent (a complete, healthy lab is left alone; a partial one is torn
down and rebuilt) and tears everything down again if any step fails. ``down``
stops every process the lab started and deletes every namespace with its prefix
(which deletes their links too).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shutil
import socket
import struct
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from crossroads.lab import natpmp, netns
from crossroads.lab.delay import DEFAULT_TABLE, DelayLine
from crossroads.lab.kinds import (
    KINDS,
    KINDS_BY_NAME,
    MINIUPNPD_TABLE,
    VARIANT_KINDS,
    NatKind,
    cgn_ruleset,
    router_firewall6,
    router_ruleset,
)
from crossroads.lab.udp import recv, send
from crossroads.types import frozen

log = logging.getLogger("crossroads.lab")

#: The server's two public addresses (RFC 5780 needs two IPs; natneg uses the
#: second as its secondary address).
SERVER_IPS = ("203.0.113.10", "203.0.113.20")
#: The public network the server's addresses are in.
SERVER_NET = "203.0.113.0/24"
#: The internet router's address in each public range.
INET_GATEWAYS = ("198.51.100.1", "203.0.113.1")
#: Sites that also have IPv6 (RFC 3849 documentation prefix): a routed /64 per
#: LAN behind a stateful firewall (no NAT), as home routers do it (RFC 6092).
#: Only the pair that IPv4 can join by relay alone: IPv6 must join it directly.
IPV6_KINDS = ("symmetric-random",)
INET_GATEWAY6 = "2001:db8:ffff::1"
#: Sites' public addresses start here in 198.51.100.0/24.
FIRST_SITE_HOST = 10
#: Reference STUN server (coturn, RFC 5780 with both server IPs) port; the
#: alternate port is this + 1. miniupnpd uses it to learn its external address.
COTURN_STUN_PORT = 3480
#: HTTP port of ``crossroads serve`` in the lab (inside the server namespace).
SERVER_HTTP_PORT = 8080

#: Settings of the lab's ``crossroads serve`` that exist only once their service
#: has landed; each is passed when the running code has it.
#: ``name:password`` of the lab TURN server's user (lab/methods/turn_udp.py).
LAB_TURN_USER = "lab:crossroads-lab-turn"
#: The password the ``raknet`` method's second UDPProxyServer logs in with
#: (lab/methods/raknet.py), so the coordinator has two forwarders to choose
#: from by the clients' pings: that one and its own (a relay node).
LAB_RAKNET_PROXY_PASSWORD = "crossroads-lab-raknet"

SERVER_SETTINGS: dict[str, str] = {
    "stun.alt_host": SERVER_IPS[1],
    # natneg: natneg1/natneg2 on the first address, natneg3 on the second (the
    # two-IP layout); lab sites have documentation addresses, which the relay
    # refuses unless allowed.
    "natneg.natneg3_host": SERVER_IPS[1],
    "natneg.relay_allow": "198.51.100.0/24",
    # The key the ``unity-relay`` method uses (lab/methods/relay.py LAB_API_KEY).
    "relay.api_keys": "crossroads-lab-relay-key",
    # The static user the ``turn-udp`` / ``turn-tcp`` methods allocate with.
    # Peers are the server's own relayed addresses (203.0.113.0/24): the TURN
    # peer policy allows documentation ranges by default, nothing to widen.
    "turn.user": LAB_TURN_USER,
    # Invite codes survive a coordinator restart (lab/methods/openttd.py).
    "openttd.secret": "crossroads-lab-openttd",
    # raknet: external UDPProxyServers may log in, and the server's own
    # forwarder joins the ping round as a relay node (in-memory store: itself).
    "raknet.proxy_password": LAB_RAKNET_PROXY_PASSWORD,
    "raknet.proxy_relay_nodes": "true",
}

#: Conntrack entries a namespace may hold. The ceiling, nf_conntrack_max, is one
#: value for every namespace and writable only from the initial one; the kernel
#: sizes it from memory (262 144 here). One prediction spray opens up to 524 288
#: mappings on a random-port router (crossroads.proto.punch.ladder), so the lab
#: raises it; it never lowers it (other labs may be running).
CONNTRACK_MAX = 1 << 20
CONNTRACK_MAX_PATH = Path("/proc/sys/net/netfilter/nf_conntrack_max")

PREFIX_RE = re.compile(r"^[a-z][a-z0-9]{0,11}$")
DEFAULT_STATE_ROOT = Path("/run/crossroads-lab")
#: Bumped whenever the built network changes (2: IPv6 on the symmetric-random
#: sites; 3: the port-restricted-remap sites, sites routed to each other through
#: the internet router; 4: the server's raknet proxy takes a second forwarder),
#: so that ``up`` rebuilds a lab that older code left running.
TOPOLOGY_VERSION = 4


@frozen
class Site:
    """One host behind one router (or two, for cgnat), or a public host (open)."""

    kind: NatKind
    letter: str
    index: int

    @property
    def name(self) -> str:
        return f"{self.kind.name}-{self.letter}"

    def _lan(self, host: int) -> str:
        """Address ``host`` of the site's LAN, 192.168.<index + 1>.0/24."""
        return f"192.168.{self.index + 1}.{host}"

    def _lan6(self, host: str) -> str:
        """Address ``host`` of the site's IPv6 LAN, 2001:db8:<index + 1>::/64."""
        return f"2001:db8:{self.index + 1:x}::{host}"

    @property
    def public_ip(self) -> str:
        """The outermost public address: the host's own, or its (outer) router's."""
        return f"198.51.100.{FIRST_SITE_HOST + self.index}"

    @property
    def lan_net(self) -> str:
        return self._lan(0) + "/24"

    @property
    def host_ip(self) -> str:
        return self._lan(2) if self.kind.natted else self.public_ip

    @property
    def gateway(self) -> str:
        """The host's default gateway (its router's LAN address)."""
        return self._lan(1)

    @property
    def ipv6(self) -> bool:
        return self.kind.name in IPV6_KINDS and self.kind.natted

    @property
    def lan_net6(self) -> str:
        return self._lan6("") + "/64"

    @property
    def host_ip6(self) -> str:
        return self._lan6("2")

    @property
    def gateway6(self) -> str:
        return self._lan6("1")

    @property
    def router_wan_ip6(self) -> str:
        return f"2001:db8:ffff::{self.index + 0x11:x}"

    @property
    def router_wan_ip(self) -> str:
        if self.kind.double:
            return f"100.64.{self.index + 1}.2"
        return self.public_ip

    @property
    def cgn_inside_ip(self) -> str:
        return f"100.64.{self.index + 1}.1"


def make_sites() -> list[Site]:
    """Two sites (a and b) per kind, so a kind can be paired with itself. The
    variants come last, so the other sites keep their addresses."""
    sites: list[Site] = []
    for kind in (*KINDS, *VARIANT_KINDS):
        for letter in ("a", "b"):
            sites.append(Site(kind, letter, len(sites)))
    return sites


@dataclass
class State:
    """What ``up`` made, saved so another process (``down``, ``exec``) can use it."""

    prefix: str
    pids: dict[str, int] = field(default_factory=dict)
    created: float = 0.0
    #: The topology's version when built: a lab left up by older code is
    #: rebuilt rather than reused (see :data:`TOPOLOGY_VERSION`).
    version: int = 0

    def dump(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def load(cls, text: str) -> State:
        data = json.loads(text)
        return cls(
            prefix=str(data["prefix"]),
            pids={str(k): int(v) for k, v in data["pids"].items()},
            created=float(data.get("created", 0.0)),
            version=int(data.get("version", 0)),
        )


def _raise_conntrack_max() -> None:
    """Let a router hold a whole prediction spray (see CONNTRACK_MAX)."""
    try:
        current = int(CONNTRACK_MAX_PATH.read_text())
    except (OSError, ValueError):
        log.warning(
            "cannot read %s: conntrack table stays as it is", CONNTRACK_MAX_PATH
        )
        return
    if current < CONNTRACK_MAX:
        CONNTRACK_MAX_PATH.write_text(str(CONNTRACK_MAX))
        log.info("nf_conntrack_max raised from %d to %d", current, CONNTRACK_MAX)


class LabError(RuntimeError):
    """The lab cannot be built or used."""


class Lab:
    """A NAT lab with a name prefix; :meth:`up` builds it, :meth:`down` removes it."""

    def __init__(
        self,
        prefix: str = "xr",
        *,
        state_root: Path = DEFAULT_STATE_ROOT,
        server: bool = True,
    ) -> None:
        if not PREFIX_RE.match(prefix):
            raise LabError(
                f"bad lab prefix {prefix!r}: 1-12 lowercase letters/digits, "
                "starting with a letter"
            )
        self.prefix = prefix
        self.state_dir = state_root / prefix
        #: Start ``crossroads serve`` in the server namespace.
        self.server = server
        self.sites = make_sites()
        self.state = State(prefix)

    # -- names ---------------------------------------------------------------
    def ns(self, suffix: str) -> str:
        return f"{self.prefix}-{suffix}"

    @property
    def inet_ns(self) -> str:
        return self.ns("inet")

    @property
    def server_ns(self) -> str:
        return self.ns("srv")

    def host_ns(self, site: Site) -> str:
        return self.ns(site.name)

    def router_ns(self, site: Site) -> str:
        return self.ns(site.name + "-r")

    def cgn_ns(self, site: Site) -> str:
        return self.ns(site.name + "-c")

    def site(self, name: str) -> Site:
        """A site by name (``full-cone-b``) or kind (``full-cone``: its site a)."""
        if name in KINDS_BY_NAME:
            name += "-a"
        for site in self.sites:
            if site.name == name:
                return site
        raise LabError(
            f"no lab host {name!r}; kinds: {', '.join(KINDS_BY_NAME)} "
            "(append -a or -b for a site)"
        )

    def resolve(self, name: str) -> str:
        """A namespace for ``lab exec``: a kind, a site, ``server``, ``inet``,
        ``SITE-router`` or ``SITE-cgn``."""
        if name in ("server", "srv"):
            return self.server_ns
        if name == "inet":
            return self.inet_ns
        for suffix, attr in (("-router", "r"), ("-cgn", "c")):
            if name.endswith(suffix):
                site = self.site(name[: -len(suffix)])
                if not site.kind.natted or (attr == "c" and not site.kind.double):
                    raise LabError(f"{site.name} has no {suffix[1:]}")
                return self.ns(f"{site.name}-{attr}")
        return self.host_ns(self.site(name))

    def namespaces(self) -> list[str]:
        out = [self.inet_ns, self.server_ns]
        for site in self.sites:
            out += [self.host_ns(site), *self.routers(site)]
        return out

    def routers(self, site: Site) -> list[str]:
        """The namespaces that translate this site's traffic, inner first."""
        out = []
        if site.kind.natted:
            out.append(self.router_ns(site))
        if site.kind.double:
            out.append(self.cgn_ns(site))
        return out

    # -- sockets -------------------------------------------------------------
    def udp_socket(self, site: Site, port: int = 0) -> socket.socket:
        """A non-blocking UDP socket on the site's host, bound to its address."""
        return netns.socket_in(self.host_ns(site), bind=(site.host_ip, port))

    def udp_socket6(self, site: Site, port: int = 0) -> socket.socket:
        """A non-blocking IPv6 UDP socket on an IPv6 site's host."""
        if not site.ipv6:
            raise LabError(f"{site.name} has no IPv6 (only {', '.join(IPV6_KINDS)})")
        return netns.socket_in(
            self.host_ns(site), bind=(site.host_ip6, port), family=socket.AF_INET6
        )

    def server_udp_socket(self, ip: str, port: int = 0) -> socket.socket:
        return netns.socket_in(self.server_ns, bind=(ip, port))

    # -- state ---------------------------------------------------------------
    @property
    def _state_file(self) -> Path:
        return self.state_dir / "state.json"

    def load_state(self) -> bool:
        try:
            self.state = State.load(self._state_file.read_text())
        except (OSError, ValueError, KeyError):
            return False
        return True

    def _save_state(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._state_file.write_text(self.state.dump())

    def is_up(self) -> bool:
        """A complete lab: saved state, every namespace, every process alive."""
        if not self.load_state() or self.state.version != TOPOLOGY_VERSION:
            return False
        if not all(netns.exists(name) for name in self.namespaces()):
            return False
        return all(netns.alive(pid) for pid in self.state.pids.values())

    # -- up / down -----------------------------------------------------------
    async def up(self) -> bool:
        """Build the lab; return False if it was already up (nothing done)."""
        if os.geteuid() != 0:
            raise LabError("the NAT lab needs root (network namespaces, nftables)")
        for tool in ("ip", "nft", "conntrack"):
            if shutil.which(tool) is None:
                raise LabError(f"{tool} is not installed; run `make install`")
        if self.is_up():
            return False
        await self.down()
        try:
            self.state = State(
                self.prefix, created=time.time(), version=TOPOLOGY_VERSION
            )
            self.state_dir.mkdir(parents=True, exist_ok=True)
            self._save_state()
            await self._build_network()
            await self._start_processes()
            self._save_state()
        except BaseException:
            await self.down()
            raise
        return True

    async def down(self) -> None:
        """Stop every process and delete every namespace of this lab. Idempotent."""
        self.load_state()
        await asyncio.gather(
            *(netns.kill_group(pid) for pid in self.state.pids.values()),
            return_exceptions=True,
        )
        self.state.pids.clear()
        leftovers = netns.names(self.prefix)
        if leftovers:
            await netns.ip_batch([f"netns delete {name}" for name in leftovers])
        if self.state_dir.exists():
            shutil.rmtree(self.state_dir, ignore_errors=True)

    async def _build_network(self) -> None:
        names = self.namespaces()
        await netns.ip_batch([f"netns add {name}" for name in names])
        ipv6_names = {self.inet_ns}
        ipv6_routers = {self.inet_ns}
        for site in self.sites:
            if site.ipv6:
                ipv6_names |= {self.router_ns(site), self.host_ns(site)}
                ipv6_routers.add(self.router_ns(site))
        for name in names:
            # IPv6 is off in the lab but for the IPv6 sites and the internet
            # router, and there static: no autoconfiguration, no DAD delay.
            on = name in ipv6_names
            netns.write_sysctl(
                name,
                {
                    "net.ipv6.conf.all.disable_ipv6": "0" if on else "1",
                    "net.ipv6.conf.default.disable_ipv6": "0" if on else "1",
                    "net.ipv6.conf.all.accept_ra": "0",
                    "net.ipv6.conf.default.accept_ra": "0",
                    "net.ipv6.conf.default.accept_dad": "0",
                    "net.ipv6.conf.all.forwarding": (
                        "1" if name in ipv6_routers else "0"
                    ),
                },
            )
        links: list[str] = []
        per_ns: dict[str, list[str]] = {name: ["link set lo up"] for name in names}
        inet = per_ns[self.inet_ns]
        inet += ["link add br0 type bridge", "link set br0 up"]
        inet += [f"addr add {gw}/24 dev br0" for gw in INET_GATEWAYS]
        inet.append(f"addr add {INET_GATEWAY6}/64 dev br0 nodad")
        port = 0

        def attach(
            node: str, addrs: Sequence[str], gateway: str, prefix: int = 32
        ) -> None:
            # Sites get a /32 and an on-link route to the internet router only:
            # site-to-site traffic is *routed* by it (one hop, TTL decremented,
            # delay lines apply), as between two homes, not bridged as on a LAN.
            nonlocal port
            port += 1
            links.append(
                f"link add wan netns {node} type veth peer name v{port} "
                f"netns {self.inet_ns}"
            )
            inet.extend([f"link set v{port} master br0", f"link set v{port} up"])
            per_ns[node] += [f"addr add {a}/{prefix} dev wan" for a in addrs]
            per_ns[node] += ["link set wan up"]
            if prefix == 32:
                per_ns[node].append(f"route add {gateway} dev wan scope link")
            per_ns[node].append(f"route add default via {gateway} dev wan")

        def lan(outer: str, inner: str, outer_ip: str, inner_ip: str) -> None:
            inner_dev = "wan" if inner.endswith("-r") else "lan"
            links.append(
                f"link add lan netns {outer} type veth peer name {inner_dev} "
                f"netns {inner}"
            )
            per_ns[outer] += [f"addr add {outer_ip}/24 dev lan", "link set lan up"]
            per_ns[inner] += [
                f"addr add {inner_ip}/24 dev {inner_dev}",
                f"link set {inner_dev} up",
                f"route add default via {outer_ip}",
            ]

        attach(self.server_ns, SERVER_IPS, INET_GATEWAYS[1], prefix=24)
        for site in self.sites:
            host = self.host_ns(site)
            if not site.kind.natted:
                attach(host, [site.public_ip], INET_GATEWAYS[0])
                continue
            router = self.router_ns(site)
            if site.kind.double:
                cgn = self.cgn_ns(site)
                attach(cgn, [site.public_ip], INET_GATEWAYS[0])
                lan(cgn, router, site.cgn_inside_ip, site.router_wan_ip)
            else:
                attach(router, [site.public_ip], INET_GATEWAYS[0])
            lan(router, host, site.gateway, site.host_ip)
            if site.ipv6:
                inet.append(f"route add {site.lan_net6} via {site.router_wan_ip6}")
                per_ns[router] += [
                    f"addr add {site.router_wan_ip6}/64 dev wan nodad",
                    f"addr add {site.gateway6}/64 dev lan nodad",
                    f"route add default via {INET_GATEWAY6}",
                ]
                per_ns[host] += [
                    f"addr add {site.host_ip6}/64 dev lan nodad",
                    f"route add default via {site.gateway6}",
                ]
        await netns.ip_batch(links)
        await asyncio.gather(
            *(netns.ip_batch(lines, name) for name, lines in per_ns.items())
        )

        # Routers forward; the internet router must not send ICMP redirects
        # (routers and the server sit on one bridge in two subnets).
        netns.write_sysctl(
            self.inet_ns,
            {
                "net.ipv4.ip_forward": "1",
                "net.ipv4.conf.all.send_redirects": "0",
                "net.ipv4.conf.br0.send_redirects": "0",
            },
        )
        rulesets: list[tuple[str, str]] = []
        for site in self.sites:
            if not site.kind.natted:
                continue
            rules = router_ruleset(
                site.kind,
                lan_net=site.lan_net,
                wan_ip=site.router_wan_ip,
                hairpin=site.kind.hairpin,
                stun_check=self._stun_check(site),
            )
            if site.kind.upnp:
                rules += MINIUPNPD_TABLE
            if site.ipv6:
                rules += router_firewall6(site.kind)
            rulesets.append((self.router_ns(site), rules))
            if site.kind.double:
                inside = f"100.64.{site.index + 1}.0/24"
                rulesets.append((self.cgn_ns(site), cgn_ruleset(inside_net=inside)))
        await asyncio.gather(
            *(
                netns.run_in(ns, ["nft", "-f", "-"], input=rules.encode())
                for ns, rules in rulesets
            )
        )
        for ns, _ in rulesets:
            netns.write_sysctl(
                ns,
                {
                    "net.ipv4.ip_forward": "1",
                    "net.ipv4.conf.all.accept_redirects": "0",
                    # RFC 4787 REQ-5: UDP mappings live at least two minutes,
                    # also before the first reply (conntrack's default is 30 s).
                    "net.netfilter.nf_conntrack_udp_timeout": "120",
                },
            )
        _raise_conntrack_max()

    def _stun_check(self, site: Site) -> tuple[tuple[str, ...], tuple[int, ...]] | None:
        if not site.kind.upnp:
            return None
        return SERVER_IPS, (COTURN_STUN_PORT, COTURN_STUN_PORT + 1)

    async def _start_processes(self) -> None:
        logs = self.state_dir
        # coturn as a reference RFC 5780 STUN server on both server addresses.
        turnserver = shutil.which("turnserver")
        if turnserver is None:
            raise LabError("turnserver (coturn) is not installed; run `make install`")
        argv = [turnserver, "-n", "--stun-only", "--no-tls", "--no-dtls", "--no-cli"]
        argv += ["--log-file=stdout", "--simple-log", "-p", str(COTURN_STUN_PORT)]
        argv += [
            "--pidfile",
            str(logs / "turnserver.pid"),
            "--db",
            str(logs / "turndb"),
        ]
        for ip in SERVER_IPS:
            argv += ["-L", ip]
        self._spawn("coturn", self.server_ns, argv)
        if self.server:
            self._spawn(
                "crossroads",
                self.server_ns,
                [sys.executable, "-m", "crossroads", *self.server_args()],
            )
        await self._wait_stun(SERVER_IPS[0], COTURN_STUN_PORT, "coturn")
        for site in self.sites:
            if site.kind.upnp:
                self._start_miniupnpd(site)
        self._save_state()
        waits = [self._wait_natpmp(site) for site in self.sites if site.kind.upnp]
        if self.server:
            waits.append(self._wait_http())
        await asyncio.gather(*waits)

    def server_args(self) -> list[str]:
        """The ``crossroads`` command line of the lab server: every service on the
        first server address, the second one where a service takes it (RFC 5780
        alternate address, natneg secondary address), lab-wide overrides."""
        from crossroads.config import flag_name, iter_settings
        from crossroads.services import load_service_modules

        load_service_modules()
        args = ["serve", "--host", SERVER_IPS[0]]
        args += ["--http-port", str(SERVER_HTTP_PORT), "--log-level", "info"]
        # Its admin token stays with the lab, not in root's home directory.
        args += ["--state-dir", str(self.state_dir / "server-state")]
        for section, f, info in iter_settings():
            value = SERVER_SETTINGS.get(f"{section}.{f.name}")
            if value is None:
                continue
            if info.kind == "bool":  # a switch: --flag / --no-flag, no value
                flag = flag_name(section, f)
                args.append(flag if value == "true" else f"--no-{flag[2:]}")
            else:
                args += [flag_name(section, f), value]
        return args

    async def start_extra_server(
        self, name: str, args: Sequence[str], http_port: int
    ) -> None:
        """Another ``crossroads serve ARGS`` in the server namespace (on the first
        server address, HTTP on ``http_port``), for a test or benchmark that needs
        a second server beside the lab's own; waits until it listens. Stopped by
        :meth:`stop_extra_server`, or by :meth:`down` with everything else."""
        argv = [sys.executable, "-m", "crossroads", "serve", "--host", SERVER_IPS[0]]
        argv += ["--http-port", str(http_port), *args]
        self._spawn(name, self.server_ns, argv)
        await self.wait_listening(SERVER_IPS[0], http_port, name)

    async def stop_extra_server(self, name: str) -> None:
        pid = self.state.pids.pop(name, None)
        if pid is not None:
            await netns.kill_group(pid)
            self._save_state()

    def _spawn(self, name: str, ns: str, argv: Sequence[str]) -> None:
        env = dict(os.environ)
        env.pop("CROSSROADS_CONFIG", None)
        pid = netns.spawn(ns, argv, log=self.state_dir / f"{name}.log", env=env)
        self.state.pids[name] = pid
        self._save_state()

    def _start_miniupnpd(self, site: Site) -> None:
        conf = self.state_dir / f"miniupnpd-{site.name}.conf"
        # The external address is learnt by STUN against the lab's RFC 5780
        # server: miniupnpd refuses documentation addresses as "reserved"
        # unless a STUN check shows them reachable (unrestricted 1:1).
        conf.write_text(
            "\n".join(
                [
                    "ext_ifname=wan",
                    "listening_ip=lan",
                    "port=0",
                    "enable_natpmp=yes",
                    "enable_upnp=yes",
                    "secure_mode=yes",
                    "system_uptime=yes",
                    "ext_perform_stun=yes",
                    f"ext_stun_host={SERVER_IPS[0]}",
                    f"ext_stun_port={COTURN_STUN_PORT}",
                    f"lease_file={self.state_dir}/miniupnpd-{site.name}.leases",
                    f"uuid=3a1d6c2e-7e0b-4c3f-9d2a-{site.index:012d}",
                    f"allow 1024-65535 {site.lan_net} 1024-65535",
                    "deny 0-65535 0.0.0.0/0 0-65535",
                    "",
                ]
            )
        )
        pidfile = self.state_dir / f"miniupnpd-{site.name}.pid"
        self._spawn(
            f"miniupnpd-{site.name}",
            self.router_ns(site),
            ["miniupnpd", "-d", "-f", str(conf), "-P", str(pidfile)],
        )

    async def _wait_stun(self, ip: str, port: int, what: str) -> None:
        sock = netns.socket_in(self.server_ns, bind=(SERVER_IPS[1], 0))
        request = struct.pack("!HHI12s", 0x0001, 0, 0x2112A442, os.urandom(12))
        try:
            for _ in range(100):
                send(sock, request, (ip, port))
                if await recv(sock, 0.1) is not None:
                    return
        finally:
            sock.close()
        raise LabError(f"{what} STUN server did not answer on {ip}:{port}")

    async def _wait_natpmp(self, site: Site) -> None:
        """Wait until miniupnpd answers NAT-PMP on the LAN (it first runs its STUN
        check, a few seconds)."""
        for _ in range(150):
            sock = self.udp_socket(site)
            try:
                answer = await natpmp.public_address(sock, site.gateway, 0.1)
            finally:
                sock.close()
            if answer is not None:
                return
            await asyncio.sleep(0.1)
        raise LabError(f"miniupnpd on {site.name} does not answer NAT-PMP")

    async def _wait_http(self) -> None:
        await self.wait_listening(SERVER_IPS[0], SERVER_HTTP_PORT, "crossroads")

    async def wait_listening(self, ip: str, port: int, process: str) -> None:
        """Wait until the server namespace accepts TCP on ``ip:port``, served by
        the lab process ``process``; LabError with its log's tail if it dies or
        takes more than 20 s."""
        loop = asyncio.get_running_loop()
        for _ in range(200):
            if not netns.alive(self.state.pids[process]):
                break
            sock = netns.socket_in(self.server_ns, socket.SOCK_STREAM)
            try:
                await asyncio.wait_for(loop.sock_connect(sock, (ip, port)), 1)
                return
            except (OSError, TimeoutError):
                await asyncio.sleep(0.1)
            finally:
                sock.close()
        log_file = self.state_dir / f"{process}.log"
        tail = log_file.read_text(errors="replace")[-2000:]
        raise LabError(f"{process} did not start in the lab ({ip}:{port}):\n{tail}")

    # -- per-attempt hygiene ---------------------------------------------------
    async def reset_nat(self, site: Site) -> None:
        """Forget every mapping of the site's routers (conntrack + nft sets), so
        one attempt cannot ride on the state of an earlier one."""
        script = (
            "conntrack -F >/dev/null 2>&1; conntrack -F -f ipv6 >/dev/null 2>&1; "
            "nft flush set ip xr emap; nft flush set ip xr adf"
        )
        await asyncio.gather(
            *(netns.run_in(ns, ["sh", "-c", script]) for ns in self.routers(site))
        )

    def path_delay(
        self,
        a: Site | str,
        b: Site | str,
        delay: float,
        jitter: float = 0.0,
        *,
        table: int = DEFAULT_TABLE,
    ) -> DelayLine:
        """A delay line (``async with``) on the path between two sites, or a site
        and ``"server"``, both ways: ``delay`` one way, plus up to ``jitter``.
        Several lines at once need distinct ``table`` numbers."""

        def net(end: Site | str) -> str:
            if end == "server":
                return SERVER_NET
            site = end if isinstance(end, Site) else self.site(end)
            return f"{site.public_ip}/32"

        return DelayLine(
            self.inet_ns,
            [(net(a), net(b)), (net(b), net(a))],
            delay=delay,
            jitter=jitter,
            table=table,
        )

    async def set_hairpin(self, site: Site, on: bool) -> None:
        """Turn hairpinning on or off on the site's (home) router."""
        if not site.kind.natted:
            raise LabError(f"{site.name} has no router")
        rules = router_ruleset(
            site.kind,
            lan_net=site.lan_net,
            wan_ip=site.router_wan_ip,
            hairpin=on,
            stun_check=self._stun_check(site),
        )
        script = "delete table ip xr\n" + rules
        await netns.run_in(
            self.router_ns(site), ["nft", "-f", "-"], input=script.encode()
        )

    async def __aenter__(self) -> Lab:
        await self.up()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.down()
