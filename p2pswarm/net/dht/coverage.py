"""The backbone side of the swarm DHT: who serves which (layer, expert) (:class:`CoverageResolver`,
:class:`CoverageMap`). Resolution rules: docs/protocol.md "Resolution (backbone)"."""
from __future__ import annotations

import inspect
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Iterable, Sequence

import multiaddr
import trio
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo

from p2pswarm.errors import UserError
from p2pswarm.net.dht.kademlia import SwarmDHT
from p2pswarm.net.signed.records import CoverageUnit, NodeRecord, ShardEntry, model_key

log = logging.getLogger("p2pswarm.net")

#: The :attr:`CoverageResolver.gone` reason of a provider whose node record no look-up returned
#: (one that failed on a loaded host, or a record the DHT no longer holds).
NO_RECORD = "no node record found"


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
    vouched: int = 0  # known owners kept without a live record because they answered us (vouch)
    last_refresh_s: float = 0.0
    last_bogus: str = ""


class CoverageResolver:
    """Maps every (layer, expert) a backbone needs to owners and replicas through DHT look-ups.

    Provider records say *who* serves a unit; the provider's signed node record says *what* it
    serves - all its units at once. So the resolver keeps every provider it has met with its latest
    record, and a unit's owners are the known peers whose live record covers it.

    ``refresh()`` discovers providers through the **model index** first: every worker provides
    the model key (:func:`~p2pswarm.net.signed.records.model_key`) besides its units, so one look-up of it
    lists every worker of the model, whatever its block size, and their records give the whole map.
    That is 1 + (workers) look-ups instead of one per unit: the 122B's 1,568 units from 16
    workers take 17 look-ups, not 1,568 (docs/benchmarks.md, "Coverage map at scale"). It then
    re-reads every known peer's record (a withdrawal, a restart on a new address or an expiry
    shows at once; one look-up per peer, not per unit), and looks up per unit only what the index
    left uncovered, plus a rotating ``1/rotation`` of the rest after the first refresh (a full
    sweep every ``rotation`` refreshes): the fallback for a worker whose model-key provide was lost.
    All look-ups of one pass run concurrently in one nursery, at most ``concurrency`` in flight.
    ``run()`` refreshes every ``refresh_s`` seconds and at once when :meth:`request_refresh` is
    called (a failed owner).

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
        self.on_refused: Callable[[str, str], None] | None = None  # (peer, reason): tell the worker
        self._round = 0
        #: (peer, seconds) -> whether the owner table holds a connection on which ``peer`` answered
        #: within ``seconds``. Such a peer is kept when its record expired in our view (no look-up
        #: returned a newer one): a worker reachable only through a relay gets its re-published
        #: records onto the DHT only through that relay, and under load our look-ups miss them
        #: while the worker serves us on an open connection (measured in bench/soak.py: NATed
        #: workers left the map with no fault, and took up to 126 s to be found again).
        self.vouch: Callable[[str, float], bool] | None = None
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
        if self.on_refused is not None:
            self.on_refused(peer, reason)
        if self._refusals_logged.get(peer) != reason:
            self._refusals_logged[peer] = reason
            if self.log_refusals:
                log.warning("refused worker %s: %s (its experts stay on the local replica)", peer, reason)

    def _covering(self, rec: NodeRecord, unit: CoverageUnit) -> ShardEntry | None:
        return next((s for s in rec.shards if s.model == self.model
                     and s.layers[0] <= unit.layer < s.layers[1]
                     and s.experts[0] < unit.experts.stop and unit.experts.start < s.experts[1]), None)

    def _lookup_set(self) -> list[CoverageUnit]:
        """The units to look up after the index pass: the uncovered ones, plus (after the first
        refresh) a rotating ``1/rotation`` of the rest; every unit when ``rotation`` is 1."""
        if self.rotation == 1:
            return list(self.units)
        missing = set(self.map.missing())
        if self._round == 0:
            return [u for u in self.units if u in missing]
        k = self._round % self.rotation
        return [u for i, u in enumerate(self.units) if u in missing or i % self.rotation == k]

    async def _find(self, limiter: trio.CapacityLimiter, units: Iterable[CoverageUnit], *, index: bool) -> set[str]:
        """Providers of ``units`` (and of the model key, the index, when ``index``): concurrent
        look-ups in one nursery, at most ``concurrency`` in flight."""
        providers: set[str] = set()

        async def look(unit: CoverageUnit) -> None:
            async with limiter:
                infos = await self.dht.find_providers(unit.key())
            self.stats.lookups += 1
            self.stats.providers_seen += len(infos)
            providers.update(i.peer_id.to_base58() for i in infos)

        async def look_model() -> None:
            async with limiter:
                infos = await self.dht.find_providers(model_key(self.model), exhaustive=True)
            self.stats.model_lookups += 1
            self.stats.providers_seen += len(infos)
            providers.update(i.peer_id.to_base58() for i in infos)

        async with trio.open_nursery() as nursery:
            if index:
                nursery.start_soon(look_model)
            for u in units:
                nursery.start_soon(look, u)
        return providers

    async def _read_records(self, limiter: trio.CapacityLimiter, peers: Iterable[str]) -> dict[str, NodeRecord | None]:
        records: dict[str, NodeRecord | None] = {}

        async def fetch(peer: str) -> None:
            async with limiter:
                records[peer] = await self._fetch_record(peer)

        async with trio.open_nursery() as nursery:
            for p in sorted(set(peers)):
                nursery.start_soon(fetch, p)
        return records

    def _apply_records(self, records: dict[str, NodeRecord | None]) -> None:
        """Fold freshly read records into :attr:`_known`, :attr:`refused` and :attr:`gone`."""
        now = time.time()
        for peer, rec in records.items():
            old = self._known.pop(peer, None)
            was_refused = self.refused.pop(peer, None)
            if rec is None or old is None or rec.seq != old.seq:
                log.debug("record of %s: %s (was %s)", peer[-12:], "none found" if rec is None else
                          f"seq {rec.seq}{' withdrawn' if rec.withdrawn else ''}",
                          "unknown" if old is None else f"seq {old.seq}")
            if rec is None and old is not None and old.live():
                # A look-up that failed this time is no evidence: the record still holds. This goes
                # for a suspect (an owner that just failed) too: a dead worker's record stays in the
                # DHT until it expires, so "none found" is the look-up failing (a loaded or stalled
                # host), and dropping a live worker there would cut it off until it is found again.
                # A failing owner is avoided by the dispatcher's back-off, not by forgetting it.
                self._known[peer] = old
                continue
            if old is not None and self._vouched(peer, old, rec, now):
                # Its record expired in our view, yet it answered us within one record lifetime:
                # keep it until a request or a dial fails, the newest record we have kept.
                self._known[peer] = rec if rec is not None and rec.peer == peer and rec.seq > old.seq else old
                self.stats.vouched += 1
                continue
            if rec is None and was_refused is not None and was_refused[1].live():
                self.refused[peer] = was_refused
                continue
            if rec is None or rec.peer != peer:
                if rec is not None:
                    self._bogus(f"record of {rec.peer[-12:]} offered for provider {peer[-12:]}")
                else:
                    self.gone[peer] = NO_RECORD
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

    def _vouched(self, peer: str, old: NodeRecord, rec: NodeRecord | None, now: float) -> bool:
        """Whether a known owner whose latest record is missing or expired (not withdrawn, not
        another peer's) answered us within its record's lifetime (:attr:`vouch`)."""
        stale = rec is None or (rec.peer == peer and not rec.withdrawn and not rec.live(now))
        return stale and self.vouch is not None and self.vouch(peer, max(1.0, old.expires - old.issued))

    def _rebuild(self) -> None:
        for unit in self.units:
            owners = []
            for peer, rec in self._known.items():
                shard = self._covering(rec, unit)
                if shard is not None:
                    owners.append(OwnerInfo(peer, rec.addrs, shard, rec))
            self.map.units[unit] = owners

    async def refresh(self, units: Iterable[CoverageUnit] | None = None) -> CoverageMap:
        """Rebuild the map. By default: look up the model key (the index of every worker of the
        model, any block size), re-read the records of its providers and of every peer already
        known, then look up the units still uncovered (plus a rotating part of the rest, see
        :meth:`_lookup_set`) and read the records of any provider they add. With ``units``: no
        index pass, those units are looked up instead (the per-unit resolution)."""
        async with self._refresh_lock:
            t0 = time.perf_counter()
            limiter = trio.CapacityLimiter(self.concurrency)
            self.gone = {}
            explicit = list(units) if units is not None else None
            first = await self._find(limiter, explicit or [], index=explicit is None)
            peers = first | set(self._known) | set(self.refused) | self._suspects
            records = await self._read_records(limiter, peers)
            self._suspects.difference_update(peers)
            self._apply_records(records)
            self._rebuild()
            todo = self._lookup_set() if explicit is None else []
            if todo:
                new = await self._find(limiter, todo, index=False) - set(records)
                if new:
                    more = await self._read_records(limiter, new)
                    self._apply_records(more)
                    records.update(more)
                    self._rebuild()
            self.map.resolved_at = time.time()
            self.stats.refreshes += 1
            self._round += 1
            self.stats.last_refresh_s = time.perf_counter() - t0
            log.debug("refresh %d: %d unit look-ups, %d records read, %d known owners, %.2f s", self._round,
                      len(todo) + len(explicit or []), len(records), len(self._known), self.stats.last_refresh_s)
        if self.on_change is not None:
            res = self.on_change(self.map)
            if inspect.isawaitable(res):
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
