"""Filling the backbone's expert cache from the swarm: slabs by byte range, checked against the manifest.

Why: a backbone started from the backbone file holds no routed experts. What it caches, and any
unit whose every replica is gone, comes from a peer that holds the bytes (a ``serve-shards``
seeder, a backbone serving ``--manifest``, or a worker serving its own downloaded shard - any
worker the backbone knows whose shard holds the unit, banned or backed off included: the bytes
are checked, not the peer) over ``/p2pswarm/shard/1.0.0`` - the protocol workers
download their slices with, so the same token gate and the same signed manifest apply: a
unit's slabs are asked for by (tensor, expert, byte range), and each slab's sha256 must be the one
the manifest lists before it is written into the store and the unit marked cached. A slab that
fails is never cached or computed: the source is reported (log and ``bad_slabs``) and the next
source is asked. :meth:`CacheFiller.fetch` is the dispatcher's ``fetch`` (units no live owner
holds, bounded by ``Dispatcher.fetch_bound_s``); :meth:`CacheFiller.refill` moves the cache to
the hottest units by measured demand (:meth:`ExpertCache.plan`), every ``refill_s``.
"""
from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Collection

import trio

from p2pswarm.backbone.owners.expert_cache import ExpertCache
from p2pswarm.errors import SwarmError, clip
from p2pswarm.model.manifest import ManifestError, ModelManifest
from p2pswarm.net.shards.fetch import _open_session, _Session, _source_name
from p2pswarm.net.shards.transfer import find_sources
from p2pswarm.net.shards.wire import SHARD_PROTOCOL_VERSION, ShardTransferError

log = logging.getLogger("p2pswarm.backbone")

#: re-look-up the model's sources in the DHT at most this often (a fetch with none known looks at once)
SOURCES_REFRESH_S = 30.0


class CacheFiller:
    """Puts units into ``cache`` (whose ``store`` the bank maps) from the model's shard sources."""

    def __init__(self, cache: ExpertCache, net, dht, *, model: str, token: str,
                 trusted_issuers: Collection[str], source_header: bytes, extra_sources=(),
                 demand=None, refill_s: float = 30.0, holders=None):
        if cache.store is None:
            raise ValueError("a CacheFiller fills an expert store (a backbone started from the backbone file)")
        self.cache = cache
        self.store = cache.store
        self.net, self.dht = net, dht
        self.model = model.lower()
        self.token = token
        self.trusted = list(trusted_issuers)
        self.source_header = source_header
        self.extra_sources = list(extra_sources)
        self.demand = demand  # the dispatcher's DemandCounter (refill)
        self.refill_s = refill_s
        #: ``holders(layer)``: the workers known to hold experts of ``layer``, as
        #: ``(source, (e0, e1))`` (a PeerInfo and its shard's half-open expert range); asked after
        #: the model's full sources. None: full sources only.
        self.holders = holders
        self.manifest: ModelManifest | None = None
        self.fetched_from: dict[str, int] = {}  # source peer id -> units fetched from it
        self._no_shard: dict[str, float] = {}  # worker peer id -> when it did not serve shards
        self._sources: list = []
        self._looked_up = -1e9
        self._lock = trio.Lock()  # one fill at a time: units are written once

    async def _find(self, layer: int) -> list[tuple[object, tuple[int, int] | None]]:
        """(source, expert range it holds or None for every expert): the model's full sources
        first, then the workers holding experts of ``layer`` (not those that lately did not serve
        the shard protocol, e.g. a worker started from a local shard file)."""
        full = [(s, None) for s in await self._full_sources()]
        workers = []
        now = time.monotonic()
        for src, rng in (self.holders(layer) if self.holders is not None else ()):
            if now - self._no_shard.get(_source_name(src), -1e9) > SOURCES_REFRESH_S:
                workers.append((src, rng))
        return full + workers

    async def _full_sources(self) -> list:
        now = time.monotonic()
        if self.dht is not None and (not self._sources or now - self._looked_up > SOURCES_REFRESH_S):
            self._looked_up = now
            try:
                self._sources = await find_sources(self.dht, self.model, timeout_s=10.0)
            except (SwarmError, trio.TooSlowError, OSError) as exc:
                log.warning("expert cache: looking up the model's shard sources failed: %s", exc)
        return [*self.extra_sources, *self._sources]

    async def _session(self, source, layer: int, experts: list[int]) -> _Session:
        hello = {"op": "hello", "v": SHARD_PROTOCOL_VERSION, "model": self.model, "layers": [layer, layer + 1],
                 "experts": [min(experts), max(experts) + 1], "token": self.token}
        sess = await _open_session(self.net, source, hello)
        if self.manifest is None:
            try:
                m = ModelManifest.decode((await sess.call({"op": "manifest"}))["manifest"])
                m.verify(trusted_issuers=self.trusted, fingerprint=self.model)
                if hashlib.sha256(self.source_header).hexdigest() != m.header_sha256:
                    raise ManifestError("the manifest's header is not the one this backbone file was cut from")
                self.manifest = m
            except BaseException:
                await sess.stream.aclose()
                raise
        return sess

    async def _unit(self, sess: _Session, layer: int, expert: int) -> dict[str, bytes] | None:
        """One unit's slabs from one source, each checked against the manifest; None (reported)
        when a slab does not match: nothing of the unit is written."""
        assert self.manifest is not None
        out: dict[str, bytes] = {}
        for slab in self.store.slabs[(layer, expert)]:
            parts = []
            for off in range(0, slab.length, sess.chunk_max):
                n = min(sess.chunk_max, slab.length - off)
                resp = await sess.call({"op": "chunk", "tensor": slab.tensor, "expert": expert, "offset": off,
                                        "length": n})
                data = resp.get("data")
                if not isinstance(data, bytes) or len(data) != n:
                    raise ShardTransferError(f"source {sess.source}: chunk of the wrong size")
                parts.append(data)
            data = b"".join(parts)
            want = self.manifest.tensor(slab.tensor).slab_sha256(expert)
            if hashlib.sha256(data).digest() != want:
                self.cache.stats.bad_slabs += 1
                log.warning("expert cache: source %s sent a slab of %s expert %d that fails its manifest hash: "
                            "not cached, not computed; asking again (another source first)", sess.source,
                            slab.tensor, expert)
                return None
            out[slab.tensor] = data
        return out

    def _make_room(self, layer: int) -> bool:
        """Drop the coldest unpinned units until one of ``layer`` fits; whether it does."""
        if self.cache.fits(layer):
            return True
        hot = self.demand.value if self.demand is not None else (lambda layer_, e: 0.0)
        for u in sorted(self.cache.held, key=lambda u: hot(*u)):
            self.cache.drop(*u)
            if self.cache.fits(layer):
                return True
        return False

    async def fetch(self, layer: int, experts: list[int], *, over_capacity: bool = True) -> int:
        """Fetch units of ``layer`` into the cache from any source that serves them; returns how
        many it got. ``over_capacity``: a unit no live owner holds is cached even past the bound
        (the step needs it; the next refill trims back)."""
        async with self._lock:
            todo = [e for e in sorted(set(experts)) if not self.cache.holds(layer, e)]
            if not todo:
                return 0
            pinned: list[tuple[int, int]] = []  # what this call fetched stays until the step uses it
            try:
                return await self._fetch(layer, todo, over_capacity, pinned)
            finally:
                self.cache.unpin(pinned)

    async def _fetch(self, layer: int, todo: list[int], over_capacity: bool, pinned: list) -> int:
        got = 0
        sources = await self._find(layer)
        if not sources:
            log.warning("expert cache: no shard source for model %s in the swarm (a `serve-shards` seeder, "
                        "a backbone with --manifest or a worker that downloaded its shard): cannot fetch layer %d "
                        "experts %s", self.model[:12], layer, todo)
        # every source twice at most (a bad slab or a broken stream: the others first, then once again,
        # as a worker's download does), so one corrupted chunk does not lose the unit
        for src, rng in sources + sources:
            mine = [e for e in todo if rng is None or rng[0] <= e < rng[1]]
            if not mine:
                continue
            name = _source_name(src)
            try:
                sess = await self._session(src, layer, mine)
            except (SwarmError, trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError,
                    OSError, KeyError) as exc:
                if rng is not None:  # a worker that does not serve its shard: not asked again for a while
                    self._no_shard[name] = time.monotonic()
                log.warning("expert cache: source %s: %s", name, clip(exc, 300))
                continue
            n0 = got
            try:
                for e in mine:
                    t0 = time.perf_counter()
                    data = await self._unit(sess, layer, e)
                    if data is None:
                        break  # a lying source: the rest from another
                    if not over_capacity and not self._make_room(layer):
                        todo.remove(e)
                        continue
                    await trio.to_thread.run_sync(self.store.put, layer, e, data)
                    self.cache.add(layer, e)
                    pinned += self.cache.pin(layer, [e])
                    s = self.cache.stats
                    s.fetches += 1
                    s.fetch_bytes += sum(len(b) for b in data.values())
                    s.fetch_seconds += time.perf_counter() - t0
                    todo.remove(e)
                    got += 1
            except (SwarmError, trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError,
                    OSError) as exc:
                log.warning("expert cache: fetching from %s failed: %s", name, clip(exc, 300))
            finally:
                await sess.stream.aclose()
                if got > n0:
                    self.fetched_from[name] = self.fetched_from.get(name, 0) + got - n0
                    log.info("expert cache: %d unit(s) of layer %d from %s%s", got - n0, layer, name,
                             "" if rng is None else f" (a worker's shard, experts {rng[0]}-{rng[1] - 1})")
        if got:
            log.info("expert cache: fetched %d unit(s) of layer %d (%d cached, %.1f of %.1f MB)", got, layer,
                     len(self.cache.held), self.cache.used / 1e6, self.cache.capacity / 1e6)
        return got

    async def refill(self) -> tuple[int, int]:
        """Move the cache towards the hottest units by demand: (units fetched, units dropped)."""
        if self.demand is None:
            return 0, 0
        demand = self.demand.top(len(self.cache.layers) * self.cache.n_expert)
        add, drop = self.cache.plan(demand)
        dropped = sum(1 for u in drop if self.cache.drop(*u))
        by_layer: dict[int, list[int]] = {}
        for layer, e in add:
            by_layer.setdefault(layer, []).append(e)
        fetched = 0
        for layer, experts in sorted(by_layer.items()):
            fetched += await self.fetch(layer, experts, over_capacity=False)
        return fetched, dropped

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Refill every ``refill_s`` until cancelled."""
        task_status.started()
        while True:
            await trio.sleep(self.refill_s)
            try:
                await self.refill()
            except (SwarmError, OSError) as exc:
                log.warning("expert cache refill failed: %s", exc)
