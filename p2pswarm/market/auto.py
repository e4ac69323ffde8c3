"""`node --role worker --auto`: a worker that decides for itself which units to hold.

Every ``period_s`` (jittered +-25 %, so workers started together drift apart) the worker

1. reads every backbone's demand record through the DHT (:func:`p2pswarm.market.demand.find_demand`)
   and sums their per-unit demand for its model (``--model``, or the model most backbones serve);
2. reads coverage exactly as a backbone does (:class:`p2pswarm.net.dht.coverage.CoverageResolver`): a
   unit's live replicas are the distinct peers whose signed, unexpired node record covers every
   expert of it - a killed worker drops out when its record expires (``--ttl``, 60 s by default);
3. calls :func:`p2pswarm.market.enrol.choose_units` with its ``--memory`` budget and the units it
   holds (the same function ``bench/market_sim.py`` drives);
4. downloads each new unit as its own slice (:func:`p2pswarm.net.shards.transfer.fetch_slice_from_swarm`:
   only that unit's bytes, verified against the manifest of a ``--trust-issuer``), loads it, serves
   it, and publishes a new node record listing every held unit as a shard (several, not
   necessarily contiguous). A dropped unit leaves the record at once but is served one more period
   (backbones still holding the old record get answers, not refusals), then unloaded and deleted.

The backbone needs nothing new: it finds the units in the DHT like any worker's, and picks among
replicas by load and measured round trip (:class:`p2pswarm.backbone.owners.libp2p_owner.SwarmOwners`).
"""
from __future__ import annotations

import logging
import math
import random
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import trio

from p2pswarm.errors import SwarmError, UserError
from p2pswarm.market.demand import DemandRecord, find_demand
from p2pswarm.market.enrol import DEFAULT_HYSTERESIS, Enrolment, choose_units
from p2pswarm.market.reward import backbone_demand
from p2pswarm.net.signed.records import MAX_SHARDS, CoverageUnit, ShardEntry

if TYPE_CHECKING:  # both import py-libp2p (~0.8 s): loaded when a worker enrols, not with this module
    from p2pswarm.net.shards.server import ShardFiles
    from p2pswarm.net.dht.advertiser import ShardAdvertiser
    from p2pswarm.net.dht.coverage import CoverageResolver

log = logging.getLogger("p2pswarm.market")

DEMAND_RETRY_S = 2.0
RETRY_S = 5.0  # after a failed download
NO_SOURCE_REPEAT_S = 60.0  # how often a worker waiting for a shard source says so again


def aggregate(records: list[DemandRecord], model: str | None) -> tuple[DemandRecord, np.ndarray]:
    """The geometry (newest record) and summed demand of ``model`` (None: the model most
    backbones publish for), a unit's demand by a backbone that lacks it weighted
    (:func:`~p2pswarm.market.reward.backbone_demand`). Records whose geometry disagrees with the
    newest are ignored."""
    if model is not None:
        records = [r for r in records if r.model == model]
    if not records:
        raise LookupError("no demand record")
    if model is None:
        model = Counter(r.model for r in records).most_common(1)[0][0]
        records = [r for r in records if r.model == model]
    ref = max(records, key=lambda r: r.issued)
    same = [r for r in records if (r.layers, r.n_expert, r.block_size, r.unit_bytes)
            == (ref.layers, ref.n_expert, ref.block_size, ref.unit_bytes)]
    # a backbone's demand for a unit it lacks locally (its expert cache's flags) counts more (reward.py)
    return ref, backbone_demand([r.demand for r in same], [r.lacks for r in same])


def lazy_resolver(dht, **kw):
    """A :class:`~p2pswarm.net.dht.coverage.CoverageResolver` that re-reads a known peer's node record only
    once the copy it holds has expired (or the peer is suspect), not at every refresh.

    Why: a backbone re-reads every record each refresh to see withdrawals and new addresses at
    once; an enrolling worker needs only counts, and a killed worker's record stays valid until it
    expires whichever way it is read - so liveness is the same (one TTL), while the DHT load of a
    crowd of workers each re-reading every other worker's record every period is not (30 workers on
    two cores saturated them). A clean withdrawal shows within one TTL instead of at once."""
    from p2pswarm.net.dht.coverage import CoverageResolver

    class LazyResolver(CoverageResolver):
        async def _fetch_record(self, peer: str):
            rec = self._known.get(peer)
            if rec is not None and rec.live(time.time() + 1.0) and peer not in self._suspects:
                return rec
            return await super()._fetch_record(peer)

    return LazyResolver(dht, **kw)


class AutoWorker:
    """The enrolment loop of one worker. ``shards`` is the dict the expert handler serves from
    (:func:`p2pswarm.worker.server.serve_libp2p_shards`)."""

    def __init__(self, net, dht, identity, *, memory: int, token: str, trusted_issuers, load_shard, kernel: str,
                 protocol: int, home: Path, model: str | None = None, ttl_s: float = 60.0, period_s: float = 60.0,
                 hysteresis: float = DEFAULT_HYSTERESIS, seed: int | None = None,
                 shard_files: ShardFiles | None = None):
        self.net, self.dht, self.identity = net, dht, identity
        self.memory, self.token, self.trusted = memory, token, list(trusted_issuers)
        self.load_shard = load_shard  # path -> (ExpertWorker, ShardInfo, ShardEntry), run in a thread
        self.kernel, self.protocol, self.home, self.model = kernel, protocol, home, model
        self.ttl_s, self.period_s, self.hysteresis = ttl_s, period_s, hysteresis
        self.rng = np.random.default_rng(seed)
        self.shards: dict = {}  # shard hash -> ExpertWorker: what the expert handler serves
        self.held: dict[int, tuple[ShardEntry, Path]] = {}  # unit index -> (entry, file)
        self.retiring: list[tuple[str, Path]] = []  # dropped last period: unloaded at the next
        self.geometry: DemandRecord | None = None
        self.resolver: CoverageResolver | None = None  # both made once the geometry is known
        self.advertiser: ShardAdvertiser | None = None
        self.evaluations = 0
        self.last: Enrolment | None = None
        self.failed = 0
        self.no_source_said = -math.inf  # monotonic time "no shard source" was last logged
        self.crowd = 1
        self.backbones: set[str] = set()  # peers whose demand records we have read
        self.sources: list[DemandRecord] = []  # their latest records (shard sources among them)
        #: where the held slices' slabs are served onwards (a backbone's expert cache fetches from
        #: any worker whose shard holds a unit); None: not served
        self.shard_files = shard_files

    # -- inputs -----------------------------------------------------------------------------------
    async def _demand(self) -> tuple[DemandRecord, np.ndarray]:
        """Geometry and summed demand from the backbones' live records; when only expired ones are
        found (a backbone's re-publication has not reached the peers we asked), their geometry
        and last demand still serve: demand is advisory."""
        waited = 0.0
        while True:
            found = await find_demand(self.dht, allow_expired=True, known=self.backbones)
            live = [r for r in found if r.live()]
            self.sources = [r for r in found if r.model == (self.model or r.model)]
            try:
                return aggregate(live or found, self.model)
            except LookupError:
                pass
            if waited % 30 < DEMAND_RETRY_S:
                log.info("no demand record%s in the DHT yet (no backbone?); waiting",
                         f" for model {self.model[:12]}" if self.model else "")
            await trio.sleep(DEMAND_RETRY_S)
            waited += DEMAND_RETRY_S

    def _setup(self, geo: DemandRecord) -> None:
        self.geometry = geo
        self.model = geo.model
        n_units = len(geo.layers) * geo.n_blocks
        self.units = [CoverageUnit(geo.model, layer, b, geo.block_size) for layer in geo.layers
                      for b in range(geo.n_blocks)]
        self.sizes = np.array([geo.unit_size(u.layer, u.block) for u in self.units], dtype=np.float64)
        smallest = int(self.sizes.min())
        if self.memory < smallest:
            raise UserError(f"--memory {self.memory / 1e6:.1f} MB holds no unit of model {geo.model[:12]} "
                            f"(the smallest is {smallest / 1e6:.1f} MB)")
        resolver = lazy_resolver(self.dht, model=geo.model, layers=geo.layers, n_expert=geo.n_expert,
                                 block_size=geo.block_size, protocol=self.protocol, kernel=self.kernel)
        resolver.log_refusals = False
        self.resolver = resolver
        log.info("market: model %s, %d units of %.1f MB in %d layers; memory %.1f MB", geo.model[:12], n_units,
                 self.sizes.max() / 1e6, len(geo.layers), self.memory / 1e6)

    def _geo(self) -> DemandRecord:
        """The model's geometry: known from the first evaluation on, before anything reads it."""
        assert self.geometry is not None and self.model is not None, "no demand record read yet"
        return self.geometry

    async def replicas(self) -> np.ndarray:
        """Live replicas per unit: other peers' from the DHT, plus one where we hold the unit."""
        assert self.resolver is not None, "no demand record read yet"
        cmap = await self.resolver.refresh()
        me = self.identity.peer_id_str
        # workers deciding on this same map: every live provider we know, and us
        self.crowd = len({o.peer for o in cmap.peers().values()} | {me})
        out = np.array([cmap.unit_replicas(u, alive=lambda o: o.peer != me) for u in self.units], dtype=np.float64)
        out[list(self.held)] += 1
        return out

    # -- one evaluation ---------------------------------------------------------------------------
    async def evaluate(self) -> Enrolment:
        geo, found = await self._demand()
        demand: np.ndarray | None = found
        if self.geometry is None:
            self._setup(geo)
        elif (geo.layers, geo.n_expert, geo.block_size) != (self.geometry.layers, self.geometry.n_expert,
                                                            self.geometry.block_size):
            log.warning("the model's published geometry changed; keeping the first one seen")
            demand = None
        if demand is None or len(demand) != len(self.units):
            demand = np.ones(len(self.units))
        replicas = await self.replicas()
        budget = min(self.memory, int(self.sizes.max()) * MAX_SHARDS)  # a record lists at most MAX_SHARDS shards
        choice = choose_units(demand=demand, replicas=replicas, sizes=self.sizes, budget=budget,
                              held=list(self.held), rng=self.rng, hysteresis=self.hysteresis, crowd=self.crowd)
        self.evaluations += 1
        self.last = choice
        self.failed = await self._apply(choice)
        return choice

    def _path(self, unit: CoverageUnit) -> Path:
        e = unit.experts
        geo = self._geo()
        stop = min(e.stop, geo.n_expert)
        # per peer: several workers may share a home (and must not download into one file)
        return (self.home / "shards" / "auto" / self.identity.peer_id_str[-16:]
                / f"{geo.model[:16]}-L{unit.layer}-E{e.start}-{stop - 1}.gguf")

    async def _download(self, index: int) -> tuple[ShardEntry, Path, object]:
        from p2pswarm.net.shards.transfer import fetch_slice_from_swarm

        unit = self.units[index]
        out = self._path(unit)
        out.parent.mkdir(parents=True, exist_ok=True)
        geo = self._geo()
        experts = (unit.experts.start, min(unit.experts.stop, geo.n_expert))
        # The backbones whose demand records say they serve shards, beside the DHT's source look-up
        # (a source key provided long ago can sit at peers a look-up no longer reaches).
        extra = [s for s in (r.shard_source() for r in self.sources) if s is not None]
        shard = await fetch_slice_from_swarm(self.net, self.dht, model=geo.model, layers=(unit.layer, unit.layer + 1),
                                             experts=experts, out_path=out, token=self.token,
                                             trusted_issuers=self.trusted, extra_sources=extra,
                                             find_timeout_s=5.0 if extra else 20.0, keep_source=True)
        worker, _info, entry = await trio.to_thread.run_sync(self.load_shard, shard)
        self._serve_slabs(shard, geo.model)
        return entry, shard, worker

    def _serve_slabs(self, shard: Path, model: str) -> None:
        """Serve a downloaded slice's slabs onwards (its ``.source`` sidecar: the manifest, checked
        again here, and the source header), like a worker that downloaded its one slice does."""
        if self.shard_files is None:
            return
        from p2pswarm.net.shards.server import load_source_sidecar

        try:
            manifest, header = load_source_sidecar(shard)
            manifest.verify(trusted_issuers=self.trusted, fingerprint=model)
            self.shard_files.add(shard, manifest, header)
        except UserError as exc:
            log.warning("not serving the slabs of %s to peers: %s", shard.name, exc)
            return
        log.info("serving my shard's expert slabs (%s) to holders of tokens issued by %s", shard.name,
                 ", ".join(self.trusted))

    async def _apply(self, choice: Enrolment) -> int:
        """Download, load and serve the added units, retire the dropped ones, publish the new
        record. Returns how many added units could not be fetched (retried soon)."""
        # Last period's dropped units: no record has listed them for a whole period now.
        for shard_hash, path in self.retiring:
            self.shards.pop(shard_hash, None)
            if self.shard_files is not None:
                self.shard_files.remove(path)
            path.unlink(missing_ok=True)
            path.with_name(path.name + ".source").unlink(missing_ok=True)
        self.retiring = []
        if not choice.added and not choice.dropped:
            return 0
        loaded: dict[int, tuple[ShardEntry, Path, object]] = {}
        limiter = trio.CapacityLimiter(2)

        no_source: list[str] = []

        async def get(i: int) -> None:
            async with limiter:
                try:
                    loaded[i] = await self._download(i)
                except SwarmError as exc:
                    if str(exc).startswith("no shard source"):
                        no_source.append(str(exc))
                    else:
                        log.warning("could not fetch %s: %s", self.units[i], exc)

        async with trio.open_nursery() as nursery:
            for i in choice.added:
                nursery.start_soon(get, i)
        if no_source and time.monotonic() - self.no_source_said >= NO_SOURCE_REPEAT_S:
            # one line that says what to start, not one per unit per retry
            self.no_source_said = time.monotonic()
            log.warning("cannot download any unit (retrying every few seconds): %s", no_source[0])
        for i in choice.dropped:
            entry, path = self.held.pop(i)
            self.retiring.append((entry.shard, path))
        for i, (entry, path, worker) in loaded.items():
            self.held[i] = (entry, path)
            self.shards[entry.shard] = worker
        assert self.advertiser is not None, "run() makes the advertiser before the first evaluation"
        await self.advertiser.set_shards([entry for entry, _ in self.held.values()])
        if not loaded and not choice.dropped:
            return len(choice.added)  # nothing changed (every download failed): no "enrolled" line per retry
        log.info("enrolled in %d units (%.1f MB of %.1f MB): %s%s%s", len(self.held),
                 sum(self.sizes[i] for i in self.held) / 1e6, self.memory / 1e6, self.describe(),
                 f"; added {len(loaded)}" if loaded else "", f"; dropped {len(choice.dropped)}" if choice.dropped else "")
        return len(choice.added) - len(loaded)

    def describe(self) -> str:
        return ", ".join(f"L{self.units[i].layer}:E{self.units[i].experts.start}-"
                         f"{min(self.units[i].experts.stop, self._geo().n_expert) - 1}" for i in sorted(self.held))

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Enrol now (``task_status.started()`` once serving at least one unit), then re-evaluate
        every period; the node record is re-published every third of its TTL meanwhile."""
        from p2pswarm.net.dht.advertiser import ShardAdvertiser

        geo, _ = await self._demand()
        self._setup(geo)
        self.advertiser = ShardAdvertiser(self.dht, self.identity, shards=[], protocol=self.protocol,
                                          kernel=self.kernel, block_size=geo.block_size, ttl_s=self.ttl_s)
        started = False
        async with trio.open_nursery() as nursery:
            while True:
                await self.evaluate()
                if self.held and not started:  # READY only once something is served
                    started = True
                    task_status.started()
                    nursery.start_soon(self._keep_record)
                pause = self.period_s * random.uniform(0.75, 1.25)
                if self.failed:  # a download failed: try again soon, not a whole period later
                    pause = min(pause, RETRY_S * random.uniform(0.5, 1.5))
                await trio.sleep(pause)

    async def _keep_record(self) -> None:
        """What :meth:`ShardAdvertiser.run` does after its first publication: the record every
        third of its TTL (the liveness signal), the provider records every ``reprovide_s``."""
        adv = self.advertiser
        assert adv is not None, "run() makes the advertiser before it starts this task"
        while True:
            await trio.sleep(adv.refresh_s * random.uniform(0.9, 1.0))
            try:
                if time.monotonic() - adv._provided_at >= adv.reprovide_s * 0.95:
                    await adv.publish()
                else:
                    await adv.publish_record()
            except (SwarmError, trio.TooSlowError) as exc:
                log.warning("record refresh failed: %s", exc)

    async def withdraw(self) -> None:
        if self.advertiser is not None:
            await self.advertiser.withdraw()


def parse_size(text: str) -> int:
    """``340MB``, ``1.5GB``, ``512MiB``, ``1000000`` -> bytes (MB = 10^6, MiB = 2^20)."""
    import re

    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgG]i?[bB]|[bB])?\s*", text or "")
    if not m:
        raise UserError(f"bad size {text!r}: expected e.g. 340MB, 1.5GB or 512MiB")
    n, unit = float(m.group(1)), (m.group(2) or "b").lower()
    mult = {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}[unit]
    value = int(n * mult)
    if value <= 0 or not math.isfinite(n * mult):
        raise UserError(f"bad size {text!r}: must be positive")
    return value
