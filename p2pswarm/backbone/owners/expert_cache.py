"""The backbone's local experts as a bounded cache (``--expert-cache SIZE|N%|all|none``).

Why: a backbone that must hold every routed expert can only serve a model its operator already
hosts. With the cache, the backbone keeps the experts it is given room for - the hottest by the
routing demand it measures (:meth:`ExpertCache.plan`), refilled as demand moves - and the swarm's
workers compute the rest. Nothing else changes: a cached unit is computed by the same kernel on
the same bytes as a worker's, so logits stay bit-identical however much is cached.

:class:`ExpertCache` is the :class:`~p2pswarm.contracts.ExpertBank` the dispatcher's local owner
computes with: ``holds`` says which units are cached, and the dispatcher never asks it for one that
is not (it goes to an owner, or is fetched first: :mod:`p2pswarm.backbone.dispatch.dispatcher`). Its bytes are
either the full model's own file (a backbone started from the model: adding a unit costs nothing)
or an :class:`~p2pswarm.model.expert_store.ExpertStore` (a backbone started from the backbone file:
a unit's slabs are written there once fetched and checked, punched out when dropped).
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from p2pswarm.contracts import Groups
from p2pswarm.errors import InternalError, UserError

if TYPE_CHECKING:
    from p2pswarm.market.verify import CheckFetchBudget

log = logging.getLogger("p2pswarm.backbone")

#: share of the memory available at start a default cache may take (the dense part, the KV caches
#: and the page cache need the rest)
DEFAULT_MEMORY_SHARE = 0.5


@dataclass(frozen=True)
class CacheSize:
    """A parsed ``--expert-cache``: ``all``, ``none``, a byte count or a share of all experts."""

    text: str
    kind: str  # "all" | "none" | "bytes" | "percent"
    value: float = 0.0

    def bytes_of(self, total: int) -> int:
        """The cache's bound in bytes, for a model whose routed experts take ``total`` bytes."""
        if self.kind == "all":
            return total
        if self.kind == "none":
            return 0
        if self.kind == "percent":
            return int(total * self.value / 100)
        return int(self.value)


def parse_cache_size(text: str) -> CacheSize:
    """``all``, ``none``, ``10%`` or a size (``340MB``, ``1.5GB``, ``512MiB``); a one-line error else."""
    from p2pswarm.market.auto import parse_size

    t = (text or "").strip().lower()
    if t in ("all", "none"):
        return CacheSize(t, t)
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*%", t)
    if m:
        pct = float(m.group(1))
        if not 0 <= pct <= 100:
            raise UserError(f"--expert-cache {text!r}: a share must be 0-100%")
        return CacheSize(text, "percent", pct)
    if t in ("0", "0b"):
        return CacheSize(text, "none")
    try:
        return CacheSize(text, "bytes", parse_size(t))
    except UserError:
        raise UserError(f"--expert-cache {text!r}: expected all, none, a share like 10% or a size like 1.5GB") from None


def available_memory() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where there is no such file)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def cache_bound(size: CacheSize | None, total: int, *, holds_experts: bool, what: str) -> int:
    """The cache's bound in bytes from ``--expert-cache`` (None: the default), checked against the
    memory available now. Default: ``all`` when the file holds the experts (what a backbone always
    did), else what fits half the available memory. A bound that does not fit is refused with the
    numbers: a backbone that starts and then pages its experts in and out would be slow and never say
    why. ``what``: the model file, for the messages."""
    avail = available_memory()
    if size is None:
        if holds_experts:
            return total
        bound = total if avail is None else min(total, int(avail * DEFAULT_MEMORY_SHARE))
        log.info("expert cache: %.1f MB of %.1f MB of routed experts (%s holds none; the default is what fits "
                 "half of the %s available; --expert-cache sets it)", bound / 1e6, total / 1e6, what,
                 "?" if avail is None else f"{avail / 1e6:.0f} MB")
        return bound
    bound = min(size.bytes_of(total), total)
    if avail is not None and bound > avail and not (holds_experts and size.kind == "all"):
        raise UserError(f"--expert-cache {size.text}: {bound / 1e6:.1f} MB of experts does not fit the "
                        f"{avail / 1e6:.1f} MB of memory available (the model's routed experts take "
                        f"{total / 1e6:.1f} MB); give a smaller size, a share like 10%, or none")
    return bound


@dataclass
class CacheStats:
    """What the status page, swarm-status and /metrics show of the cache."""

    hits: int = 0  # routed groups whose unit was cached
    misses: int = 0  # routed groups whose unit was not (an owner computed it, or it was fetched)
    fetches: int = 0  # units fetched into the cache (on demand or by the refill)
    fetch_bytes: int = 0
    fetch_seconds: float = 0.0
    bad_slabs: int = 0  # slabs that failed their manifest hash (never cached, source reported)
    evictions: int = 0
    no_owner: set = field(default_factory=set)  # (layer, expert) routed when no live owner held it

    def hit_rate(self) -> float | None:
        n = self.hits + self.misses
        return None if n == 0 else self.hits / n


class ExpertCache:
    """A bank restricted to the cached units (module doc). ``bank`` computes on ``bank.layout``'s
    bytes; ``unit_bytes[layer]`` is one unit's size there; ``capacity`` bounds the cached bytes;
    ``store`` is the :class:`~p2pswarm.model.expert_store.ExpertStore` the bank maps (None when
    the bank maps the full model and every unit's bytes are already there)."""

    def __init__(self, bank, capacity: int, *, store=None):
        self.bank = bank
        self.store = store
        self.layout = bank.layout
        self.layers = sorted(self.layout.expert_layers)
        self.n_expert = self.layout.n_expert
        self.unit_bytes = {layer: self.layout.expert_bytes(layer) for layer in self.layers}
        self.total_bytes = sum(self.unit_bytes.values()) * self.n_expert
        self.capacity = capacity
        self.held: set[tuple[int, int]] = set()
        self.used = 0
        self.stats = CacheStats()
        #: units a running layer may still compute (Dispatcher.run_groups): never dropped meanwhile,
        #: so a unit's bytes are never punched out under a kernel reading them
        self._pins: dict[tuple[int, int], int] = {}
        #: what verification checks of units not cached may fetch (market.verify.CheckFetchBudget;
        #: set by the swarm session where the cache is filled from the swarm), for status()
        self.check_budget: CheckFetchBudget | None = None

    # ---- ExpertBank ------------------------------------------------------------------------
    @property
    def kernel(self) -> str:
        return self.bank.kernel

    def holds(self, layer: int, expert: int) -> bool:
        return (layer, int(expert)) in self.held

    @property
    def complete(self) -> bool:
        """Every unit is cached (a monolithic backbone may run a step in one call)."""
        return len(self.held) == len(self.layers) * self.n_expert

    def forward_groups(self, layer: int, rows: np.ndarray, groups: Groups) -> list[np.ndarray]:
        for e, _ in groups:
            if (layer, int(e)) not in self.held:  # the dispatcher routes only cached units here
                raise InternalError(f"expert {e} of layer {layer} is not in the backbone's expert cache")
        return self.bank.forward_groups(layer, rows, groups)

    def forward(self, layer: int, expert: int, rows: np.ndarray) -> np.ndarray:
        rows = np.asarray(rows, dtype=np.float32)
        return self.forward_groups(layer, rows, [(expert, np.arange(rows.shape[0]))])[0]

    def __getattr__(self, name: str):  # the bank's other faces (input forms, threads, runner, cache)
        if name == "bank":
            raise AttributeError(name)
        return getattr(self.bank, name)

    @property
    def probe_bank(self):
        """What the row-invariance probe may compute on: the whole bank where its bytes are all
        there (the full model), else this cache (only cached units)."""
        return self.bank if self.store is None else self

    # ---- contents --------------------------------------------------------------------------
    def fits(self, layer: int) -> bool:
        return self.used + self.unit_bytes[layer] <= self.capacity

    def add(self, layer: int, expert: int) -> None:
        """Mark a unit cached (its bytes are in the bank's file: the caller put them in the store)."""
        key = (layer, int(expert))
        if key not in self.held:
            self.held.add(key)
            self.used += self.unit_bytes[layer]

    def pin(self, layer: int, experts) -> list[tuple[int, int]]:
        """Keep the cached ones of ``experts`` until :meth:`unpin` (returns what to unpin)."""
        keys = [(layer, int(e)) for e in experts if (layer, int(e)) in self.held]
        for k in keys:
            self._pins[k] = self._pins.get(k, 0) + 1
        return keys

    def unpin(self, keys: list[tuple[int, int]]) -> None:
        for k in keys:
            n = self._pins.get(k, 0) - 1
            if n > 0:
                self._pins[k] = n
            else:
                self._pins.pop(k, None)

    def drop(self, layer: int, expert: int) -> bool:
        """Drop a unit unless a running layer pinned it; whether it was dropped."""
        key = (layer, int(expert))
        if key in self._pins:
            return False
        if key in self.held:
            self.held.discard(key)
            self.used -= self.unit_bytes[layer]
            self.stats.evictions += 1
            if self.store is not None:
                self.store.drop(layer, expert)
        return True

    def fill_from_file(self, order: list[tuple[int, int]] | None = None) -> int:
        """Cache units in ``order`` (default: expert-major, so every layer gets the same share)
        while they fit; only where the bank's file holds the bytes (no store). Returns how many."""
        if self.store is not None:
            raise InternalError("fill_from_file needs the full model's file")
        order = order if order is not None else [(layer, e) for e in range(self.n_expert) for layer in self.layers]
        n = 0
        for layer, e in order:
            if (layer, e) not in self.held and self.fits(layer):
                self.add(layer, e)
                n += 1
        return n

    def plan(self, demand: list[tuple[tuple[int, int], float]]) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """(units to add, units to drop) so that the cache holds the hottest units by ``demand``
        ((layer, expert), value) that fit, hottest first. A cached unit is dropped only for a hotter
        one: units with no demand yet stay."""
        want: list[tuple[int, int]] = []
        room = self.capacity
        for (layer, e), value in sorted(demand, key=lambda kv: -kv[1]):
            if value <= 0 or layer not in self.unit_bytes:
                continue
            b = self.unit_bytes[layer]
            if b <= room:
                want.append((layer, e))
                room -= b
        wanted = set(want)
        add = [u for u in want if u not in self.held]
        need = sum(self.unit_bytes[u[0]] for u in add) - (self.capacity - self.used)
        drop: list[tuple[int, int]] = []
        if need > 0:
            hot = dict(((layer, e), v) for (layer, e), v in demand)
            for u in sorted((u for u in self.held if u not in wanted), key=lambda u: hot.get(u, 0.0)):
                if need <= 0:
                    break
                drop.append(u)
                need -= self.unit_bytes[u[0]]
        return add, drop

    async def fetch_from_file(self, layer: int, experts: list[int]) -> None:
        """The dispatcher's ``fetch`` where the bank's file is the full model: a unit no live owner
        holds is cached at once (its bytes are here), past the bound until the next refill."""
        for e in experts:
            if not self.holds(layer, e):
                self.add(layer, e)
                self.stats.fetches += 1

    def rebalance(self, demand: list[tuple[tuple[int, int], float]]) -> tuple[int, int]:
        """:meth:`plan` applied where the bytes are all in the bank's file: (added, dropped)."""
        add, drop = self.plan(demand)
        dropped = sum(1 for u in drop if self.drop(*u))
        added = 0
        for layer, e in add:
            if self.fits(layer):
                self.add(layer, e)
                added += 1
        return added, dropped

    def lacks(self, layers, block_size: int) -> list[bool]:
        """Per coverage unit (layer-major, ``block_size`` experts each): whether the cache misses
        any of its experts - what the demand record tells workers this backbone needs them for."""
        nb = -(-self.n_expert // block_size)
        return [any((layer, e) not in self.held for e in range(b * block_size, min((b + 1) * block_size, self.n_expert)))
                for layer in layers for b in range(nb)]

    def count(self, layer: int, groups: Groups) -> None:
        """Hits and misses of one layer's routed groups."""
        for e, _ in groups:
            if (layer, int(e)) in self.held:
                self.stats.hits += 1
            else:
                self.stats.misses += 1

    def status(self) -> dict:
        s = self.stats
        rate = s.hit_rate()
        return {"capacity_bytes": self.capacity, "used_bytes": self.used, "units": len(self.held),
                "units_total": len(self.layers) * self.n_expert, "total_bytes": self.total_bytes,
                "hit_rate": None if rate is None else round(rate, 4), "hits": s.hits, "misses": s.misses,
                "fetches": s.fetches, "fetch_bytes": s.fetch_bytes, "fetch_seconds": round(s.fetch_seconds, 4),
                "bad_slabs": s.bad_slabs,
                "evictions": s.evictions, "no_owner_units": len(s.no_owner),
                "disk_bytes": self.store.disk_bytes() if self.store is not None else None,
                "check_fetches": None if self.check_budget is None else self.check_budget.status()}
