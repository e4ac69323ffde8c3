"""The dispatcher's counters: :class:`DispatchStats` (what was sent where) and :class:`DemandCounter`
(how often each expert is routed, decayed: the demand the market publishes and the expert cache
fills by). Split from :mod:`p2pswarm.backbone.dispatch.dispatcher`, which re-exports both."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from p2pswarm.contracts import Groups


@dataclass
class DispatchStats:
    """Counters over the dispatcher's life; `snapshot()` and differences give per-step numbers."""

    layers: int = 0
    requests: int = 0
    remote_rows: int = 0
    local_groups: int = 0
    remote_groups: int = 0
    fallbacks: int = 0
    seconds: float = 0.0
    per_owner: dict[str, int] = field(default_factory=dict)
    deadline_misses: int = 0  # fallbacks because a worker missed its learnt deadline (hung, not dead)
    verified_groups: int = 0  # remote groups recomputed locally to check them (Dispatcher.verifier)
    mismatches: int = 0  # checked groups whose outputs differed from the local replica's (each bans)
    recoveries: int = 0  # back-offs ended early: the worker's late reply came (it was late, not hung)
    probes: int = 0  # background requests to owners the hot-expert path kept local (not in ``requests``)
    per_owner_rows: dict[str, int] = field(default_factory=dict)  # (expert, row) pairs sent to each remote owner

    def add_plan(self, plan: dict, groups: Groups, seconds: float) -> None:
        """One routed layer: ``plan`` (owner -> indices into ``groups``) took ``seconds``."""
        self.layers += 1
        self.seconds += seconds
        for owner, which in plan.items():
            if owner.remote:
                self.requests += 1
                self.remote_groups += len(which)
                pairs = sum(len(groups[i][1]) for i in which)
                self.remote_rows += pairs
                self.per_owner_rows[owner.name] = self.per_owner_rows.get(owner.name, 0) + pairs
            else:
                self.local_groups += len(which)
            self.per_owner[owner.name] = self.per_owner.get(owner.name, 0) + len(which)

    def snapshot(self) -> "DispatchStats":
        return DispatchStats(self.layers, self.requests, self.remote_rows, self.local_groups, self.remote_groups,
                             self.fallbacks, self.seconds, dict(self.per_owner), self.deadline_misses,
                             self.verified_groups, self.mismatches, self.recoveries, self.probes,
                             dict(self.per_owner_rows))

    def since(self, before: "DispatchStats") -> "DispatchStats":
        return DispatchStats(
            self.layers - before.layers, self.requests - before.requests, self.remote_rows - before.remote_rows,
            self.local_groups - before.local_groups, self.remote_groups - before.remote_groups,
            self.fallbacks - before.fallbacks, self.seconds - before.seconds,
            {k: v - before.per_owner.get(k, 0) for k, v in self.per_owner.items()},
            self.deadline_misses - before.deadline_misses,
            self.verified_groups - before.verified_groups, self.mismatches - before.mismatches,
            self.recoveries - before.recoveries, self.probes - before.probes,
            {k: v - before.per_owner_rows.get(k, 0) for k, v in self.per_owner_rows.items()},
        )


class DemandCounter:
    """How often each (layer, expert) is routed, decayed exponentially with a half-life in seconds:
    the demand signal a coverage market publishes (which experts are hot, and how hot).

    Counts routed rows (token, expert pairs), not requests, so it measures the work an owner of the
    expert would do. ``value(layer, expert)`` and ``top(n)`` read it as of now."""

    def __init__(self, half_life_s: float = 60.0):
        self.half_life_s = half_life_s
        self._counts: dict[tuple[int, int], tuple[float, float]] = {}  # key -> (value, at)

    def _decay(self, value: float, at: float, now: float) -> float:
        return value * 0.5 ** ((now - at) / self.half_life_s)

    def add(self, layer: int, groups: Groups, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for e, idx in groups:
            key = (layer, int(e))
            v, at = self._counts.get(key, (0.0, now))
            self._counts[key] = (self._decay(v, at, now) + len(idx), now)

    def value(self, layer: int, expert: int, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        v, at = self._counts.get((layer, expert), (0.0, now))
        return self._decay(v, at, now)

    def top(self, n: int = 10, now: float | None = None) -> list[tuple[tuple[int, int], float]]:
        now = time.monotonic() if now is None else now
        vals = [(k, self._decay(v, at, now)) for k, (v, at) in self._counts.items()]
        return sorted(vals, key=lambda kv: -kv[1])[:n]
