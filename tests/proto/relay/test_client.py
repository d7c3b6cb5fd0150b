"""The relay client core against the server core, on an in-memory network."""

from __future__ import annotations

import os

from crossroads.proto.relay import client as c
from crossroads.proto.relay import messages as m
from crossroads.proto.relay.server import RelayServer, RelayServerConfig
from crossroads.proto.relay.token import AllocationClaims, Role, TokenSealer
from crossroads.types import Address

NODE = "n"
WALL = 1_700_000_000.0
SEALER = TokenSealer(b"q" * 32, os.urandom)
SERVER: Address = ("203.0.113.1", 7780)


class Net:
    """A server core and client cores exchanging datagrams with a fake clock."""

    def __init__(self, **config: object) -> None:
        self.now = 0.0
        self.server = RelayServer(
            RelayServerConfig(node_id=NODE, **config),  # type: ignore[arg-type]
            SEALER,
            wall_offset=WALL,
        )
        self.clients: dict[Address, c.RelayClient] = {}
        self.lost: set[Address] = set()  # client addresses whose packets vanish

    def allocation(
        self, role: Role, host_id: bytes | None = None, max_connections: int = 4
    ) -> tuple[bytes, bytes, bytes]:
        aid = os.urandom(16)
        claims = AllocationClaims(aid, host_id or aid, role, max_connections, WALL + 10)
        return aid, SEALER.key_for(aid), SEALER.seal(claims, NODE)

    def add(self, addr: Address, client: c.RelayClient) -> c.RelayClient:
        self.clients[addr] = client
        return client

    def move(self, old: Address, new: Address) -> None:
        self.clients[new] = self.clients.pop(old)

    def pump(self) -> None:
        for _ in range(20):
            moved = False
            for addr, client in list(self.clients.items()):
                for data, dest in client.datagrams_to_send(self.now):
                    assert dest == SERVER
                    moved = True
                    if addr not in self.lost:
                        self.server.receive_datagram(data, addr, self.now)
            for data, dest in self.server.datagrams_to_send(self.now):
                moved = True
                if dest in self.clients:
                    self.clients[dest].receive_datagram(data, SERVER, self.now)
            if not moved:
                return

    def advance(self, seconds: float, step: float = 0.25) -> None:
        end = self.now + seconds
        while self.now < end:
            self.now = min(end, self.now + step)
            for client in self.clients.values():
                timer = client.get_timer()
                if timer is not None and timer <= self.now:
                    client.handle_timer(self.now)
            timer = self.server.get_timer()
            if timer is not None and timer <= self.now:
                self.server.handle_timer(self.now)
            self.pump()


def host_and_joiners(
    net: Net, joiners: int, max_connections: int = 4
) -> list[c.RelayClient]:
    hid, hkey, htoken = net.allocation(Role.HOST, max_connections=max_connections)
    host = net.add(("198.51.100.1", 1000), c.RelayClient(hid, hkey, htoken, SERVER))
    host.start(net.now)
    players = [host]
    for i in range(joiners):
        jid, jkey, jtoken = net.allocation(Role.JOINER, hid)
        joiner = c.RelayClient(jid, jkey, jtoken, SERVER, host_connection_data=htoken)
        net.add(("198.51.100.2", 2000 + i), joiner)
        joiner.start(net.now)
        joiner.connect(net.now)
        players.append(joiner)
    net.pump()
    return players


def test_host_and_joiners_exchange_data() -> None:
    net = Net()
    host, j1, j2 = host_and_joiners(net, 2)
    assert host.state is c.ClientState.BOUND
    assert (
        j1.state is c.ClientState.CONNECTED
        and j1.host_allocation_id == host.allocation_id
    )
    assert c.Connected(host.allocation_id) in j2.pop_events()
    j1.send(host.allocation_id, b"from j1", net.now)
    j2.send(host.allocation_id, b"from j2", net.now)
    net.pump()
    events = host.pop_events()
    assert c.PeerJoined(j1.allocation_id) in events
    assert c.Data(j1.allocation_id, b"from j1") in events
    assert c.Data(j2.allocation_id, b"from j2") in events
    host.send(j2.allocation_id, b"to j2", net.now)
    net.pump()
    assert c.Data(host.allocation_id, b"to j2") in j2.pop_events()


def test_bind_is_retried_with_a_new_nonce_until_answered() -> None:
    net = Net()
    hid, hkey, htoken = net.allocation(Role.HOST)
    host = net.add(("198.51.100.1", 1000), c.RelayClient(hid, hkey, htoken, SERVER))
    net.lost.add(("198.51.100.1", 1000))
    host.start(net.now)
    net.advance(3.1)
    assert host.state is c.ClientState.BINDING and host.nonce == 4
    net.lost.clear()
    net.advance(1.0)
    assert host.state is c.ClientState.BOUND


def test_rejected_when_full() -> None:
    net = Net()
    host, j1, j2 = host_and_joiners(net, 2, max_connections=1)
    assert j1.state is c.ClientState.CONNECTED
    assert c.Rejected() in j2.pop_events() and j2.state is c.ClientState.BOUND


def test_keepalive_keeps_an_idle_session_alive() -> None:
    net = Net(idle_timeout=10.0, host_alone_timeout=60.0)
    host, j1 = host_and_joiners(net, 1)
    net.advance(40.0)
    assert len(net.server.allocations) == 2
    assert j1.state is c.ClientState.CONNECTED


def test_address_change_rebinds_on_error_3() -> None:
    net = Net()
    host, j1 = host_and_joiners(net, 1)
    nonce = j1.nonce
    net.move(("198.51.100.2", 2000), ("198.51.100.2", 2999))
    j1.send(host.allocation_id, b"lost: relay answers ERROR 3", net.now)
    net.pump()
    assert j1.nonce == nonce + 1
    assert c.RelayError(m.ErrorCode.ALLOCATION_ID_CLIENT_MISMATCH) in j1.pop_events()
    j1.send(host.allocation_id, b"after rebind", net.now)
    net.pump()
    assert c.Data(j1.allocation_id, b"after rebind") in host.pop_events()


def test_silence_makes_the_client_rebind() -> None:
    net = Net(idle_timeout=100.0, host_alone_timeout=100.0)
    (host,) = host_and_joiners(net, 0)
    nonce = host.nonce
    net.lost.add(("198.51.100.1", 1000))
    net.advance(9.5)
    assert host.nonce == nonce + 1  # re-BIND after 3 heartbeats without a reply


def test_timeout_invalidates_the_client() -> None:
    net = Net(idle_timeout=10.0, host_alone_timeout=10.0)
    host, j1 = host_and_joiners(net, 1)
    j1.send(host.allocation_id, b"hello", net.now)
    net.pump()
    net.lost.add(("198.51.100.2", 2000))
    net.advance(12.0)
    assert j1.allocation_id not in net.server.allocations
    assert c.PeerLeft(j1.allocation_id) in host.pop_events()
    # Only the joiner's outgoing packets were lost: it hears ERROR 1 and stops.
    assert c.Invalid("timed-out") in j1.pop_events()
    assert j1.state is c.ClientState.INVALID and j1.get_timer() is None


def test_host_close_disconnects_joiners() -> None:
    net = Net()
    host, j1 = host_and_joiners(net, 1)
    host.close(net.now)
    net.pump()
    assert c.PeerLeft(host.allocation_id) in j1.pop_events()
    assert j1.state is c.ClientState.BOUND
    assert not net.server.allocations


def test_datagrams_from_elsewhere_are_ignored() -> None:
    net = Net()
    host, j1 = host_and_joiners(net, 1)
    j1.pop_events()
    frame = m.Relay(os.urandom(16), j1.allocation_id, b"spoof").encode()
    j1.receive_datagram(frame, ("203.0.113.99", 7780), net.now)
    assert j1.pop_events() == []
