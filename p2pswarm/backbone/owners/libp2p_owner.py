"""Expert workers reached over libp2p: ``/p2pswarm/expert/1.0.0`` streams, found through the DHT.

:class:`Libp2pOwner` is :class:`~p2pswarm.backbone.owners.socket_owner.SocketOwner` with a libp2p stream
instead of a TCP socket: the same framed msgpack messages, the same handshake, one persistent
stream (re)opened lazily, requests serialised on it and matched by id, a timeout on every request,
and every failure - undialable peer, refused handshake, reset stream, timeout, error reply,
malformed reply - raised as :class:`WorkerError`, so the dispatcher recomputes on the local
replica and the output stays exact.

The handshake checks more than over a local socket: the worker must answer with the shard hash
its signed DHT record announced (and we send it, so the worker refuses a backbone that expects
another shard), as well as our protocol version, model fingerprint and kernel.

:class:`SwarmOwners` keeps one owner per (peer, shard) in step with a
:class:`~p2pswarm.net.dht.coverage.CoverageResolver`'s map, and keeps the list it hands the dispatcher
sorted by load and measured round-trip time, so the dispatcher - which takes the first healthy
owner holding an expert - picks the least busy, nearest replica.

A worker refused at the handshake (either side) is logged once, with the reason, and holds nothing
until its signed record says something new: not one fallback and one warning per decode step.
:meth:`Libp2pOwner.probe` is the same dial and handshake plus an echo, for `swarm-status`.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

import trio

from p2pswarm.backbone.owners.socket_owner import SocketOwner, close_now, reply_families, reply_input_forms
from p2pswarm.contracts import OwnerStatus
from p2pswarm.engine import kernels
from p2pswarm.errors import FrameError, SwarmError, WorkerError, clip
from p2pswarm.net.wire import expert_protocol as proto
from p2pswarm.net.libp2p.addrs import is_circuit_addr
from p2pswarm.net.wire.direct import CHACHA, local_aeads, open_direct
from p2pswarm.net.wire.framing import DEFAULT_MAX_FRAME, FrameReader, send_frame
from p2pswarm.net.wire.expert_protocol import PROTOCOL_EXPERT
from p2pswarm.net.libp2p.host import NetHost
from p2pswarm.net.wire.counting import CountingStream

log = logging.getLogger("p2pswarm.backbone")

RTT_EWMA = 0.3  # weight of the newest sample in the round-trip estimate
DIRECT_TIMEOUT_S = 3.0  # to connect and say hello on a worker's direct lane, else stay on libp2p
KEEPALIVE_S = 30.0  # echo on expert streams idle this long (CDN WebSocket proxies cut idle ones at ~100 s)


class Libp2pOwner(SocketOwner):
    """One remote worker's shard, as its verified DHT record describes it (an ``OwnerInfo``)."""

    def __init__(self, net: NetHost, info, *, model_fingerprint: str, kernel: str, timeout_s: float = 30.0,
                 connect_timeout_s: float = 10.0, max_frame: int = DEFAULT_MAX_FRAME, on_failure=None,
                 name: str | None = None, family: str | None = None, direct: bool = True):
        super().__init__(name or f"{info.peer[-10:]}/{info.shard.shard[:6]}", "", 0,
                         model_fingerprint=model_fingerprint, kernel=kernel, layers=info.shard.layers,
                         experts=info.shard.experts, timeout_s=timeout_s, max_frame=max_frame, family=family)
        self.net = net
        self.info = info
        self.connect_timeout_s = connect_timeout_s
        self.on_failure = on_failure
        #: (owner, seconds) after each answered request: the metrics histogram
        self.on_latency: Callable[[Libp2pOwner, float], None] | None = None
        self.rtt_s: float | None = None  # EWMA of request round trips (compute included; connecting not)
        self.inflight = 0
        self.requests = 0
        self.failures = 0
        self._order_changed: Callable[[], None] | None = None  # set by SwarmOwners
        self._stale = False  # addresses changed: redial before the next request
        self.last_used = time.monotonic()
        #: monotonic time of the last answered request or keep-alive echo (None: none yet); with an
        #: open stream it vouches that the worker is alive (SwarmOwners.answered_within)
        self.last_ok: float | None = None
        self.refused: str | None = None  # why the handshake failed; cleared by a record saying something new
        #: called (owner, reason) on a refused handshake; default: log a warning
        self.on_refused: Callable[[Libp2pOwner, str], None] | None = None
        #: take the worker's direct lane when it offers one (p2pswarm/net/wire/direct.py); why the last
        #: try failed (not tried again until its record changes)
        self.direct = direct
        self.direct_failed: str | None = None
        self.lane: str | None = None  # "libp2p" or "direct" once connected
        self.relayed = False  # the libp2p lane goes through a circuit relay (NetHost.via_relay)

    def holds(self, layer: int, expert: int) -> bool:
        return self.refused is None and super().holds(layer, expert)

    @property
    def peer(self) -> str:
        return self.info.peer

    @property
    def shard(self) -> str:
        return self.info.shard.shard

    def status(self) -> OwnerStatus:
        return OwnerStatus(
            peer=self.peer, addrs=list(self.info.addrs or ()), rtt_s=self.rtt_s, refused=self.refused,
            relayed=self.relayed and self.lane != "direct", lane=self.lane, load=self.inflight,
            requests=self.requests, failures=self.failures, wire=self.wire_status(),
            kernel=self.info.record.kernel or self.kernel)

    def update(self, info) -> None:
        """A newer record of the same (peer, shard): new addresses or ranges take effect at once;
        a changed address drops the stream so the next request redials."""
        old = self.info
        self.info = info
        self.layers, self.experts = info.shard.layers, info.shard.experts
        if not info.record.same_content(old.record):
            self.refused = None  # a restart with a new build or shard: try the handshake again
            self.direct_failed = None
        if tuple(info.addrs) != tuple(old.addrs):
            self._stale = True
            self.direct_failed = None
            self.rtt_s = None  # a new instance: measure it afresh (unmeasured owners sort first)

    async def _connect(self) -> None:
        try:
            opened = await self.net.open_stream(self.info.peer_info(), PROTOCOL_EXPERT,
                                                timeout_s=self.connect_timeout_s)
        except SwarmError as exc:  # NetError, bad address
            raise WorkerError(f"{self.name} unreachable: {exc}") from None
        stream = CountingStream(opened, self.wire)
        reader = FrameReader(stream, self.max_frame, rate=self.link)
        hello = dict(self.hello(), shard=self.shard)
        if self.direct and self.direct_failed is None:
            hello["direct"] = True
            hello["direct_aeads"] = local_aeads()  # best first (direct.py: AES-256-GCM where the CPU has AES)
        try:
            await send_frame(stream, proto.pack(hello), self.max_frame)
            payload = await reader.read_frame()
            if payload is None:
                raise WorkerError(f"{self.name} closed the stream during the handshake")
            reply = proto.unpack(payload)
            if reply.get("op") == "error" or not reply.get("ok"):
                self._refused(f"the worker refused our handshake: {reply.get('error', 'no reason given')}")
                raise WorkerError(f"{self.name} refused the handshake: {reply.get('error', 'no reason given')}")
            reason = self._check_reply(reply)
            if reason:
                self._refused(reason)
                raise WorkerError(f"{self.name} refused by us at the handshake: {reason}")
            self.families = reply_families(reply)
            self.input_forms = reply_input_forms(reply)
            self.output_coding = proto.reply_output_coding(reply)
        except BaseException:
            await close_now(stream)
            raise
        offer = reply.get("direct")
        if self.direct and self.direct_failed is None and offer is None and isinstance(reply.get("direct_error"), str):
            self.direct_failed = clip(reply["direct_error"], 200)
            log.info("no direct lane to worker %s (%s): its requests stay on libp2p", self.name, self.direct_failed)
        if self.direct and self.direct_failed is None and offer is not None:
            try:
                again = {k: v for k, v in hello.items() if k != "direct_aeads"}
                sealed = await self._open_direct(offer, dict(again, direct=False), hello["direct_aeads"])
            except BaseException:  # cancelled (the request's deadline): no direct lane from this worker
                self.direct_failed = "cut short"
                await close_now(stream)
                raise
            if sealed is not None:
                await close_now(stream)  # the direct connection replaces the stream
                sealed.rate = self.link  # its sealed records show the link's pace (link_rate)
                self.link.begin(False)  # (nothing of a dropped connection's last record carries over)
                self._stream, self._reader = sealed, FrameReader(sealed, self.max_frame)
                self.lane = "direct"
                return
        self._stream, self._reader = stream, reader
        self.lane = "libp2p"
        self.relayed = self.net.via_relay(self.info.peer_info().peer_id)

    async def _open_direct(self, offer, hello: dict, aeads: list[str]):
        """The worker's direct lane (p2pswarm/net/wire/direct.py) from its hello's offer, handshaken, or
        None (logged once: unreachable, refused, malformed, an AEAD not in ``aeads``, the ones our
        hello listed): the libp2p stream stays then."""
        try:
            if not (isinstance(offer, dict) and isinstance(offer.get("ticket"), bytes)
                    and isinstance(offer.get("key"), bytes) and len(offer["key"]) == 32
                    and isinstance(offer.get("port"), int) and 0 < offer["port"] < 65536
                    and isinstance(offer.get("host", ""), str)):
                raise WorkerError("a malformed direct-lane offer")
            aead = offer.get("aead", CHACHA)  # an older worker names none: ChaCha20-Poly1305
            if aead not in aeads:
                raise WorkerError(f"the worker chose AEAD {clip(str(aead), 40)!r}, which we did not offer "
                                  f"({', '.join(aeads)})")
            host = offer.get("host") or self._dialled_host()
            if host is None:
                raise WorkerError("no IP address of it to dial (relayed)")
            wait = min(DIRECT_TIMEOUT_S, self.connect_timeout_s)
            sealed = CountingStream(await open_direct(host, offer["port"], offer["ticket"], offer["key"],
                                                      max_frame=self.max_frame, timeout_s=wait, aead=aead),
                                    self.wire)
            try:
                with trio.fail_after(wait):
                    await send_frame(sealed, proto.pack(hello), self.max_frame)
                    payload = await FrameReader(sealed, self.max_frame).read_frame()
                reply = proto.unpack(payload) if payload is not None else {}
                if not reply.get("ok"):
                    raise WorkerError(f"its hello on the direct lane: {reply.get('error', 'closed')}")
            except BaseException:
                await close_now(sealed)
                raise
            sealed.peer_name = self.peer  # (logs name the worker's peer id, as on its libp2p stream)
            log.info("direct lane to worker %s at %s:%d (%s)", self.name, host, offer["port"], aead)
            return sealed
        except (WorkerError, FrameError, OSError, trio.TooSlowError, trio.BrokenResourceError,
                trio.ClosedResourceError) as exc:
            self.direct_failed = f"{exc or type(exc).__name__}"
            log.info("no direct lane to worker %s (%s): its requests stay on libp2p", self.name, self.direct_failed)
            return None

    def _dialled_host(self) -> str | None:
        """The IP (or DNS name) of the worker's first non-relayed TCP address in its record."""
        for addr in self.info.addrs:
            if is_circuit_addr(addr):
                continue
            parts = str(addr).split("/")
            for proto_name in ("ip4", "ip6", "dns", "dns4", "dns6"):
                if proto_name in parts and "tcp" in parts:
                    return parts[parts.index(proto_name) + 1]
        return None

    def _refused(self, reason: str) -> None:
        self.refused = reason
        if self.on_refused is not None:
            self.on_refused(self, reason)
        else:
            log.warning("refused worker %s at the handshake: %s", self.peer, reason)

    def _check_reply(self, reply: dict) -> str | None:
        """Why the worker's hello is not what its signed record promised, or None."""
        if reply.get("protocol") != proto.PROTOCOL_VERSION:
            return f"protocol version mismatch: worker {reply.get('protocol')!r}, ours {proto.PROTOCOL_VERSION}"
        if reply.get("model") != self.model_fingerprint:
            return (f"model mismatch: worker serves model {str(reply.get('model'))[:12]}, "
                    f"we run {self.model_fingerprint[:12]}")
        if self.family is not None:
            if self.family not in reply_families(reply):
                return f"kernel family mismatch: worker answers in {list(reply_families(reply))}, we asked for {self.family!r}"
        elif not kernels.compatible(reply.get("kernel"), self.kernel):
            return f"kernel mismatch: worker computes with {reply.get('kernel')!r}, we with {self.kernel!r}"
        if reply.get("shard") != self.shard:
            return f"shard mismatch: worker serves {str(reply.get('shard'))[:12]}, its record says {self.shard[:12]}"
        layers, experts = reply.get("layers"), reply.get("experts")
        if not (isinstance(layers, list) and isinstance(experts, list) and len(layers) == 2 and len(experts) == 2
                and layers[0] <= self.layers[0] and self.layers[1] <= layers[1]
                and experts[0] <= self.experts[0] and self.experts[1] <= experts[1]):
            return f"worker holds layers {layers} experts {experts}, less than its record says"
        return None

    async def request(self, msg_bytes: bytes, rid: int, rows: int = 0) -> dict:
        if self._stale and self.inflight == 0:
            self._stale = False
            await self._drop()
        self.inflight += 1
        self.requests += 1
        self.last_used = time.monotonic()
        self._reorder()
        t0 = time.perf_counter()
        gen = self._gen
        try:
            reply = await super().request(msg_bytes, rid, rows)
        except WorkerError:
            self.failures += 1
            if self.on_failure is not None:
                self.on_failure(self)
            raise
        finally:
            self.inflight -= 1
        dt = time.perf_counter() - t0
        self.last_ok = time.monotonic()
        if self._gen == gen:  # not a request that (re)connected: a dial and handshake are no round trip
            # (the hot-expert path compares rtt_s with local compute: one dial in it kept a fast
            # owner local until it decayed, and an owner kept local gets no requests to decay it)
            self.rtt_s = dt if self.rtt_s is None else (1 - RTT_EWMA) * self.rtt_s + RTT_EWMA * dt
        if self.on_latency is not None:
            self.on_latency(self, dt)
        self._reorder()
        return reply

    async def ping(self) -> bool:
        """An echo on the open stream, outside the request statistics; a failure only drops the
        stream (the next request redials) - it is no evidence against the worker."""
        rid = next(self._ids)
        try:
            with trio.move_on_after(10):
                await SocketOwner.request(self, proto.pack({"op": "echo", "id": rid, "payload": b""}), rid)
                self.last_used = self.last_ok = time.monotonic()
                return True
        except WorkerError as exc:
            log.debug("keep-alive to %s failed: %s", self.name, exc)
        await self._drop()
        return False

    async def probe(self) -> tuple[str, str, float | None]:
        """Dial, handshake and one echo, as a backbone would: ``("live", "", rtt_s)``,
        ``("refused", reason, None)`` or ``("unreachable", reason, None)``. Bounded by the
        owner's timeouts; the stream is closed afterwards."""
        t0 = time.perf_counter()
        try:
            await self.echo(b"")
            return "live", "", time.perf_counter() - t0
        except WorkerError as exc:
            if self.refused is not None:
                return "refused", self.refused, None
            return "unreachable", str(exc).removeprefix(f"{self.name} ").removeprefix("unreachable: "), None
        finally:
            await self._drop()

    def _reorder(self) -> None:
        if self._order_changed is not None:
            self._order_changed()

    def sort_key(self) -> tuple:
        """Least loaded first, then nearest; never-measured owners before slow ones (to measure them)."""
        return (self.inflight, self.rtt_s if self.rtt_s is not None else 0.0)


class SwarmOwners:
    """The backbone's remote owners, kept in step with a resolver's coverage map.

    ``owners`` is a list the dispatcher holds (:meth:`attach`): it is updated and re-sorted in place
    (least loaded, then lowest round trip first) after every request, never replaced.
    A failing owner asks the resolver for an immediate refresh, so a worker that died is dropped
    and a restarted or replacement one is found without waiting for the periodic refresh."""

    def __init__(self, net: NetHost, *, model_fingerprint: str, kernel: str, timeout_s: float = 30.0,
                 connect_timeout_s: float = 10.0, max_frame: int = DEFAULT_MAX_FRAME, resolver=None,
                 direct: bool = True):
        self.net = net
        self.direct = direct  # take workers' direct lanes (Libp2pOwner.direct)
        self.model_fingerprint = model_fingerprint
        self.kernel = kernel
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.max_frame = max_frame
        self.resolver = resolver
        self.on_latency = None  # handed to every owner (Libp2pOwner.on_latency)
        self.owners: list[Libp2pOwner] = []
        self._by_key: dict[tuple[str, str], Libp2pOwner] = {}
        self.dispatcher = None
        self._refusals_logged: dict[str, str] = {}  # peer -> the reason last logged
        self.on_refused = None  # (peer, reason): tell the worker (p2pswarm/backbone/sessions/refusal_notice.py)

    def _refused(self, owner: Libp2pOwner, reason: str) -> None:
        """Once per peer and reason: the refusal, and that the worker is not used until it changes."""
        if self.on_refused is not None:
            self.on_refused(owner.peer, reason)
        if self._refusals_logged.get(owner.peer) != reason:
            self._refusals_logged[owner.peer] = reason
            log.warning("refused worker %s at the handshake: %s (not used until its record changes; its "
                        "experts stay on the local replica)", owner.peer, reason)

    def attach(self, dispatcher) -> None:
        """Make ``dispatcher`` use our live, re-sorted list (its constructor copies the list)."""
        dispatcher.owners = self.owners
        self.dispatcher = dispatcher
        for owner in self.owners:
            dispatcher.adopt(owner)

    def answered_within(self, peer: str, seconds: float) -> bool:
        """Whether ``peer`` answered a request or a keep-alive echo within the last ``seconds`` on a
        connection still open (a failed request drops it). The resolver keeps such a worker even
        when no look-up returns a live record of it (:attr:`CoverageResolver.vouch`)."""
        now = time.monotonic()
        return any(o.peer == peer and o._stream is not None and o.last_ok is not None
                   and now - o.last_ok <= seconds for o in self.owners)

    def _failed(self, owner: Libp2pOwner) -> None:
        if self.resolver is not None:
            self.resolver.request_refresh(owner.peer)

    def _latency(self, owner: Libp2pOwner, seconds: float) -> None:
        if self.on_latency is not None:
            self.on_latency(owner, seconds)

    def resort(self) -> None:
        self.owners.sort(key=Libp2pOwner.sort_key)

    async def sync(self, cmap) -> None:
        """Match the owners to a coverage map (``CoverageResolver.on_change`` calls this)."""
        wanted = {(o.peer, o.shard.shard): o for o in cmap.peers().values()}
        for key, info in wanted.items():
            owner = self._by_key.get(key)
            if owner is None:
                owner = Libp2pOwner(self.net, info, model_fingerprint=self.model_fingerprint, kernel=self.kernel,
                                    timeout_s=self.timeout_s, connect_timeout_s=self.connect_timeout_s,
                                    max_frame=self.max_frame, on_failure=self._failed, direct=self.direct)
                owner._order_changed = self.resort
                owner.on_refused = self._refused
                owner.on_latency = self._latency
                if self.dispatcher is not None:
                    self.dispatcher.adopt(owner)
                self._by_key[key] = owner
                self.owners.append(owner)
                log.info("found worker %s: layers %d-%d experts %d-%d", owner.name, info.shard.layers[0],
                         info.shard.layers[1] - 1, info.shard.experts[0], info.shard.experts[1] - 1)
            elif info.record.seq != owner.info.record.seq:
                moved = tuple(info.addrs) != tuple(owner.info.addrs)
                changed = not info.record.same_content(owner.info.record)
                owner.update(info)
                # A newer record that says something new (an address, a shard, a build) is the
                # worker saying it is back: end its back-off. A plain periodic re-publication (every
                # third of the TTL) is not: a worker failing while alive keeps its back-off.
                cleared = ((moved or changed) and self.dispatcher is not None
                           and self.dispatcher.clear_backoff(owner.name))
                if moved or cleared:
                    log.info("worker %s is back (new record%s): using it%s", owner.name,
                             ", new address" if moved else "", " again, back-off ended" if cleared else "")
        for key in [k for k in self._by_key if k not in wanted]:
            owner = self._by_key.pop(key)
            self.owners.remove(owner)
            log.info("worker %s left the coverage map", owner.name)
            await owner.aclose()
        self.resort()

    async def ping_idle(self, idle_s: float) -> int:
        """Echo on every open stream idle for ``idle_s`` or more; returns how many answered."""
        now = time.monotonic()
        idle = [o for o in self.owners if o._stream is not None and o.inflight == 0 and now - o.last_used >= idle_s]
        ok = 0
        for owner in idle:
            ok += await owner.ping()
        return ok

    async def send_receipt(self, peer: str, data: bytes, timeout_s: float = 5.0) -> bool:
        """Hand a signed contribution receipt to worker ``peer`` on one of its expert streams
        (the ``receipt`` op); True once the worker says it stored it. A failure is no evidence
        against the worker (it stays usable); the receipt is sent again next period."""
        owner = next((o for o in self.owners if o.peer == peer and o.refused is None), None)
        if owner is None or (self.dispatcher is not None and not self.dispatcher.healthy(owner)):
            # gone, refused or in back-off (hung, failing): not worth a wait; next period
            return False
        rid = next(owner._ids)
        try:
            with trio.move_on_after(timeout_s):
                reply = await SocketOwner.request(owner, proto.pack({"op": "receipt", "id": rid, "receipt": data}), rid)
                return reply.get("op") == "receipt" and reply.get("ok") is True
        except WorkerError as exc:
            log.info("worker %s did not take its receipt: %s", owner.name, exc)
        return False

    async def keepalive(self, idle_s: float = KEEPALIVE_S) -> None:
        """CDNs and NATs cut idle connections (a CDN's WebSocket proxy after ~100 s): a relayed
        circuit to a worker would die between two users' requests and the next one would pay a
        fallback and a redial. An echo on each stream idle for ``idle_s`` keeps them warm."""
        while True:
            await trio.sleep(idle_s / 2)
            await self.ping_idle(idle_s)

    async def aclose(self) -> None:
        for owner in list(self.owners):
            await owner.aclose()
