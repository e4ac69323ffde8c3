"""Our Kademlia client and server (:class:`SwarmDHT`, :func:`open_dht`) over py-libp2p 0.8.1's ``KadDHT``.

The library serves the Kademlia wire protocol (routing table, FIND_NODE, ADD_PROVIDER,
GET_PROVIDERS, PUT_VALUE, GET_VALUE); its private limits and ``add_peer`` are patched by
:func:`p2pswarm.net.libp2p.kad_patches.patch_kad` (the table in :mod:`p2pswarm.net.libp2p.patches`). Look-ups, provides and value puts
we do ourselves (:meth:`SwarmDHT.find_providers`, :meth:`SwarmDHT.get_values`,
:meth:`SwarmDHT.provide`, :meth:`SwarmDHT.put_value`): a few dozen lines over the same wire
protocol and the library's per-peer helpers, because the library's own versions are wrong for us.
Each trap below has a regression test in ``tests/test_net_dht.py`` that fails without its workaround:

* ``get_value`` answers from the local store when it holds a copy, forever: once a backbone has
  read a worker's node record it never sees the worker's new address. ``find_providers`` does the
  same with provider entries it has cached from earlier look-ups. Our look-ups always ask the
  network (plus our local store only for what we are authoritative for).
* ``find_providers`` returns one entry per (responding peer, provider), i.e. duplicates, and
  counts duplicates toward its ``count`` limit, so it can stop before it has seen every replica.
  Ours merges by peer id and stops on Kademlia's convergence rule, not on a count.
* A server refuses (resets) a FIND_NODE whose key is longer than 50 bytes and not a multihash, and
  ``put_value`` finds its targets with FIND_NODE of the raw key: for any namespaced key
  (``/p2pswarm/node/<peer id>`` is 67 bytes) the search dies at the first hop and the record is
  stored only at peers already in our table. Our :meth:`SwarmDHT.put_value` finds the K closest
  with GET_VALUE, which takes such keys, then stores there.
* A server acknowledges an ADD_PROVIDER whose provider has no addresses, then drops the entry, so
  a node with nothing to advertise (dial-only, or relayed before its reservation) would count its
  provides as stored while they vanish. :meth:`SwarmDHT.provide` sends what the node *advertises*
  (a relayed node's circuit addresses; py-libp2p would send its undialable listen addresses) and
  provides nothing, with a warning, while that is empty.
"""
from __future__ import annotations

import logging
import math
import random
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import cast
from collections.abc import Callable, Mapping, Sequence

import multiaddr
import trio
import varint
from libp2p.kad_dht.kad_dht import DHTMode, KadDHT
from libp2p.kad_dht.pb.kademlia_pb2 import Message
from libp2p.kad_dht.utils import sort_peer_ids_by_distance
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.records.validator import Validator
from libp2p.tools.anyio_service import background_trio_service
from libp2p.utils.varint import read_varint_prefixed_bytes_limited

from p2pswarm.errors import SwarmError, UserError, clip
from p2pswarm.net.libp2p import kad_patches as libp2p_kad_patches, patches as libp2p_patches
from p2pswarm.errors import single_error
from p2pswarm.net.libp2p.addrs import NetError, error_reason
from p2pswarm.net.libp2p.host import NetHost
# the kad protocol id is ours only because of the patch that rebinds the library's constant
from p2pswarm.net.libp2p.kad_patches import KAD_PROTOCOL
from p2pswarm.net.signed.records import (NAMESPACE, NodeRecord, NodeRecordValidator, RecordError, RecordKind,
                                  node_record_key)

log = logging.getLogger("p2pswarm.net")

K = 20  # bucket size / replication factor (py-libp2p's BUCKET_SIZE)
ALPHA = 4  # concurrent RPCs per look-up
BETA = 3  # a look-up ends when the BETA closest live peers it knows have answered
RPC_TIMEOUT_S = 5.0
LOOKUP_TIMEOUT_S = 20.0
MAX_DHT_MESSAGE = 4 << 20
IDENTIFY_WAIT_S = 5.0
RETRY_PAUSE_S = 0.25  # before retrying a failed stream: long enough for the swarm to see a closed connection
OUTBOUND_KAD_STREAMS = 64  # our own kad RPCs in flight at once, so bursts stay under everyone's limit
REPROVIDE_S = 300.0  # provider records re-sent this often (node records: every third of their TTL)


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

    def __init__(self, net: NetHost, *, server: bool, kinds: Mapping[str, RecordKind]):
        """``kinds``: the record kinds besides node records this DHT stores and reads (see
        :class:`p2pswarm.net.signed.records.NodeRecordValidator`)."""
        libp2p_patches.apply()  # our kad protocol id must be bound before a KadDHT is built
        self.net = net
        self.server = server
        self.kad = KadDHT(net.host, DHTMode.SERVER if server else DHTMode.CLIENT)
        self.validator = NodeRecordValidator(kinds)
        # (py-libp2p types it as its Validator base class; it calls only validate and select)
        self.kad.register_validator(NAMESPACE, cast(Validator, self.validator))
        self.stats = DHTStats()
        self._outbound = trio.CapacityLimiter(OUTBOUND_KAD_STREAMS)
        self._admitting: set[ID] = set()
        # rate limits raised, client-mode peers kept out of the routing table (libp2p_patches)
        self._library_add_peer = libp2p_kad_patches.patch_kad(self.kad, self._add_peer_checked)

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

    def records_held(self) -> int:
        """Values and provider records this node stores for the swarm (a soak samples it: a count
        that grows for ever is a leak; expired ones are dropped on their TTL)."""
        return len(self.kad.value_store.store) + sum(len(p) for p in self.kad.provider_store.providers.values())

    def routing_peers(self) -> list[ID]:
        return list(self.kad.routing_table.get_peer_ids())

    async def bootstrap(self, addrs: Sequence[str], *, timeout_s: float = 15.0) -> int:
        """Connect to bootstrap peers, seed the routing table and fill it with a self look-up.
        Returns how many bootstrap peers answered; UserError when none did."""
        joined, why = 0, ""
        with trio.move_on_after(timeout_s):
            for text in addrs:
                try:
                    pid = await self.net.connect(text, timeout_s=min(10.0, timeout_s))
                except (NetError, SwarmError) as exc:
                    log.warning("bootstrap %s unreachable: %s", text, exc)
                    why = why or str(exc)
                    continue
                addrs_of = self.net.host.get_peerstore().addrs(pid)
                await self.kad.routing_table.add_peer(PeerInfo(pid, addrs_of), skip_server_mode_check=True)
                joined += 1
            if joined:
                await self.refresh()
        if addrs and not joined:
            if "has another peer id" in why:  # the one mistake the user can fix from the message
                raise UserError(f"bootstrap: {why}")
            raise UserError(f"no bootstrap peer answered ({', '.join(clip(a, 200) for a in addrs)})")
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
                      *, timeout_s: float = LOOKUP_TIMEOUT_S, beta: int = BETA,
                      found: Callable[[], bool] | None = None) -> list[ID]:
        """Iterative Kademlia query of ``key``: ALPHA RPCs in flight, closer peers from each
        answer join the candidates, and the look-up ends when the BETA closest peers that have
        not failed have all answered (``beta``: the K closest for an exhaustive one). With
        ``found``: a look-up that converged while ``found()`` is still False goes on to the K
        closest. A value is stored at the K closest peers its publisher knew *then*: in a young
        or growing swarm peers that joined later can be closer and not hold it (measured: a live
        worker's record "none found" by a backbone whose three closest peers had joined after
        the worker published). Returns the peers it learnt of that did not fail, closest first
        (the K closest of them are where a value for ``key`` belongs)."""
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
                busy, widened = 0, False
                while True:
                    if widened and found is not None and found():
                        break  # the further peers had it
                    order = sort_peer_ids_by_distance(key, [p for p, s in status.items() if s != "failed"])
                    closest = order[:beta]
                    if closest and all(status[p] == "ok" for p in closest):
                        if found is None or beta >= K or found():
                            break  # converged; answers still in flight add nothing we need
                        beta, widened = K, True  # converged on nothing: ask further out (see the docstring)
                        continue
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

    async def find_providers(self, key: bytes, *, timeout_s: float = LOOKUP_TIMEOUT_S,
                             exhaustive: bool = False) -> list[PeerInfo]:
        """Every provider of ``key`` the network knows, each peer once (addresses merged).

        ``exhaustive``: ask all K closest peers, not just until the BETA closest answered, and merge
        what each holds. For a key many peers provide (the model index): each provider's
        ADD_PROVIDERs reached the K closest peers *it* found, and a store can be lost under load, so
        no single holder is sure to have every entry; ~K RPCs instead of ~BETA+ALPHA, once."""
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
        await self._lookup(key, Message.MessageType.GET_PROVIDERS, on_response, timeout_s=timeout_s,
                           beta=K if exhaustive else BETA)
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
        await self._lookup(kb, Message.MessageType.GET_VALUE, on_response, timeout_s=timeout_s,
                           found=lambda: bool(values))
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
async def open_dht(net: NetHost, *, kinds: Mapping[str, RecordKind], server: bool = True,
                   bootstrap: Sequence[str] = (), bootstrap_timeout_s: float = 15.0, refresh_s: float = 300.0):
    """Run a DHT on ``net`` (server mode: we answer kad queries and store records) and bootstrap
    from ``bootstrap`` peer addresses. Yields a :class:`SwarmDHT` storing node records and
    ``kinds``; the routing table is refreshed every ``refresh_s`` seconds. Nodes open theirs
    through :func:`p2pswarm.market.swarm_dht.open_dht`, which gives the swarm's record kinds."""
    dht = SwarmDHT(net, server=server, kinds=kinds)
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

