"""WebSocket and circuit relay v2 in our host wrapper and the relay's HOP: the py-libp2p traps we
code around (each ``test_workaround_*`` fails when its workaround is removed; the
``*_trap_still_present`` controls show the library still needs it), over real sockets in one
process. The multi-process relay tests are in test_relay.py and test_nat.py."""
from __future__ import annotations

import os

import multiaddr
import pytest
import trio
from libp2p.network.exceptions import SwarmException
from libp2p.peer.peerinfo import PeerInfo
from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage
from libp2p.relay.circuit_v2.pb.circuit_pb2 import PeerId as CircuitPeerId
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as HOP
from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
from libp2p.relay.circuit_v2.protocol_buffer import StatusCode
from libp2p.relay.circuit_v2.utils import read_delimited_msg, write_delimited_msg

from helpers.procs import free_port
from helpers.tls import make_cert
from p2pswarm.errors import UserError
from p2pswarm.net.wire.framing import FrameReader, send_frame
from p2pswarm.net.libp2p.addrs import circuit_addr, is_circuit_addr
from p2pswarm.net.libp2p.host import open_host
from p2pswarm.net.signed.identity import Identity
from p2pswarm.net.signed.records import NodeRecord, RecordError
from p2pswarm.net.signed.tokens import TokenGate, issue_token
from p2pswarm.net.libp2p.relay_client import RelayKeeper
from p2pswarm.relay.config import RelaySettings
from p2pswarm.net.libp2p.relay_token import PROTOCOL_TOKEN, RelayRefused
from p2pswarm.relay.service import GatedHop, token_handler

LOOP = "/ip4/127.0.0.1/tcp/0"
ECHO = "/test/echo/1.0.0"


async def echo(stream) -> None:
    reader = FrameReader(stream, 1 << 28)
    while (frame := await reader.read_frame()) is not None:
        await send_frame(stream, frame, 1 << 28)


async def roundtrip(stream, payload: bytes) -> bytes:
    await send_frame(stream, payload, 1 << 28)
    return await FrameReader(stream, 1 << 28).read_frame()


def open_relay(settings: RelaySettings | None = None, gate=None, listen=("/ip4/127.0.0.1/tcp/0/ws",)):
    settings = settings or RelaySettings(open=True)
    hops: list[GatedHop] = []

    def make(host):
        hops.append(GatedHop(host, settings, gate))
        return hops[-1]

    ctx = open_host(Identity.generate(), list(listen), circuit_protocol=make)
    return ctx, hops


# -- WebSocket -------------------------------------------------------------------------------------
async def test_workaround_ws_and_wss_listeners_on_one_host(tmp_path, monkeypatch):
    """A TLS context on py-libp2p's WebSocket transport turns its plain /ws listener into TLS too;
    with our two transports both listeners work, and a TCP-only host dials both."""
    cert, key = make_cert(tmp_path)
    monkeypatch.setenv("P2PSWARM_WSS_CA", cert)
    ws, wss = free_port(), free_port()
    async with open_host(Identity.generate(), [f"/ip4/127.0.0.1/tcp/{ws}/ws", f"/ip4/127.0.0.1/tcp/{wss}/wss"],
                         tls_cert=cert, tls_key=key) as server:
        server.set_handler(ECHO, echo)
        addrs = server.full_addrs()
        assert any("/ws/" in a for a in addrs) and any("/wss/" in a for a in addrs), addrs
        for addr in addrs:
            async with open_host(Identity.generate(), [LOOP]) as client:  # TCP-only: dials WebSocket anyway
                stream = await client.open_stream(addr, ECHO, timeout_s=10)
                assert await roundtrip(stream, b"x" * 70000) == b"x" * 70000, addr
                await stream.aclose()


@pytest.mark.slow
async def test_ws_tls_trap_still_present(tmp_path, monkeypatch):
    """py-libp2p's own transport, given a TLS server context, makes a /ws listener that a plain
    WebSocket client cannot use."""
    from libp2p.transport.websocket.transport import WebsocketTransport

    cert, key = make_cert(tmp_path)
    monkeypatch.setenv("P2PSWARM_WSS_CA", cert)
    ws = free_port()
    from p2pswarm.net.libp2p import host_patches as libp2p_host_patches

    def library_websocket(host, tls_server, tls_client):
        network = host.get_network()
        tm = network.transport_manager
        tm._transports = [t for t in tm._transports if not isinstance(t, WebsocketTransport)]
        tm.add_transport(WebsocketTransport(network.upgrader, tls_server_config=tls_server,
                                            tls_client_config=tls_client))

    monkeypatch.setattr(libp2p_host_patches, "install_websocket", library_websocket)
    async with open_host(Identity.generate(), [f"/ip4/127.0.0.1/tcp/{ws}/ws", f"/ip4/127.0.0.1/tcp/{free_port()}/wss"],
                         tls_cert=cert, tls_key=key) as server:
        monkeypatch.undo()
        monkeypatch.setenv("P2PSWARM_WSS_CA", cert)
        async with open_host(Identity.generate(), [LOOP]) as client:
            with pytest.raises(UserError):
                await client.connect(f"/ip4/127.0.0.1/tcp/{ws}/ws/p2p/{server.peer_id_str}", timeout_s=5)


async def test_listen_address_checks():
    with pytest.raises(UserError, match="share port"):
        async with open_host(Identity.generate(), [LOOP, "/ip4/127.0.0.1/tcp/0/ws"]):
            pass
    with pytest.raises(UserError, match="TLS certificate"):
        async with open_host(Identity.generate(), [f"/ip4/127.0.0.1/tcp/{free_port()}/wss"]):
            pass
    with pytest.raises(UserError, match="not TCP or WebSocket"):
        async with open_host(Identity.generate(), ["/ip4/127.0.0.1/tcp/0/ws/ws"]):
            pass
    with pytest.raises(UserError, match="cannot load TLS"):
        async with open_host(Identity.generate(), [f"/ip4/127.0.0.1/tcp/{free_port()}/wss"],
                             tls_cert="/nonexistent.pem", tls_key="/nonexistent.key"):
            pass


# -- circuits --------------------------------------------------------------------------------------
async def test_workaround_connect_dials_circuit_addresses():
    """py-libp2p's host.connect() drops /p2p-circuit addresses ("relay-only"); NetHost.connect
    dials them through the circuit v2 transport, and the stream over it is Noise end to end."""
    ctx, hops = open_relay()
    async with ctx as relay, open_host(Identity.generate(), [LOOP]) as worker, \
            open_host(Identity.generate(), [LOOP]) as backbone:
        keeper = RelayKeeper(worker, relay.full_addrs()[0], None)
        await keeper.start()
        worker.set_handler(ECHO, echo)
        target = circuit_addr(relay.full_addrs()[0], worker.peer_id_str)
        assert is_circuit_addr(target) and worker.addrs() == [keeper.circuit]
        # the trap: the library's own connect cannot use the address
        with pytest.raises(SwarmException, match="relay-only"):
            with trio.fail_after(10):
                await backbone.host.connect(PeerInfo(worker.peer_id, [multiaddr.Multiaddr(target)]))
        stream = await backbone.open_stream(target, ECHO, timeout_s=10)
        for n in (0, 1, 65535, 65536, 65537, 1 << 20):
            data = os.urandom(n)
            assert await roundtrip(stream, data) == data
        assert hops[0].stats.circuits_opened == 1 and hops[0].stats.bytes_relayed > (1 << 20)


async def test_relay_sees_only_ciphertext(monkeypatch):
    """What the relay forwards is the end-to-end Noise session of worker and backbone: a marker
    sent over the relayed stream never appears in the bytes the relay copies."""
    seen = bytearray()
    splice = GatedHop._splice

    async def tapped(self, a, b):
        class Tap:
            def __init__(self, s):
                self.s = s

            async def read(self, n):
                data = await self.s.read(n)
                seen.extend(data)
                return data

            async def write(self, data):
                await self.s.write(data)

        return await splice(self, Tap(a), Tap(b))

    monkeypatch.setattr(GatedHop, "_splice", tapped)
    marker = b"PLAINTEXT-EXPERT-ACTIVATIONS-" * 100
    ctx, _hops = open_relay()
    async with ctx as relay, open_host(Identity.generate(), [LOOP]) as worker, \
            open_host(Identity.generate(), [LOOP]) as backbone, open_host(Identity.generate(), [LOOP]) as other:
        await RelayKeeper(worker, relay.full_addrs()[0], None).start()
        worker.set_handler(ECHO, echo)
        other.set_handler(ECHO, echo)
        stream = await backbone.open_stream(circuit_addr(relay.full_addrs()[0], worker.peer_id_str), ECHO)
        assert await roundtrip(stream, marker) == marker
    assert len(seen) > 2 * len(marker)  # the tap did see the traffic both ways
    assert b"PLAINTEXT-EXPERT" not in bytes(seen)


@pytest.mark.slow
async def test_workaround_two_circuits_from_one_peer_are_independent():
    """py-libp2p's HOP keys a circuit's streams by peer id: closing one circuit from a backbone
    closed the backbone's other circuit too. Ours keeps them apart."""
    ctx, hops = open_relay()
    async with ctx as relay, open_host(Identity.generate(), [LOOP]) as w1, \
            open_host(Identity.generate(), [LOOP]) as w2, open_host(Identity.generate(), [LOOP]) as backbone:
        for w in (w1, w2):
            await RelayKeeper(w, relay.full_addrs()[0], None).start()
            w.set_handler(ECHO, echo)
        s1 = await backbone.open_stream(circuit_addr(relay.full_addrs()[0], w1.peer_id_str), ECHO)
        s2 = await backbone.open_stream(circuit_addr(relay.full_addrs()[0], w2.peer_id_str), ECHO)
        assert await roundtrip(s1, b"one") == b"one" and await roundtrip(s2, b"two") == b"two"
        await backbone.host.get_network().close_peer(w1.peer_id)  # the first circuit ends
        await trio.sleep(1.0)
        assert await roundtrip(s2, b"still here" * 1000) == b"still here" * 1000
        assert hops[0].stats.circuits_active == 1


async def test_workaround_reservation_in_another_peers_name_is_refused():
    """py-libp2p reserves for the peer named in the RESERVE message: a peer without a token could
    renew or take a token holder's slot. Ours answers PERMISSION_DENIED."""
    issuer = Identity.generate()
    gate = TokenGate([issuer.peer_id_str], what="relay")
    ctx, hops = open_relay(RelaySettings(trust_issuer=[issuer.peer_id_str]), gate)
    async with ctx as relay, open_host(Identity.generate(), [LOOP]) as holder, \
            open_host(Identity.generate(), [LOOP]) as other:
        relay.set_handler(PROTOCOL_TOKEN, token_handler(hops[0]), read_ahead=False)
        token = issue_token(issuer, holder.peer_id_str, ["relay"], 3600).encode()
        await RelayKeeper(holder, relay.full_addrs()[0], token).start()
        await other.connect(relay.full_addrs()[0])
        stream = await other.host.new_stream(relay.peer_id, [HOP])
        await write_delimited_msg(stream, HopMessage(type=HopMessage.RESERVE,
                                                     peer=CircuitPeerId(id=holder.peer_id.to_bytes())))
        resp = await read_delimited_msg(stream, HopMessage)
        assert resp.status == StatusCode.PERMISSION_DENIED
        with trio.fail_after(10):  # the relay's handlers linger 0.1 s after answering before they count
            while not (hops[0].refused["other peer"] and hops[0].stats.reservations_granted):
                await trio.sleep(0.01)
        assert hops[0].refused["other peer"] == 1 and hops[0].stats.reservations_granted == 1


async def test_spoofed_reservation_trap_still_present():
    async with open_host(Identity.generate(), ["/ip4/127.0.0.1/tcp/0/ws"],
                         circuit_protocol=lambda h: CircuitV2Protocol(h, allow_hop=True)) as relay, \
            open_host(Identity.generate(), [LOOP]) as victim, open_host(Identity.generate(), [LOOP]) as other:
        await victim.connect(relay.full_addrs()[0])
        await other.connect(relay.full_addrs()[0])
        stream = await other.host.new_stream(relay.peer_id, [HOP])
        await write_delimited_msg(stream, HopMessage(type=HopMessage.RESERVE,
                                                     peer=CircuitPeerId(id=victim.peer_id.to_bytes())))
        resp = await read_delimited_msg(stream, HopMessage)
        assert resp.status == StatusCode.OK
        assert relay.circuit.protocol.resource_manager.get_reservation(victim.peer_id) is not None


async def test_keeper_without_token_is_refused_by_a_gated_relay():
    issuer = Identity.generate()
    gate = TokenGate([issuer.peer_id_str], what="relay")
    ctx, hops = open_relay(RelaySettings(trust_issuer=[issuer.peer_id_str]), gate)
    async with ctx as relay, open_host(Identity.generate(), [LOOP]) as worker:
        relay.set_handler(PROTOCOL_TOKEN, token_handler(hops[0]), read_ahead=False)
        with pytest.raises(RelayRefused, match="no token"):
            await RelayKeeper(worker, relay.full_addrs()[0], None).start()
        assert hops[0].refused["no token"] == 1 and hops[0].stats.reservations_granted == 0


def test_circuit_addresses_in_node_records():
    ident = Identity.generate()
    relay_id = Identity.generate().peer_id_str
    relayed = f"/ip4/10.0.0.1/tcp/443/wss/p2p/{relay_id}/p2p-circuit"
    rec = NodeRecord.make(ident, addrs=[relayed], protocol=1, kernel="numpy", block_size=8, shards=[], ttl_s=60)
    assert NodeRecord.verify(rec.signed, peer=ident.peer_id_str).addrs == (relayed,)
    with pytest.raises(RecordError, match="/p2p/"):
        bad = NodeRecord.make(ident, addrs=[f"/ip4/10.0.0.1/tcp/1/p2p/{relay_id}"], protocol=1, kernel="numpy",
                              block_size=8, shards=[], ttl_s=60)
        NodeRecord.verify(bad.signed, peer=ident.peer_id_str)


async def test_circuits_need_token_refuses_a_dialler_without_one():
    issuer = Identity.generate()
    gate = TokenGate([issuer.peer_id_str], what="relay")
    ctx, hops = open_relay(RelaySettings(trust_issuer=[issuer.peer_id_str], circuits_need_token=True), gate)
    async with ctx as relay, open_host(Identity.generate(), [LOOP]) as worker, \
            open_host(Identity.generate(), [LOOP]) as backbone:
        relay.set_handler(PROTOCOL_TOKEN, token_handler(hops[0]), read_ahead=False)
        await RelayKeeper(worker, relay.full_addrs()[0],
                          issue_token(issuer, worker.peer_id_str, ["relay"], 3600).encode()).start()
        worker.set_handler(ECHO, echo)
        target = circuit_addr(relay.full_addrs()[0], worker.peer_id_str)
        with pytest.raises(UserError, match="through its relay"):
            await backbone.open_stream(target, ECHO, timeout_s=10)
        assert hops[0].refused["no token"] == 1 and hops[0].stats.circuits_opened == 0
        backbone.relay_token = issue_token(issuer, backbone.peer_id_str, ["relay"], 3600).encode()
        stream = await backbone.open_stream(target, ECHO, timeout_s=10)
        assert await roundtrip(stream, b"ok") == b"ok"
        assert hops[0].stats.circuits_opened == 1


@pytest.mark.slow
async def test_keeper_renews_before_expiry():
    """A 10 s reservation is renewed at half its life, in place (no second grant), and the
    worker stays reachable past the first expiry."""
    ctx, hops = open_relay(RelaySettings(open=True, reservation_ttl=10))
    async with ctx as relay, open_host(Identity.generate(), [LOOP]) as worker, \
            open_host(Identity.generate(), [LOOP]) as backbone:
        keeper = RelayKeeper(worker, relay.full_addrs()[0], None)
        await keeper.start()
        first = keeper.expires
        worker.set_handler(ECHO, echo)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(keeper.keep)
            await trio.sleep(11)
            assert keeper.reservations >= 2 and keeper.expires > first, (keeper.reservations, keeper.expires, first)
            assert hops[0].stats.reservations_granted == 1 and hops[0].active_reservations() == 1
            stream = await backbone.open_stream(circuit_addr(relay.full_addrs()[0], worker.peer_id_str), ECHO)
            assert await roundtrip(stream, b"alive") == b"alive"
            nursery.cancel_scope.cancel()


async def _identify(host, peer_id):
    """The identify message ``host`` gets from ``peer_id`` (on the connection it already has)."""
    from libp2p.identity.identify.identify import ID as IDENTIFY, parse_identify_response
    from libp2p.utils.varint import decode_varint_from_bytes

    stream = await host.host.new_stream(peer_id, [IDENTIFY])
    data = b""
    with trio.fail_after(10):
        while True:
            try:
                chunk = await stream.read(65536)
            except Exception:
                break
            if not chunk:
                break
            data += chunk
    await stream.close()
    n = decode_varint_from_bytes(data)
    return parse_identify_response(data[len(data) - n:])


def _observed(msg) -> str | None:
    return str(multiaddr.Multiaddr(msg.observed_addr)) if msg.observed_addr else None


async def test_workaround_identify_sends_no_observed_address_over_a_circuit(monkeypatch):
    """py-libp2p reports a relayed peer's observed address as ``/p2p/<its own id>/p2p-circuit/...``
    (js-libp2p then drops the whole identify message); with the fix neither end of a circuit sends
    one, the worker's protocols still arrive, and a direct connection still reports its socket."""
    from libp2p.identity.identify import identify as ident

    ctx, _ = open_relay()
    async with ctx as relay, open_host(Identity.generate(), [LOOP]) as worker, \
            open_host(Identity.generate(), [LOOP]) as backbone, open_host(Identity.generate(), [LOOP]) as other:
        await RelayKeeper(worker, relay.full_addrs()[0], None).start()
        worker.set_handler(ECHO, echo)
        other.set_handler(ECHO, echo)
        stream = await backbone.open_stream(circuit_addr(relay.full_addrs()[0], worker.peer_id_str), ECHO,
                                            timeout_s=10)
        assert await roundtrip(stream, b"ping") == b"ping"
        from_worker = await _identify(backbone, worker.peer_id)
        from_backbone = await _identify(worker, backbone.peer_id)
        assert _observed(from_worker) is None and _observed(from_backbone) is None
        assert ECHO in from_worker.protocols
        # a direct TCP connection still reports the socket address it saw
        await (await backbone.open_stream(other.full_addrs()[0], ECHO, timeout_s=10)).aclose()
        direct = _observed(await _identify(backbone, other.peer_id))
        assert direct is not None and direct.startswith("/ip4/127.0.0.1/tcp/"), direct
        # the trap: the library's own choice names the worker itself where the relay belongs
        monkeypatch.setattr(ident, "_prefer_circuit_addr", ident._prefer_circuit_addr.library)
        bogus = _observed(await _identify(backbone, worker.peer_id))
        assert bogus is not None and bogus.startswith(f"/p2p/{worker.peer_id_str}/p2p-circuit"), bogus
