"""The relay service: py-libp2p's circuit relay v2 (HOP) on WebSocket, gated by node tokens, plus a
DHT bootstrap server and a JSON health endpoint.

A phone behind carrier NAT on a network where only 80/443 pass dials *out* to the relay over
WebSocket (``/wss`` on 443 directly, or ``/ws`` behind a CDN that terminates TLS), shows its node
token on ``/p2pswarm/token/1.0.0``, and reserves a slot. A backbone dials
``<relay>/p2p/<relay id>/p2p-circuit/p2p/<phone id>``: the relay opens a STOP stream to the phone
and splices the two streams. The backbone and the phone then run Noise (and yamux) *over* the
spliced stream, end to end: the relay forwards ciphertext it has no key for, and a relay that
tampered with it would fail Noise's authentication, not corrupt an expert's output.

What we change in py-libp2p 0.8.1's HOP (:class:`GatedHop`), and why:

* Reservations only for peers that showed a valid token (checked against the Noise-authenticated
  peer id), and circuits only to such peers; ``circuits_need_token`` also requires it of the
  dialling side. py-libp2p has no hook for this: we override its RESERVE and CONNECT handlers.
* py-libp2p reserves for the peer id named *in the RESERVE message* when one is given, so any peer
  could take (or refresh) a reservation in someone else's name. We refuse a RESERVE that names a
  peer other than the connection's authenticated one.
* py-libp2p keeps a circuit's streams in a dict keyed by peer id, so a second circuit from the
  same backbone (or to the same worker) overwrites the first one's entry, and when either ends its
  clean-up closes the *other* circuit's streams. Ours keeps each circuit's streams to itself.
* py-libp2p's splice treats yamux's end-of-stream as an unexpected error, retries the read twice
  with back-off sleeps and logs at ERROR each time. Ours ends both directions on the first EOF or
  error, at once.
* Limits: all reservations, all circuits, circuits per reserved peer, bytes and seconds per circuit,
  reservation TTL (py-libp2p: 4 reservations, 8 circuits per peer, a 2 min / 1 MiB circuit).
  Reservations of peers that have disconnected are dropped when the table is full.
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass

import msgpack
import trio
from libp2p.peer.id import ID
from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage, Limit, StopMessage
from libp2p.relay.circuit_v2.pb.circuit_pb2 import PeerId as CircuitPeerId
from libp2p.relay.circuit_v2.protocol import STOP_PROTOCOL_ID, CircuitV2Protocol
from libp2p.relay.circuit_v2.protocol_buffer import StatusCode
from libp2p.relay.circuit_v2.resources import RelayLimits
from libp2p.relay.circuit_v2.utils import read_delimited_msg, write_delimited_msg
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from p2pswarm.errors import FrameError, UserError, clip
from p2pswarm.http_server import serve_asgi
from p2pswarm.lifecycle import until_signal
from p2pswarm.net.wire.framing import FrameReader, send_frame
from p2pswarm.net.libp2p.relay_discovery import advertise_relay
from p2pswarm.net.libp2p.relay_token import MAX_TOKEN_FRAME, PROTOCOL_TOKEN, TOKEN_TIMEOUT_S
from p2pswarm.relay.config import RelaySettings
from p2pswarm.relay.metrics import relay_metrics

log = logging.getLogger("p2pswarm.relay")

STOP_TIMEOUT_S = 15.0
MAX_READ = 1 << 20


@dataclass
class RelayStats:
    reservations_granted: int = 0
    reservations_refused: int = 0
    circuits_opened: int = 0
    circuits_refused: int = 0
    circuits_active: int = 0
    bytes_relayed: int = 0
    tokens_accepted: int = 0


class GatedHop(CircuitV2Protocol):
    """Circuit relay v2 HOP with token-gated reservations and our own circuit splice (module doc)."""

    def __init__(self, host, settings: RelaySettings, gate=None):
        limits = RelayLimits(duration=settings.max_circuit_duration, data=settings.max_circuit_bytes,
                             max_circuit_conns=settings.max_circuits_per_peer,
                             max_reservations=settings.max_reservations, reservation_ttl=settings.reservation_ttl)
        super().__init__(host, limits=limits, allow_hop=True)
        self.settings = settings
        self.gate = gate  # TokenGate, or None for an --open relay
        self.stats = RelayStats()
        self.refused: Counter[str] = gate.refused if gate is not None else Counter()
        self.grants: dict[str, int] = {}  # peer id -> when its token's grant ends (unix s)

    # -- tokens ------------------------------------------------------------------------------
    def grant(self, peer: str, until: int) -> None:
        self.grants[peer] = until

    def why_not(self, peer: ID) -> tuple[str, str] | None:
        """``(reason key, explanation)`` when ``peer`` may not use the relay now, else None."""
        if self.gate is None:
            return None
        until = self.grants.get(peer.to_base58())
        if until is None:
            return "no token", "no token presented"
        if time.time() >= until:
            return "expired", "its token has expired"
        return None

    def _refuse_log(self, what: str, peer: ID, key: str, text: str) -> None:
        self.refused[key] += 1
        log.warning("relay refused %s for %s: %s", what, peer.to_base58(), text)

    def active_reservations(self) -> int:
        net = self.host.get_network()
        return sum(1 for pid, r in self.resource_manager._reservations.items()
                   if not r.is_expired() and net.connections.get(pid))

    def _drop_disconnected(self) -> None:
        net = self.host.get_network()
        table = self.resource_manager._reservations
        for pid in [p for p in table if not net.connections.get(p)]:
            del table[pid]

    # -- RESERVE -----------------------------------------------------------------------------
    async def _handle_reserve(self, stream, msg: HopMessage) -> None:
        remote = stream.muxed_conn.peer_id
        if msg.HasField("peer") and msg.peer.id and bytes(msg.peer.id) != remote.to_bytes():
            self.stats.reservations_refused += 1
            self._refuse_log("a reservation", remote, "other peer", "it asked to reserve in another peer's name")
            await self._send_status(stream, StatusCode.PERMISSION_DENIED, "reservation in another peer's name")
            return
        denied = self.why_not(remote)
        if denied is not None:
            self.stats.reservations_refused += 1
            self._refuse_log("a reservation", remote, *denied)
            await self._send_status(stream, StatusCode.PERMISSION_DENIED, denied[1])
            return
        msg.ClearField("peer")  # py-libp2p then reserves for the connection's peer
        rm = self.resource_manager
        held = rm.get_reservation(remote)
        had = held is not None and not held.is_expired()
        if not had and len(rm._reservations) >= self.limits.max_reservations:
            self._drop_disconnected()
        if not had and not rm.can_accept_reservation(remote):
            self.stats.reservations_refused += 1
            self._refuse_log("a reservation", remote, "limit", f"all {self.limits.max_reservations} slots taken")
            await self._send_status(stream, StatusCode.RESOURCE_LIMIT_EXCEEDED, "reservation limit reached")
            return
        await super()._handle_reserve(stream, msg)
        res = rm.get_reservation(remote)
        if res is not None and not res.is_expired():
            if not had:
                self.stats.reservations_granted += 1
                log.info("reservation for %s granted (%d active)", remote.to_base58(), self.active_reservations())
            else:
                log.debug("reservation for %s renewed", remote.to_base58())

    # -- CONNECT -----------------------------------------------------------------------------
    async def _handle_connect(self, stream, msg: HopMessage) -> None:
        src = stream.muxed_conn.peer_id
        try:
            dst = ID(msg.peer.id)
        except Exception:
            await self._refuse_circuit(stream, src, None, StatusCode.MALFORMED_MESSAGE, "malformed", "bad peer id")
            return
        if self.settings.circuits_need_token:
            denied = self.why_not(src)
            if denied is not None:
                await self._refuse_circuit(stream, src, dst, StatusCode.PERMISSION_DENIED, *denied)
                return
        res = self.resource_manager.get_reservation(dst)
        if res is None or res.is_expired() or self.why_not(dst) is not None:
            await self._refuse_circuit(stream, src, dst, StatusCode.NO_RESERVATION, "no reservation",
                                       "the destination holds no reservation here")
            return
        if self.stats.circuits_active >= self.settings.max_circuits:
            await self._refuse_circuit(stream, src, dst, StatusCode.RESOURCE_LIMIT_EXCEEDED, "limit",
                                       f"all {self.settings.max_circuits} circuits in use")
            return
        if res.active_connections >= self.limits.max_circuit_conns:
            await self._refuse_circuit(stream, src, dst, StatusCode.RESOURCE_LIMIT_EXCEEDED, "limit",
                                       f"the destination has {res.active_connections} circuits, the most allowed")
            return
        self.stats.circuits_active += 1
        res.active_connections += 1
        dst_stream = None
        try:
            try:
                with trio.fail_after(STOP_TIMEOUT_S):
                    dst_stream = await self.host.new_stream(dst, [STOP_PROTOCOL_ID])
                    await write_delimited_msg(dst_stream, StopMessage(
                        type=StopMessage.CONNECT, peer=CircuitPeerId(id=src.to_bytes()),
                        limit=Limit(duration=self.limits.duration, data=self.limits.data)))
                    resp = await read_delimited_msg(dst_stream, StopMessage)
                if resp.HasField("status") and resp.status != StatusCode.OK:
                    raise ConnectionError(f"destination answered status {resp.status}")
            except (Exception, trio.TooSlowError) as exc:
                self.stats.circuits_refused += 1
                log.warning("circuit %s -> %s failed: %s", src.to_base58(), dst.to_base58(),
                            clip(exc, 300) or type(exc).__name__)
                await self._send_status(stream, StatusCode.CONNECTION_FAILED, "cannot reach the destination")
                await _reset(stream, dst_stream)
                return
            await self._send_status(stream, StatusCode.OK, "circuit established",
                                    limit=Limit(duration=self.limits.duration, data=self.limits.data))
            self.stats.circuits_opened += 1
            log.info("circuit %s -> %s open (%d active)", src.to_base58(), dst.to_base58(),
                     self.stats.circuits_active)
            moved = await self._splice(stream, dst_stream)
            log.info("circuit %s -> %s closed after %d bytes (%d active)", src.to_base58(),
                     dst.to_base58(), moved, self.stats.circuits_active - 1)
        finally:
            self.stats.circuits_active -= 1
            self.resource_manager.release_connection(dst)
            with trio.CancelScope(shield=True):
                await _reset(stream, dst_stream)

    async def _refuse_circuit(self, stream, src, dst, code, key, text) -> None:
        self.stats.circuits_refused += 1
        self._refuse_log(f"a circuit to {dst.to_base58() if dst else '?'}", src, key, text)
        await self._send_status(stream, code, text)
        await _reset(stream, None)

    async def _splice(self, a, b) -> int:
        """Copy both ways until either side ends; returns bytes moved. One byte budget and one
        deadline for the whole circuit (0 = none)."""
        budget = [self.limits.data or None]
        moved = [0]
        deadline = time.monotonic() + self.limits.duration if self.limits.duration else None

        async def pump(src, dst, nursery) -> None:
            try:
                while True:
                    try:
                        data = await src.read(MAX_READ)
                    except Exception:
                        return
                    if not data:
                        return
                    if budget[0] is not None:
                        budget[0] -= len(data)
                        if budget[0] < 0:
                            log.warning("circuit byte limit (%d) reached: closing it", self.limits.data)
                            return
                    try:
                        await dst.write(data)
                    except Exception:
                        return
                    moved[0] += len(data)
                    self.stats.bytes_relayed += len(data)
            finally:
                nursery.cancel_scope.cancel()

        with trio.move_on_at(deadline if deadline is not None else float("inf")) as scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(pump, a, b, nursery)
                nursery.start_soon(pump, b, a, nursery)
        if deadline is not None and scope.cancelled_caught:
            log.warning("circuit duration limit (%d s) reached: closed it", self.limits.duration)
        return moved[0]


async def _reset(*streams) -> None:
    for s in streams:
        if s is None:
            continue
        with trio.move_on_after(2):
            try:
                await s.reset()
            except Exception:
                pass


def token_handler(hop: GatedHop):
    """Serves ``/p2pswarm/token/1.0.0`` (see p2pswarm.net.libp2p.relay_token)."""
    from p2pswarm.net.signed.tokens import TokenError

    async def handle(stream) -> None:
        peer = stream.peer_id.to_base58()
        with trio.move_on_after(TOKEN_TIMEOUT_S):
            try:
                payload = await FrameReader(stream, MAX_TOKEN_FRAME).read_frame()
            except FrameError as exc:  # oversized or cut short: refuse it, close this stream only
                hop.refused["malformed token frame"] += 1
                log.warning("closing token stream from %s: %s", peer, exc)
                await _try_send(stream, msgpack.packb({"ok": False, "error": str(exc)}))
                return
            if payload is None:
                return
            try:
                req = msgpack.unpackb(payload, raw=False)
                token = req.get("token") if isinstance(req, dict) else None
            except Exception:
                token = None
            reply: dict[str, object]
            if hop.gate is None:
                until = int(time.time()) + hop.limits.reservation_ttl * 24
                hop.grant(peer, until)
                reply = {"ok": True, "expires": until}
            else:
                try:
                    tok = hop.gate.check(token if isinstance(token, str) else None, peer=peer, scope="relay")
                except TokenError as exc:
                    reply = {"ok": False, "error": str(exc)}
                else:
                    renewal = peer in hop.grants  # every renewal shows the token again: log the first only
                    hop.grant(peer, tok.expires_at)
                    hop.stats.tokens_accepted += 1
                    (log.debug if renewal else log.info)(
                        "token of %s accepted (issuer %s, expires %s)", peer, tok.issuer,
                        time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(tok.expires_at)))
                    reply = {"ok": True, "expires": tok.expires_at}
            await send_frame(stream, msgpack.packb(reply), MAX_TOKEN_FRAME)
            await stream.send_eof()

    return handle


async def _try_send(stream, payload: bytes) -> None:
    try:
        await send_frame(stream, payload, MAX_TOKEN_FRAME)
    except (trio.BrokenResourceError, trio.ClosedResourceError, FrameError):
        pass


def health(net, hop: GatedHop, dht=None) -> dict:
    s = hop.stats
    return {"status": "ok", "peer_id": net.peer_id_str, "addrs": net.full_addrs(),
            "open": hop.gate is None, "reservations": hop.active_reservations(),
            "reservations_granted": s.reservations_granted, "reservations_refused": s.reservations_refused,
            "circuits": s.circuits_active, "circuits_opened": s.circuits_opened, "circuits_refused": s.circuits_refused,
            "bytes_relayed": s.bytes_relayed, "tokens_accepted": s.tokens_accepted, "refusals": dict(hop.refused),
            "dht_peers": len(dht.routing_peers()) if dht is not None else 0,
            "limits": {"max_reservations": hop.settings.max_reservations, "max_circuits": hop.settings.max_circuits,
                       "max_circuits_per_peer": hop.settings.max_circuits_per_peer,
                       "max_circuit_bytes": hop.settings.max_circuit_bytes,
                       "max_circuit_duration": hop.settings.max_circuit_duration,
                       "reservation_ttl": hop.settings.reservation_ttl}}


class HealthApp:
    """The relay's health port: ``GET /health`` (and ``/``) its state as JSON, ``GET /metrics`` the
    same numbers in Prometheus text format (:mod:`p2pswarm.relay.metrics`). A Starlette app, like the
    backbone's API."""

    def __init__(self, report):
        self.report = report
        self.app = Starlette(routes=[Route("/", self._health), Route("/health", self._health),
                                     Route("/metrics", self._metrics)],
                             exception_handlers={HTTPException: self._not_found})

    async def __call__(self, scope, receive, send):
        await self.app(scope, receive, send)

    async def _health(self, request) -> Response:
        return JSONResponse(self.report())

    async def _metrics(self, request) -> Response:
        payload, ctype = relay_metrics(self.report)
        return Response(payload, media_type=ctype)

    async def _not_found(self, request, exc) -> Response:
        return JSONResponse({"error": "not found: try GET /health or /metrics"}, status_code=exc.status_code)


async def serve_health(app, host: str, port: int, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    await serve_asgi(app, host, port, logger="p2pswarm.relay.http", task_status=task_status)


async def run_relay(settings: RelaySettings) -> None:
    """Run until SIGINT/SIGTERM. Prints ``READY <first full address> health=<url|off>``."""
    from p2pswarm.market.swarm_dht import open_dht
    from p2pswarm.net.libp2p.host import open_host
    from p2pswarm.net.signed.identity import default_identity_path, load_or_create_identity
    from p2pswarm.net.libp2p.host_patches import DEFAULT_MAX_CONNECTIONS

    gate = None
    if settings.trust_issuer:
        from p2pswarm.signatures import peer_public_key
        from p2pswarm.net.signed.tokens import TokenGate

        for issuer in settings.trust_issuer:
            try:
                peer_public_key(issuer)
            except UserError:
                raise UserError(f"--trust-issuer {issuer[:60]!r} is not an Ed25519 peer id") from None
        gate = TokenGate(settings.trust_issuer, what="relay")
    from p2pswarm.net.libp2p.addrs import check_listen_addrs, parse_multiaddr

    # bad addresses are refused before anything is created on disk
    check_listen_addrs([parse_multiaddr(a, "listen address") for a in settings.listen], tls=bool(settings.tls_cert))
    for a in settings.announce:
        parse_multiaddr(a, "announce address")
    for a in settings.bootstrap:
        parse_multiaddr(a, "bootstrap address")
    identity = load_or_create_identity(settings.identity or default_identity_path("relay"), exclusive=True)
    hops: list[GatedHop] = []

    def make_hop(host):
        hops.append(GatedHop(host, settings, gate))
        return hops[-1]

    async with open_host(identity, settings.listen, announce=settings.announce or None, tls_cert=settings.tls_cert,
                         tls_key=settings.tls_key, circuit_protocol=make_hop,
                         max_connections=max(DEFAULT_MAX_CONNECTIONS, settings.max_reservations + 256)) as net:
        hop = hops[0]
        net.set_handler(PROTOCOL_TOKEN, token_handler(hop), read_ahead=False)
        async with open_dht(net, server=True, bootstrap=settings.bootstrap) as dht:
            addrs = net.full_addrs() or _local_addrs(net)
            async with trio.open_nursery() as nursery:
                url = "off"
                if settings.health:
                    host, _, port = settings.health.rpartition(":")
                    try:
                        binds = await nursery.start(serve_health, HealthApp(lambda: health(net, hop, dht)),
                                                    host.strip("[]"), int(port))
                    except OSError as exc:
                        raise UserError(f"cannot serve health on {settings.health}: {exc.strerror or exc}") from None
                    url = f"{binds[0]}/health"
                log.info("relay %s up on %s (%s; health %s; limits: %d reservations, %d circuits)", net.peer_id_str,
                         ", ".join(addrs) or "(no dialable address)",
                         "open" if gate is None else f"tokens of {len(settings.trust_issuer)} issuer(s)", url,
                         settings.max_reservations, settings.max_circuits)
                nursery.start_soon(_report, net, hop, dht)
                nursery.start_soon(advertise_relay, dht)  # how workers find this relay (p2pswarm/net/libp2p/relay_discovery.py)
                await until_signal(nursery.cancel_scope,
                                   ready=f"READY {addrs[0] if addrs else net.peer_id_str} health={url}")
    log.info("relay stopped")


def _local_addrs(net) -> list[str]:
    """Listening on 0.0.0.0 without --announce advertises nothing (we never guess a public
    address), but the operator still needs an address to hand out: this host's own IPv4."""
    import socket

    try:
        ip = socket.gethostbyname(socket.gethostname())
    except OSError:
        ip = "127.0.0.1"
    out = [f"{str(a).replace('/ip4/0.0.0.0/', f'/ip4/{ip}/')}/p2p/{net.peer_id_str}" for a in net.transport_addrs()]
    if out:
        log.info("listening on a wildcard address only: give --announce with the public address (e.g. "
                 "/dns4/relay.example.com/tcp/443/wss); on this network: %s", out[0])
    return out


async def _report(net, hop: GatedHop, dht) -> None:
    """One log line a minute."""
    while True:
        await trio.sleep(60)
        h = health(net, hop, dht)
        log.info("%d reservations, %d circuits, %d bytes relayed, refusals %s", h["reservations"], h["circuits"],
                 h["bytes_relayed"], h["refusals"] or "none")
