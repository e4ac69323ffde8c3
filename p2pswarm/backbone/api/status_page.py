"""What an operator sees of a backbone: ``GET /`` (the status page) and ``GET /v1/swarm`` (its JSON).

The page (``static/status.html``, package data, no external assets so it works offline) polls
``/v1/swarm`` every two seconds and draws:

* the coverage heat-map, one cell per coverage unit (layer x block of ``block_size`` experts):
  how many live remote replicas hold it (0 = only the backbone's own fallback replica computes
  it), and the routing demand once the dispatcher counts it;
* the workers, state first (live, back-off, refused): short peer id, the path requests take
  (direct lane, libp2p, or relayed: only when the connection really goes through a relay),
  round trip, in-flight requests, requests served, failures, kernel (shortened; the full id on
  hover), and what they hold; counted once, as peers and as shards (a peer may serve several);
* tokens/s over the last five minutes and the sequences generating now;
* the dispatch counters: expert requests, groups sent out / planned on the backbone's replica,
  probes, the wire's totals, coverage-map refreshes, uptime.

The panels fill the window (the heat-map's rows and the chart take the height the workers' table
leaves), and the chart is drawn in the SVG's own pixels so its labels stay the body's size.

A replica is *live* when the dispatcher would send it work now: a worker that failed is in
back-off and stops counting at once, so a killed worker shows on the map at its next request,
not at its record's expiry; a worker refused at the handshake never counts. A unit is covered as
many times as its least-covered expert (the same rule as ``swarm-status``).
"""
from __future__ import annotations

import bisect
import math
import time
from importlib import resources

import numpy as np

from p2pswarm.net.signed.records import DEFAULT_BLOCK_SIZE


def status_html() -> bytes:
    return resources.files("p2pswarm.backbone.api").joinpath("static/status.html").read_bytes()


def worker_counts(owners) -> tuple[int, int]:
    """(worker peers, shards they serve): the one count of workers the page, /metrics and
    swarm-status all show. A dispatcher owner is one (peer, shard): an --auto worker holding five
    units is five owners but one worker."""
    remote = [o for o in owners if o.remote]
    return len({o.peer or o.name for o in remote}), len(remote)


def _ranges(owner):
    """``((l0, l1), (e0, e1))`` half-open ranges an owner holds, or None when it only answers holds()."""
    if owner.layers is not None and owner.experts is not None:
        return tuple(owner.layers), tuple(owner.experts)
    return None


class SwarmView:
    """Coverage and workers of one backbone, from its dispatcher (the owners it routes to now)."""

    def __init__(self, dispatcher, *, layers, n_expert: int, block_size: int = DEFAULT_BLOCK_SIZE,
                 kernel: str | None = None, resolver=None):
        self.dispatcher = dispatcher
        self.layers = sorted(layers)
        self.n_expert = n_expert
        self.block_size = block_size
        self.kernel = kernel
        self.resolver = resolver
        self.n_blocks = math.ceil(n_expert / block_size) if n_expert else 0
        self.started = time.time()

    @classmethod
    def for_backbone(cls, backbone, layout, *, block_size: int = DEFAULT_BLOCK_SIZE, resolver=None) -> "SwarmView":
        d = backbone.dispatcher
        return cls(d, layers=layout.expert_layers, n_expert=layout.n_expert, block_size=block_size,
                   kernel=d.local.bank.kernel, resolver=resolver)

    def _cover(self, grid: np.ndarray, owner, span) -> None:
        """Add 1 to ``grid[row, expert]`` for every expert the owner holds: one slice from its
        ranges, or ``holds()`` expert by expert for an owner without ranges."""
        if span is not None:
            (l0, l1), (x0, x1) = span
            if x1 > x0:
                r0, r1 = bisect.bisect_left(self.layers, l0), bisect.bisect_left(self.layers, l1)
                grid[r0:r1, max(0, x0):min(self.n_expert, x1)] += 1
            return
        for row, layer in enumerate(self.layers):
            for e in range(self.n_expert):
                if owner.holds(layer, e):
                    grid[row, e] += 1

    def _per_unit(self, grid: np.ndarray) -> np.ndarray:
        """Replicas per unit: its least-covered expert's count (workers holding experts 0-5 and 6-10
        touch the unit of experts 0-7 twice, yet cover it once)."""
        nb, bs = self.n_blocks, self.block_size
        padded = np.full((grid.shape[0], nb * bs), np.iinfo(np.int32).max, np.int32)
        padded[:, : self.n_expert] = grid  # a partial last block: its missing experts never count
        return padded.reshape(grid.shape[0], nb, bs).min(axis=2)

    def units(self) -> list[dict]:
        """One dict per unit, layer-major. Counted owner by owner with array slices, so a poll
        stays cheap at the 122B's scale (49 x 32 units, hundreds of phones): bench/bench_status.py.
        A worker refused at the handshake is known, never live."""
        d = self.dispatcher
        nb, bs = self.n_blocks, self.block_size
        live = np.zeros((len(self.layers), self.n_expert), np.int32)
        known = np.zeros_like(live)
        for o in d.owners:
            if o.remote:
                span = _ranges(o)
                self._cover(known, o, span)
                if d.healthy(o) and o.refused is None:
                    self._cover(live, o, span)
        demand = d.demand
        now = time.monotonic()
        live_l, known_l = self._per_unit(live).tolist(), self._per_unit(known).tolist()
        out = []
        for row, layer in enumerate(self.layers):
            for b in range(nb):
                e0, e1 = b * bs, min((b + 1) * bs, self.n_expert)
                out.append({"layer": layer, "block": b, "experts": [e0, e1], "replicas": live_l[row][b],
                            "known": known_l[row][b],
                            "demand": round(sum(demand.value(layer, e, now) for e in range(e0, e1)), 3)})
        return out

    def workers(self) -> list[dict]:
        d = self.dispatcher
        out = []
        for o in d.owners:
            if not o.remote:
                continue
            st = o.status()
            span = _ranges(o)
            healthy = d.healthy(o)
            out.append({
                "state": "refused" if st.refused is not None else ("live" if healthy else "back-off"),
                "refused": st.refused,
                "name": o.name,
                "peer": st.peer,
                "short_id": (st.peer[-10:] if st.peer else o.name),
                "relayed": st.relayed,
                "addrs": st.addrs,
                "rtt_ms": round(st.rtt_s * 1000, 2) if st.rtt_s is not None else None,
                "load": st.load,
                "requests": st.requests,
                "failures": st.failures,
                "wire": st.wire,  # bytes sent/received
                "lane": st.lane,  # "libp2p" or "direct" (docs/protocol.md), None before connecting
                "kernel": st.kernel or self.kernel,
                "layers": list(span[0]) if span else None,
                "experts": list(span[1]) if span else None,
                "healthy": healthy,
            })
        return out

    def coverage_counts(self) -> tuple[int, int, int]:
        """(units with a live remote replica, units only the local replica covers, worker peers)."""
        units = self.units()
        live = sum(1 for u in units if u["replicas"] > 0)
        return live, len(units) - live, self.worker_counts()[0]

    def worker_counts(self) -> tuple[int, int]:
        return worker_counts(self.dispatcher.owners)

    def snapshot(self, *, model: str, fingerprint: str, active: int, rate, metrics_totals: dict) -> dict:
        s = self.dispatcher.stats
        units = self.units()
        return {
            "model": model,
            "fingerprint": fingerprint,
            "time": time.time(),
            "uptime_s": round(time.time() - self.started, 1),
            "layers": self.layers,
            "n_expert": self.n_expert,
            "block_size": self.block_size,
            "blocks_per_layer": self.n_blocks,
            "units": units,
            "covered_units": sum(1 for u in units if u["replicas"] > 0),
            "workers": self.workers(),
            "worker_peers": self.worker_counts()[0],
            "worker_shards": self.worker_counts()[1],
            "active_sequences": active,
            "tokens_per_s": rate.series(),
            "dispatch": {"expert_requests": s.requests, "fallbacks": s.fallbacks,
                         "local_groups": s.local_groups, "remote_groups": s.remote_groups,
                         "probes": s.probes,
                         # seconds in expert dispatch (all local: the replica's compute), and the
                         # (expert, row) pairs each remote owner was sent: bench/device_swarm.py
                         "seconds": round(s.seconds, 4), "owner_rows": dict(s.per_owner_rows)},
            # the backbone's expert cache (--expert-cache), None when it holds every expert
            "expert_cache": self.dispatcher.cache.status() if self.dispatcher.cache is not None else None,
            "resolver": ({"refreshes": self.resolver.stats.refreshes,
                          "last_refresh_s": round(self.resolver.stats.last_refresh_s, 3),
                          # owners kept past their record's expiry because they answered us
                          "vouched": self.resolver.stats.vouched}
                         if self.resolver is not None else None),
            **metrics_totals,
        }
