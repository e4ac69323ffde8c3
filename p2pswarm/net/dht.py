"""The swarm's Kademlia DHT: shard advertisement (provider side) and coverage resolution (backbone side).

py-libp2p 0.8.1's ``KadDHT`` serves the Kademlia wire protocol (routing table, FIND_NODE,
ADD_PROVIDER, GET_PROVIDERS, PUT_VALUE, GET_VALUE). Look-ups, provides and value puts we do
ourselves (:meth:`SwarmDHT.find_providers`, :meth:`SwarmDHT.get_values`, :meth:`SwarmDHT.provide`,
:meth:`SwarmDHT.put_value`): a few dozen lines over the same wire protocol and the library's
per-peer helpers, because the library's own versions are wrong for us. Each
trap below has a regression test in ``tests/test_net_dht.py`` that fails without its workaround:

* The kad protocol id is hard-coded to ``/ipfs/kad/1.0.0`` (the ``protocol_prefix`` argument is
  stored and ignored), so our DHT would merge with any IPFS node we met. :func:`install_kad_protocol_id`
  rebinds the constant in every kad module to ``/p2pswarm/kad/1.0.0``.
* ``get_value`` answers from the local store when it holds a copy, forever: once a backbone has
  read a worker's node record it never sees the worker's new address. ``find_providers`` does the
  same with provider entries it has cached from earlier look-ups. Our look-ups always ask the
  network (plus our local store only for what we are authoritative for).
* ``find_providers`` returns one entry per (responding peer, provider), i.e. duplicates, and
  counts duplicates toward its ``count`` limit, so it can stop before it has seen every replica.
  Ours merges by peer id and stops on Kademlia's convergence rule, not on a count.
* A server adds every peer that opens a kad stream to it to its routing table ("they MUST support
  server mode"), so client-mode peers (phones behind NAT, ``swarm-status``) get handed out as
  DHT servers and every look-up wastes time dialling them. We check, after identify, that such a
  peer really serves the kad protocol before it enters the table, and sweep the table periodically.
* A server refuses (resets) a FIND_NODE whose key is longer than 50 bytes and not a multihash, and
  ``put_value`` finds its targets with FIND_NODE of the raw key: for any namespaced key
  (``/p2pswarm/node/<peer id>`` is 67 bytes) the search dies at the first hop and the record is
  stored only at peers already in our table. Our :meth:`SwarmDHT.put_value` finds the K closest
  with GET_VALUE, which takes such keys, then stores there.
* A server handles at most 12 inbound kad streams at once and *resets* the 13th: a backbone
  resolving a few units in parallel (4 RPCs in flight each) saw a tenth of its queries fail. Our
  servers take :data:`INBOUND_KAD_STREAMS`.
* A server accepts at most 10 ADD_PROVIDER messages per peer per 10 s and silently drops the rest
  (the stream is reset; the sender, fire-and-forget, never knows). A worker providing 40 units
  would be 3/4 invisible. Our servers allow :data:`PROVIDE_RATE_MAX` per window.
* A server acknowledges an ADD_PROVIDER whose provider has no addresses, then drops the entry, so
  a node with nothing to advertise (dial-only, or relayed before its reservation) would count its
  provides as stored while they vanish. :meth:`SwarmDHT.provide` sends what the node *advertises*
  (a relayed node's circuit addresses; py-libp2p would send its undialable listen addresses) and
  provides nothing, with a warning, while that is empty.
"""
from __future__ import annotations

import importlib
import logging
import math
import random
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Iterable, Sequence

import multiaddr
import trio
import varint
from libp2p.custom_types import TProtocol
from libp2p.kad_dht.kad_dht import DHTMode, KadDHT
from libp2p.kad_dht.pb.kademlia_pb2 import Message
from libp2p.kad_dht.utils import sort_peer_ids_by_distance
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.tools.anyio_service import background_trio_service
from libp2p.utils.varint import read_varint_prefixed_bytes_limited

from p2pswarm.errors import UserError
from p2pswarm.net.host import NetError, NetHost, error_reason, single_error
from p2pswarm.net.identity import Identity
from p2pswarm.net.records import (DEFAULT_RECORD_TTL_S, NAMESPACE, CoverageUnit, NodeRecord, NodeRecordValidator,
                                  RecordError, ShardEntry, model_key, node_record_key, units_for)

log = logging.getLogger("p2pswarm.net")

KAD_PROTOCOL = TProtocol("/p2pswarm/kad/1.0.0")
_KAD_MODULES = ("libp2p.kad_dht.common", "libp2p.kad_dht.kad_dht", "libp2p.kad_dht.peer_routing",
                "libp2p.kad_dht.provider_store", "libp2p.kad_dht.value_store")

K = 20  # bucket size / replication factor (py-libp2p's BUCKET_SIZE)
ALPHA = 4  # concurrent RPCs per look-up
BETA = 3  # a look-up ends when the BETA closest live peers it knows have answered
RPC_TIMEOUT_S = 5.0
LOOKUP_TIMEOUT_S = 20.0
MAX_DHT_MESSAGE = 4 << 20
PROVIDE_RATE_MAX = 4096  # ADD_PROVIDER messages accepted per peer per 10 s (py-libp2p: 10)
IDENTIFY_WAIT_S = 5.0
RETRY_PAUSE_S = 0.25  # before retrying a failed stream: long enough for the swarm to see a closed connection
INBOUND_KAD_STREAMS = 256  # concurrent inbound kad streams a server handles (py-libp2p: 12, then resets)
OUTBOUND_KAD_STREAMS = 64  # our own kad RPCs in flight at once, so bursts stay under everyone's limit
REPROVIDE_S = 300.0  # provider records re-sent this often (node records: every third of their TTL)


def install_kad_protocol_id(protocol: str = KAD_PROTOCOL) -> None:
    """Make every py-libp2p kad module speak ``protocol`` (process-wide, idempotent).

    Must run before a KadDHT is built: its constructor registers the handler under the constant."""
    for name in _KAD_MODULES:
        mod = importlib.import_module(name)
        if hasattr(mod, "PROTOCOL_ID"):
            mod.PROTOCOL_ID = TProtocol(protocol)


@dataclass
class DHTStats:
    lookups: int = 0
    lookup_seconds: float = 0.0
    rpcs: int = 0
    rpc_failures: int = 0
    provider_entries: int = 0  # as returned by peers, duplicates included
    duplicates_dropped: int = 0
    provides: int = 0
    records_put: int = 0
    clients_kept_out: int = 0


class SwarmDHT:
    """Our side of one node's DHT. Made by :func:`open_dht`."""

    def __init__(self, net: NetHost, *, server: bool):
        install_kad_protocol_id()
        self.net = net
        self.server = server
        self.kad = KadDHT(net.host, DHTMode.SERVER if server else DHTMode.CLIENT)
        self.validator = NodeRecordValidator()
        self.kad.register_validator(NAMESPACE, self.validator)
        self.kad._provider_rate_max = PROVIDE_RATE_MAX  # see module doc: 10 per 10 s drops our units
        self.kad._inbound_limiter = trio.CapacityLimiter(INBOUND_KAD_STREAMS)  # see module doc: 12 resets look-ups
        self.stats = DHTStats()
        self._outbound = trio.CapacityLimiter(OUTBOUND_KAD_STREAMS)
        self._admitting: set[ID] = set()
        self._library_add_peer = self.kad.add_peer
        self.kad.add_peer = self._add_peer_checked  # see module doc: keep client-mode peers out

    @property
    def peer_id(self) -> ID:
        return self.net.peer_id

    # -- routing table ----------------------------------------------------------------------
    async def _add_peer_checked(self, peer_id: ID, *, skip_server_mode_check: bool = False) -> bool:
        if not skip_server_mode_check:
            return await self._library_add_peer(peer_id)
        # An inbound kad stream: py-libp2p would add the sender unchecked. Check it in the
        # background (identify may not have run yet) and never block the stream handler.
        if peer_id not in self._admitting and not self.kad.routing_table.peer_in_table(peer_id):
            self._admitting.add(peer_id)
            self.net.nursery.start_soon(self._admit_if_server, peer_id)
        return False

    def _speaks_kad(self, peer_id: ID) -> bool | None:
        """True/False once identify has told us the peer's protocols; None before."""
        try:
            protos = self.net.host.get_peerstore().get_protocols(peer_id)
        except Exception:
            return None
        if not protos:
            return None
        return str(KAD_PROTOCOL) in [str(p) for p in protos]

    async def _admit_if_server(self, peer_id: ID) -> None:
        try:
            await self._admit_if_server_once(peer_id)
        finally:
            self._admitting.discard(peer_id)

    async def _admit_if_server_once(self, peer_id: ID) -> None:
        rt = self.kad.routing_table
        with trio.move_on_after(IDENTIFY_WAIT_S):
            while (speaks := self._speaks_kad(peer_id)) is None:
                await trio.sleep(0.05)
            if speaks:
                try:
                    await rt.add_peer(peer_id, skip_server_mode_check=True)
                except Exception as exc:
                    log.debug("routing table add %s: %s", peer_id, error_reason(exc))
                return
        self.stats.clients_kept_out += 1
        log.debug("kept %s out of the routing table: not a DHT server", peer_id.to_base58()[-12:])

    def sweep_clients(self) -> int:
        """Drop peers that identify says are not kad servers; returns how many."""
        rt = self.kad.routing_table
        dropped = 0
        for pid in list(rt.get_peer_ids()):
            if self._speaks_kad(pid) is False:
                rt.remove_peer(pid)
                dropped += 1
        self.stats.clients_kept_out += dropped
        return dropped

    def routing_peers(self) -> list[ID]:
        return list(self.kad.routing_table.get_peer_ids())

    async def bootstrap(self, addrs: Sequence[str], *, timeout_s: float = 15.0) -> int:
        """Connect to bootstrap peers, seed the routing table and fill it with a self look-up.
        Returns how many bootstrap peers answered; UserError when none did."""
        joined = 0
        with trio.move_on_after(timeout_s):
            for text in addrs:
                try:
                    pid = await self.net.connect(text, timeout_s=min(10.0, timeout_s))
                except (NetError, UserError) as exc:
                    log.warning("bootstrap %s unreachable: %s", text, exc)
                    continue
                addrs_of = self.net.host.get_peerstore().addrs(pid)
                await self.kad.routing_table.add_peer(PeerInfo(pid, addrs_of), skip_server_mode_check=True)
                joined += 1
            if joined:
                await self.refresh()
        if addrs and not joined:
            raise UserError(f"no bootstrap peer answered ({', '.join(a[:60] for a in addrs)})")
        return joined

    async def refresh(self, *, timeout_s: float = 15.0) -> None:
        """Routing-table refresh (self look-up + one random look-up per bucket), bounded."""
        with trio.move_on_after(timeout_s):
            try:
                await self.kad.peer_routing.refresh_routing_table()
            except Exception as exc:
                log.debug("routing table refresh: %s", error_reason(exc))
        self.sweep_clients()

    # -- the wire ---------------------------------------------------------------------------
    def _learn_addrs(self, peer_pb) -> ID | None:
        try:
            pid = ID(peer_pb.id)
        except Exception:
            return None
        addrs = []
        for a in peer_pb.addrs:
            try:
                addrs.append(multiaddr.Multiaddr(a))
            except Exception:
                pass
        if addrs and pid != self.peer_id:
            self.net.host.get_peerstore().add_addrs(pid, addrs, 3600)
        return pid

    async def _rpc(self, peer: ID, msg: Message) -> Message | None:
        """One request/response on a fresh kad stream; None on any failure (counted). A stream
        that cannot be opened is retried once: a connection made a moment ago is now and then
        closed under us by py-libp2p, and a second dial then succeeds."""
        retry: list[bool] = []
        resp = await self._rpc_once(peer, msg, retry)
        if resp is None and retry:
            await trio.sleep(RETRY_PAUSE_S)
            await self.net.forget_dead_connections(peer)
            resp = await self._rpc_once(peer, msg, [])
        return resp

    async def _rpc_once(self, peer: ID, msg: Message, retry: list[bool]) -> Message | None:
        async with self._outbound:
            return await self._rpc_unlimited(peer, msg, retry)

    async def _rpc_unlimited(self, peer: ID, msg: Message, retry: list[bool]) -> Message | None:
        self.stats.rpcs += 1
        stream = None
        try:
            with trio.fail_after(RPC_TIMEOUT_S):
                try:
                    stream = await self.net.host.new_stream(peer, [KAD_PROTOCOL])
                except Exception:
                    retry.append(True)  # not a timeout: worth one more try
                    raise
                data = msg.SerializeToString()
                await stream.write(varint.encode(len(data)) + data)
                raw = await read_varint_prefixed_bytes_limited(stream, MAX_DHT_MESSAGE)
            resp = Message()
            resp.ParseFromString(raw)
            return resp
        except (Exception, trio.TooSlowError) as exc:
            self.stats.rpc_failures += 1
            log.debug("kad rpc to %s failed: %s", peer.to_base58()[-12:], error_reason(exc))
            return None
        finally:
            if stream is not None:
                with trio.CancelScope(shield=True), trio.move_on_after(1):
                    try:
                        await stream.close()
                    except Exception:
                        pass

    async def _lookup(self, key: bytes, msg_type, on_response: Callable[[ID, Message], None],
                      *, timeout_s: float = LOOKUP_TIMEOUT_S) -> list[ID]:
        """Iterative Kademlia query of ``key``: ALPHA RPCs in flight, closer peers from each
        answer join the candidates, and the look-up ends when the BETA closest peers that have
        not failed have all answered. Returns the peers it learnt of that did not fail, closest
        first (the K closest of them are where a value for ``key`` belongs)."""
        t0 = time.perf_counter()
        self.stats.lookups += 1
        status: dict[ID, str] = {}  # "new" | "busy" | "ok" | "failed"
        for pid in self.kad.routing_table.find_local_closest_peers(key, K):
            if pid != self.peer_id:
                status[pid] = "new"
        if not status:
            for pid in self.net.host.get_connected_peers():
                if pid != self.peer_id and self._speaks_kad(pid) is not False:
                    status[pid] = "new"
        send, recv = trio.open_memory_channel[tuple[ID, Message | None]](math.inf)

        async def ask(pid: ID) -> None:
            m = Message()
            m.type = msg_type
            m.key = key
            await send.send((pid, await self._rpc(pid, m)))

        with trio.move_on_after(timeout_s):
            async with trio.open_nursery() as nursery:
                busy = 0
                while True:
                    order = sort_peer_ids_by_distance(key, [p for p, s in status.items() if s != "failed"])
                    closest = order[:BETA]
                    if closest and all(status[p] == "ok" for p in closest):
                        break  # converged; answers still in flight add nothing we need
                    for pid in [p for p in order[:K] if status[p] == "new"][: max(0, ALPHA - busy)]:
                        status[pid] = "busy"
                        busy += 1
                        nursery.start_soon(ask, pid)
                    if busy == 0:
                        break  # nothing left to ask
                    pid, resp = await recv.receive()
                    busy -= 1
                    if resp is None or resp.type != msg_type:
                        status[pid] = "failed"
                        continue
                    status[pid] = "ok"
                    for p in resp.closerPeers:
                        cp = self._learn_addrs(p)
                        if cp is not None and cp != self.peer_id and cp not in status:
                            status[cp] = "new"
                    on_response(pid, resp)
                nursery.cancel_scope.cancel()
        self.stats.lookup_seconds += time.perf_counter() - t0
        return sort_peer_ids_by_distance(key, [p for p, st in status.items() if st != "failed"])

    # -- providers --------------------------------------------------------------------------
    async def provide(self, key: bytes, *, timeout_s: float = LOOKUP_TIMEOUT_S) -> int:
        """Announce that we provide ``key`` to the K closest peers; returns how many took it.

        Our look-up plus py-libp2p's ADD_PROVIDER sender: 2.5x faster than the library's
        ``provide`` (whose FIND_NODE walk queries 10 peers per round to full convergence)."""
        self.stats.provides += 1
        # What we advertise (a relayed node: its circuit addresses), never py-libp2p's own listen
        # addresses: behind a NAT those are not dialable. And never nothing: a py-libp2p server
        # acknowledges an ADD_PROVIDER without addresses, then drops it, so the provide would
        # "succeed" and vanish.
        addrs = [multiaddr.Multiaddr(a) for a in self.net.addrs()]
        if not addrs:
            log.warning("not providing %s: this node has no address to advertise yet", key.hex()[:16])
            return 0
        store = self.kad.provider_store
        store.add_provider(key, PeerInfo(self.peer_id, addrs))
        targets = (await self._lookup(key, Message.MessageType.GET_PROVIDERS, lambda pid, resp: None,
                                      timeout_s=timeout_s))[:K]
        sent = 0
        msg = Message()
        msg.type = Message.MessageType.ADD_PROVIDER
        msg.key = key
        me = msg.providerPeers.add()
        me.id = self.peer_id.to_bytes()
        me.addrs.extend(a.to_bytes() for a in addrs)

        async def one(pid: ID) -> None:
            nonlocal sent
            # py-libp2p's sender is fire-and-forget (Kubo never answers); our servers echo the
            # request once stored, so we wait for it: a store dropped under load is retried and
            # the count is true.
            resp = await self._rpc(pid, msg)
            if resp is not None and resp.type == Message.MessageType.ADD_PROVIDER:
                sent += 1

        async with trio.open_nursery() as nursery:
            for pid in targets:
                nursery.start_soon(one, pid)
        return sent

    def stop_providing(self, key: bytes) -> None:
        """Stop the library's 22 h republish of ``key`` and drop our own local entry."""
        store = self.kad.provider_store
        store.providing_keys.discard(key)
        entries = store.providers.get(key)
        if entries is not None:
            entries.pop(str(self.peer_id), None)
            if not entries:
                store.providers.pop(key, None)

    async def find_providers(self, key: bytes, *, timeout_s: float = LOOKUP_TIMEOUT_S) -> list[PeerInfo]:
        """Every provider of ``key`` the network knows, each peer once (addresses merged)."""
        found: dict[ID, list[multiaddr.Multiaddr]] = {}

        def add(pid: ID, addrs) -> None:
            self.stats.provider_entries += 1
            if pid in found:
                self.stats.duplicates_dropped += 1
            have = found.setdefault(pid, [])
            for a in addrs:
                if a not in have:
                    have.append(a)

        def on_response(_peer: ID, resp: Message) -> None:
            for p in resp.providerPeers:
                try:
                    pid = ID(p.id)
                except Exception:
                    continue
                addrs = []
                for a in p.addrs:
                    try:
                        addrs.append(multiaddr.Multiaddr(a))
                    except Exception:
                        pass
                add(pid, addrs)

        # What we store as one of the K closest is as good as any other server's copy.
        if self.server:
            for info in self.kad.provider_store.get_providers(key):
                add(info.peer_id, info.addrs)
        await self._lookup(key, Message.MessageType.GET_PROVIDERS, on_response, timeout_s=timeout_s)
        return [PeerInfo(pid, addrs) for pid, addrs in found.items()]

    # -- values -----------------------------------------------------------------------------
    async def put_value(self, key: str, value: bytes, *, timeout_s: float = LOOKUP_TIMEOUT_S) -> int:
        """Validate ``value``, keep it as ours, and store it at the K closest peers we can find.
        Returns how many peers acknowledged it."""
        self.validator_for(key).validate(key, value)
        kb = key.encode()
        self.kad.value_store.put(kb, value)  # signed by our host key, republished by the library
        self.stats.records_put += 1
        targets = (await self._lookup(kb, Message.MessageType.GET_VALUE, lambda pid, resp: None,
                                      timeout_s=timeout_s))[:K]
        stored = 0

        async def store(pid: ID) -> None:
            nonlocal stored
            for _ in range(3):  # see _rpc: a fresh connection is sometimes closed under us
                with trio.move_on_after(RPC_TIMEOUT_S):
                    if await self.kad.value_store._store_at_peer(pid, kb, value):
                        stored += 1
                        return
                await trio.sleep(RETRY_PAUSE_S)
                await self.net.forget_dead_connections(pid)
            log.debug("storing %s at %s failed", key[:40], pid.to_base58()[-12:])

        async with trio.open_nursery() as nursery:
            for pid in targets:
                nursery.start_soon(store, pid)
        log.debug("stored %s at %d of %d peers", key[:40], stored, len(targets))
        return stored

    def validator_for(self, key: str):
        if not key.startswith(f"/{NAMESPACE}/"):
            raise UserError(f"not a {NAMESPACE} DHT key: {key[:40]!r}")
        return self.validator

    async def get_values(self, key: str, *, timeout_s: float = LOOKUP_TIMEOUT_S) -> list[bytes]:
        """Every distinct value peers hold for ``key`` (never a cached copy of someone else's);
        the caller validates and picks."""
        values: list[bytes] = []
        kb = key.encode()

        def on_response(_peer: ID, resp: Message) -> None:
            if resp.HasField("record") and resp.record.value and resp.record.value not in values:
                values.append(bytes(resp.record.value))

        local = self.kad.value_store.get(kb)
        if local is not None and kb in self.kad.value_store.local_keys:
            values.append(bytes(local.value))  # our own record: authoritative
        await self._lookup(kb, Message.MessageType.GET_VALUE, on_response, timeout_s=timeout_s)
        return values

    async def get_node_record(self, peer: ID | str, *, on_bogus: Callable[[str], None] | None = None) -> NodeRecord | None:
        """The newest valid node record of ``peer``, or None. Invalid copies are reported to
        ``on_bogus`` (with the reason) and ignored."""
        peer_s = peer.to_base58() if isinstance(peer, ID) else peer
        best: NodeRecord | None = None
        for v in await self.get_values(node_record_key(peer_s)):
            try:
                rec = NodeRecord.verify(v, peer=peer_s, allow_expired=True)
            except RecordError as exc:
                if on_bogus is not None:
                    on_bogus(str(exc))
                continue
            if best is None or rec.seq > best.seq:
                best = rec
        return best


@asynccontextmanager
async def open_dht(net: NetHost, *, server: bool = True, bootstrap: Sequence[str] = (),
                   bootstrap_timeout_s: float = 15.0, refresh_s: float = 300.0):
    """Run a DHT on ``net`` (server mode: we answer kad queries and store records) and bootstrap
    from ``bootstrap`` peer addresses. Yields a :class:`SwarmDHT`; the routing table is refreshed
    every ``refresh_s`` seconds."""
    dht = SwarmDHT(net, server=server)
    try:
        async with background_trio_service(dht.kad):
            async with trio.open_nursery() as nursery:
                if bootstrap:
                    await dht.bootstrap(bootstrap, timeout_s=bootstrap_timeout_s)

                async def upkeep() -> None:
                    while True:
                        await trio.sleep(refresh_s * random.uniform(0.9, 1.1))
                        await dht.refresh()

                nursery.start_soon(upkeep)
                try:
                    yield dht
                finally:
                    nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        leaf = single_error(group)
        if leaf is group:
            raise
        raise leaf from None


# ------------------------------------------------------------------------------------------------
# Provider side
# ------------------------------------------------------------------------------------------------
class ShardAdvertiser:
    """Publishes this node's signed record and provides every coverage unit of its shards (and its
    model's :func:`~p2pswarm.net.records.model_key`); re-publishes the record every ``refresh_s``
    (a third of its TTL) and the provider records every ``reprovide_s``; withdraws on clean shutdown.

    Two cadences because they do different jobs. The record is the liveness signal: short-lived
    (default 60 s) so a killed worker drops out of every look-up within one TTL, and cheap to
    refresh (one look-up and 20 stores, whatever the shard's size). Provider records only say "ask
    this peer's record" and py-libp2p keeps them 48 h, so they are re-sent rarely (default 5 min;
    a phone with 400 units would otherwise send 8,000 ADD_PROVIDERs every 20 s). Re-providing also
    re-announces the units to whichever peers are closest *now*, so DHT nodes that joined since the
    last round learn about us."""

    def __init__(self, dht: SwarmDHT, identity: Identity, *, shards: Sequence[ShardEntry], protocol: int,
                 kernel: str, block_size: int, ttl_s: float = DEFAULT_RECORD_TTL_S, refresh_s: float | None = None,
                 reprovide_s: float | None = None, concurrency: int = 8):
        if ttl_s < 3:
            raise UserError("record TTL must be at least 3 s")
        self.dht = dht
        self.identity = identity
        self.shards = tuple(shards)
        self.protocol = protocol
        self.kernel = kernel
        self.block_size = block_size
        self.ttl_s = ttl_s
        self.refresh_s = refresh_s or ttl_s / 3
        if self.refresh_s >= ttl_s:
            raise UserError("record refresh interval must be shorter than the record TTL")
        self.reprovide_s = reprovide_s or max(self.refresh_s, REPROVIDE_S)
        self.concurrency = concurrency
        self.units = sorted({u for s in shards for u in units_for(s.model, s.layers, s.experts, block_size)})
        self.model_keys = sorted({model_key(s.model) for s in shards})
        self.record: NodeRecord | None = None
        self.rounds = 0  # records published
        self.provide_rounds = 0  # rounds of provider records sent
        self._provided_at = -math.inf

    async def set_shards(self, shards: Sequence[ShardEntry]) -> int:
        """Serve ``shards`` from now on (``node --auto`` re-enrolling): units no longer held are no
        longer provided, and a new record (higher seq) plus provider records of the new units go
        out at once. Returns how many units reached the DHT."""
        self.shards = tuple(shards)
        units = sorted({u for s in self.shards for u in units_for(s.model, s.layers, s.experts, self.block_size)})
        for u in set(self.units) - set(units):
            self.dht.stop_providing(u.key())
        self.units = units
        self.model_keys = sorted({model_key(s.model) for s in self.shards})
        return await self.publish()

    def _record(self, withdrawn: bool = False) -> NodeRecord:
        addrs = self.dht.net.addrs()
        if not addrs and not withdrawn:
            raise UserError("nothing to advertise: listening on a wildcard address only; give an announce address")
        seq = None
        if self.record is not None:
            seq = max(int(time.time() * 1000), self.record.seq + 1)
        return NodeRecord.make(self.identity, addrs=addrs, protocol=self.protocol, kernel=self.kernel,
                               block_size=self.block_size, shards=self.shards, ttl_s=self.ttl_s,
                               withdrawn=withdrawn, seq=seq)

    async def publish_record(self) -> bool:
        """Put a fresh record (new expiry) at the closest peers; False when no peer took it."""
        self.record = self._record()
        self.rounds += 1
        try:
            return await self.dht.put_value(node_record_key(self.identity.peer_id_str), self.record.signed) > 0
        except (Exception, trio.TooSlowError) as exc:
            log.warning("publishing our node record failed: %s", error_reason(exc))
            return False

    async def publish(self) -> int:
        """Put our record, then provide every unit and the model key. Returns how many units
        reached a peer."""
        await self.publish_record()
        ok = 0
        limiter = trio.CapacityLimiter(self.concurrency)

        async def one(key: bytes, unit: bool) -> None:
            nonlocal ok
            async with limiter:
                if await self.dht.provide(key) and unit:
                    ok += 1

        async with trio.open_nursery() as nursery:
            for u in self.units:
                nursery.start_soon(one, u.key(), True)
            for k in self.model_keys:
                nursery.start_soon(one, k, False)
        self.provide_rounds += 1
        self._provided_at = time.monotonic()
        return ok

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Publish now (``task_status.started(units provided)``), then the record every
        ``refresh_s`` and the provider records every ``reprovide_s``."""
        ok = await self.publish()
        log.info("providing %d units (%d reached the DHT) for %s; record refreshed every %.0f s (TTL %.0f s)",
                 len(self.units), ok, "; ".join(f"layers {s.layers[0]}-{s.layers[1] - 1} experts "
                                                f"{s.experts[0]}-{s.experts[1] - 1}" for s in self.shards),
                 self.refresh_s, self.ttl_s)
        task_status.started(ok)
        while True:
            await trio.sleep(self.refresh_s * random.uniform(0.9, 1.0))
            try:
                if time.monotonic() - self._provided_at >= self.reprovide_s * 0.95:
                    ok = await self.publish()
                    if ok < len(self.units):
                        log.warning("re-provide: only %d of %d units reached the DHT", ok, len(self.units))
                elif not await self.publish_record():
                    log.warning("record refresh reached no DHT peer; retrying in %.0f s", self.refresh_s)
            except (UserError, RecordError) as exc:  # e.g. our listeners are gone: try again later
                log.warning("re-provide failed: %s", exc)

    async def withdraw(self, *, timeout_s: float = 10.0) -> bool:
        """Publish a withdrawn record (shielded, bounded: callable from a cancelled scope)."""
        for key in [u.key() for u in self.units] + self.model_keys:
            self.dht.stop_providing(key)
        with trio.CancelScope(shield=True), trio.move_on_after(timeout_s):
            try:
                self.record = self._record(withdrawn=True)
                await self.dht.put_value(node_record_key(self.identity.peer_id_str), self.record.signed)
                log.info("withdrew %d units from the DHT", len(self.units))
                return True
            except (Exception, trio.TooSlowError) as exc:
                log.warning("withdrawing our record failed: %s", error_reason(exc))
        return False


# ------------------------------------------------------------------------------------------------
# Backbone side
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class OwnerInfo:
    """A peer that serves (part of) a unit, as its verified record says."""

    peer: str
    addrs: tuple[str, ...]
    shard: ShardEntry
    record: NodeRecord

    @property
    def fingerprint(self):
        return self.record.fingerprint(self.shard)

    def holds(self, layer: int, expert: int) -> bool:
        return self.shard.holds(layer, expert)

    def peer_info(self) -> PeerInfo:
        return PeerInfo(ID.from_base58(self.peer), [multiaddr.Multiaddr(a) for a in self.addrs])


@dataclass
class CoverageMap:
    """Owners of every unit a backbone needs, from one resolution."""

    units: dict[CoverageUnit, list[OwnerInfo]] = field(default_factory=dict)
    resolved_at: float = 0.0
    n_expert: int | None = None  # the model's experts per layer: the last block may be partial

    def owners_of(self, layer: int, expert: int, block_size: int, model: str) -> list[OwnerInfo]:
        unit = CoverageUnit(model, layer, expert // block_size, block_size)
        return [o for o in self.units.get(unit, []) if o.holds(layer, expert)]

    def unit_replicas(self, unit: CoverageUnit, alive: Callable[[OwnerInfo], bool] | None = None) -> int:
        """How many times ``unit`` is covered: the replica count of its least-covered expert (the
        distinct peers holding it; only owners ``alive`` accepts, when given). Two workers holding
        experts 0-5 and 6-10 both touch the unit of experts 0-7, yet cover it once, not twice."""
        owners = [o for o in self.units.get(unit, []) if alive is None or alive(o)]
        stop = unit.experts.stop if self.n_expert is None else min(unit.experts.stop, self.n_expert)
        experts = range(unit.experts.start, stop)
        if not owners or not experts:
            return 0
        return min(len({o.peer for o in owners if o.holds(unit.layer, e)}) for e in experts)

    def missing(self) -> list[CoverageUnit]:
        """Units with at least one expert nobody serves (the local replica computes it)."""
        return [u for u in self.units if self.unit_replicas(u) == 0]

    def peers(self) -> dict[str, OwnerInfo]:
        """One OwnerInfo per (peer, shard) in the map."""
        out: dict[str, OwnerInfo] = {}
        for owners in self.units.values():
            for o in owners:
                out.setdefault(f"{o.peer}/{o.shard.shard}", o)
        return out

    def replicas(self, alive: Callable[[OwnerInfo], bool] | None = None) -> dict[CoverageUnit, int]:
        """:meth:`unit_replicas` of every unit."""
        return {u: self.unit_replicas(u, alive) for u in self.units}


@dataclass
class ResolverStats:
    refreshes: int = 0
    lookups: int = 0
    providers_seen: int = 0
    records_fetched: int = 0
    bogus_records: int = 0  # forged, malformed, expired beyond use, or not matching the provider
    mismatched: int = 0  # valid but another protocol/kernel/block size/model: not usable by us
    model_lookups: int = 0  # look-ups of the model key (finds workers of any block size)
    withdrawn: int = 0
    last_refresh_s: float = 0.0
    last_bogus: str = ""


class CoverageResolver:
    """Maps every (layer, expert) a backbone needs to owners and replicas through DHT look-ups.

    Provider records say *who* serves a unit; the provider's signed node record says *what* it
    serves - all its units at once. So the resolver keeps every provider it has met with its latest
    record, and a unit's owners are the known peers whose live record covers it.

    ``refresh()`` re-reads every known peer's record (a withdrawal, a restart on a new address or
    an expiry shows at once; one look-up per peer, not per unit) and looks units up to discover new
    providers: all of them the first time, later the units nobody covers plus a rotating
    ``1/rotation`` of the rest (a full sweep every ``rotation`` refreshes, with the model key, which
    finds workers of any block size). ``run()`` refreshes every ``refresh_s`` seconds and at once
    when :meth:`request_refresh` is called (a failed owner).

    A peer with a live record we cannot use (another protocol, kernel, block size or model) is
    kept in :attr:`refused` with the reason and logged once per peer and reason - a backbone that
    silently ignored it would show only "0 of N units have owners". Refused peers are re-read every
    refresh like owners, so one restarted with the right build is used at once. :attr:`gone` lists
    the last refresh's providers that serve nothing now (withdrawn, expired, no record)."""

    def __init__(self, dht: SwarmDHT, *, model: str, layers: Sequence[int] | range, n_expert: int, block_size: int,
                 protocol: int, kernel: str, refresh_s: float = 30.0, concurrency: int = 16, rotation: int = 4):
        if rotation < 1:
            raise UserError("resolver rotation must be >= 1")
        self.dht = dht
        self.model = model
        self.layers = list(layers)
        self.n_expert = n_expert
        self.block_size = block_size
        self.protocol = protocol
        self.kernel = kernel
        self.refresh_s = refresh_s
        self.concurrency = concurrency
        self.rotation = rotation
        self.units = [CoverageUnit(model, layer, b, block_size)
                      for layer in self.layers for b in range(math.ceil(n_expert / block_size))]
        self.map = CoverageMap({u: [] for u in self.units}, n_expert=n_expert)
        self.stats = ResolverStats()
        self._wake = trio.Event()
        self._suspects: set[str] = set()
        self._refresh_lock = trio.Lock()
        self._known: dict[str, NodeRecord] = {}  # every provider met, with its latest verified record
        # Peers with a live record we cannot use, and why; re-read every refresh, like known ones.
        self.refused: dict[str, tuple[str, NodeRecord]] = {}
        # Providers of the last refresh that serve nothing now: "withdrawn", "record expired ...".
        self.gone: dict[str, str] = {}
        self.log_refusals = True  # swarm-status shows them in its table instead
        self._refusals_logged: dict[str, str] = {}
        self._round = 0
        self.on_change: Callable[[CoverageMap], Awaitable[None] | None] | None = None

    def owners(self, layer: int, expert: int) -> list[OwnerInfo]:
        return self.map.owners_of(layer, expert, self.block_size, self.model)

    def request_refresh(self, peer: str | None = None) -> None:
        """Refresh now (from any task); ``peer`` failed and its record is re-read first."""
        if peer:
            self._suspects.add(peer)
        self._wake.set()

    def _bogus(self, reason: str) -> None:
        self.stats.bogus_records += 1
        self.stats.last_bogus = reason
        log.warning("ignored a DHT record: %s", reason)

    async def _fetch_record(self, peer: str) -> NodeRecord | None:
        self.stats.records_fetched += 1
        return await self.dht.get_node_record(peer, on_bogus=self._bogus)

    def _refuse(self, peer: str, rec: NodeRecord, reason: str) -> None:
        """Note a worker we cannot use; log it once per peer and reason, not every refresh."""
        self.stats.mismatched += 1
        self.refused[peer] = (reason, rec)
        if self._refusals_logged.get(peer) != reason:
            self._refusals_logged[peer] = reason
            if self.log_refusals:
                log.warning("refused worker %s: %s (its experts stay on the local replica)", peer, reason)

    def _covering(self, rec: NodeRecord, unit: CoverageUnit) -> ShardEntry | None:
        return next((s for s in rec.shards if s.model == self.model
                     and s.layers[0] <= unit.layer < s.layers[1]
                     and s.experts[0] < unit.experts.stop and unit.experts.start < s.experts[1]), None)

    def _lookup_set(self, units: Iterable[CoverageUnit] | None) -> list[CoverageUnit]:
        if units is not None:
            return list(units)
        if self._round == 0 or self.rotation == 1:
            return list(self.units)
        k = self._round % self.rotation
        missing = set(self.map.missing())
        return [u for i, u in enumerate(self.units) if u in missing or i % self.rotation == k]

    async def refresh(self, units: Iterable[CoverageUnit] | None = None) -> CoverageMap:
        """Re-read known peers' records, look up ``units`` (default: see the class doc) for new
        providers, and rebuild the owner lists of every unit."""
        async with self._refresh_lock:
            t0 = time.perf_counter()
            todo = self._lookup_set(units)
            providers: set[str] = set()
            limiter = trio.CapacityLimiter(self.concurrency)

            async def look(unit: CoverageUnit) -> None:
                async with limiter:
                    infos = await self.dht.find_providers(unit.key())
                self.stats.lookups += 1
                self.stats.providers_seen += len(infos)
                providers.update(i.peer_id.to_base58() for i in infos)

            async def look_model() -> None:
                async with limiter:
                    infos = await self.dht.find_providers(model_key(self.model))
                self.stats.model_lookups += 1
                providers.update(i.peer_id.to_base58() for i in infos)

            async with trio.open_nursery() as nursery:
                for u in todo:
                    nursery.start_soon(look, u)
                # Workers of another block size provide none of our unit keys, only the model key:
                # looked up with every full sweep of the units, so they are seen (and refused).
                if units is None and self._round % self.rotation == 0:
                    nursery.start_soon(look_model)

            records: dict[str, NodeRecord | None] = {}
            peers = sorted(providers | set(self._known) | set(self.refused) | self._suspects)

            async def fetch(peer: str) -> None:
                async with limiter:
                    records[peer] = await self._fetch_record(peer)

            async with trio.open_nursery() as nursery:
                for p in peers:
                    nursery.start_soon(fetch, p)
            suspects = self._suspects & set(peers)
            self._suspects.difference_update(peers)

            self.gone = {}
            now = time.time()
            for peer, rec in records.items():
                old = self._known.pop(peer, None)
                was_refused = self.refused.pop(peer, None)
                if rec is None or old is None or rec.seq != old.seq:
                    log.debug("record of %s: %s (was %s)", peer[-12:], "none found" if rec is None else
                              f"seq {rec.seq}{' withdrawn' if rec.withdrawn else ''}",
                              "unknown" if old is None else f"seq {old.seq}")
                if rec is None and old is not None and old.live() and peer not in suspects:
                    self._known[peer] = old  # a look-up that failed this time; the record still holds
                    continue
                if rec is None and was_refused is not None and was_refused[1].live():
                    self.refused[peer] = was_refused
                    continue
                if rec is None or rec.peer != peer:
                    if rec is not None:
                        self._bogus(f"record of {rec.peer[-12:]} offered for provider {peer[-12:]}")
                    else:
                        self.gone[peer] = "no node record found"
                    continue
                if rec.withdrawn:
                    if old is None or not old.withdrawn:
                        self.stats.withdrawn += 1
                    self.gone[peer] = "withdrawn (left cleanly)"
                    continue
                if not rec.live(now):
                    self.gone[peer] = f"record expired {int(now - rec.expires)} s ago"
                    continue
                reason = rec.unusable_reason(model=self.model, protocol=self.protocol, kernel=self.kernel,
                                             block_size=self.block_size)
                if reason:
                    self._refuse(peer, rec, reason)
                    continue
                self._refusals_logged.pop(peer, None)
                self._known[peer] = rec
            for unit in self.units:
                owners = []
                for peer, rec in self._known.items():
                    shard = self._covering(rec, unit)
                    if shard is not None:
                        owners.append(OwnerInfo(peer, rec.addrs, shard, rec))
                self.map.units[unit] = owners
            self.map.resolved_at = time.time()
            self.stats.refreshes += 1
            self._round += 1
            self.stats.last_refresh_s = time.perf_counter() - t0
            log.debug("refresh %d: %d unit look-ups, %d records read, %d known owners, %.2f s", self._round,
                      len(todo), len(records), len(self._known), self.stats.last_refresh_s)
        if self.on_change is not None:
            res = self.on_change(self.map)
            if hasattr(res, "__await__"):
                await res
        return self.map

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Resolve now (``task_status.started(map)``), then every ``refresh_s`` or on request."""
        await self.refresh()
        covered = sum(1 for owners in self.map.units.values() if owners)
        log.info("coverage: %d of %d units have owners (%d peers)", covered, len(self.units),
                 len({o.peer for o in self.map.peers().values()}))
        task_status.started(self.map)
        while True:
            with trio.move_on_after(self.refresh_s):
                await self._wake.wait()
            self._wake = trio.Event()
            await self.refresh()
