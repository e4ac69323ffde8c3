"""The backbone's Prometheus metrics (``GET /metrics``) and the token-rate history of the status page.

One :class:`BackboneMetrics` per HTTP app, on its own ``CollectorRegistry`` (not the process-wide
default: tests run several backbones in one process, and a registry refuses duplicate names).
Counters the HTTP layer updates itself (requests, tokens) are ``prometheus_client`` metrics;
numbers other parts already keep (the dispatcher's counters, the coverage map, the workers) are
read at scrape time by a custom collector, so they never drift from the source.

    p2pswarm_http_requests_total{endpoint, status}    requests answered, by route and HTTP status
    p2pswarm_tokens_generated_total                   completion tokens handed to clients
    p2pswarm_prompt_tokens_total                      prompt tokens fed
    p2pswarm_active_sequences                         sequences generating right now
    p2pswarm_owner_request_seconds{owner}             expert-request round trip per remote owner
    p2pswarm_expert_requests_total                    requests sent to remote owners
    p2pswarm_expert_fallbacks_total                   owner failures recomputed on the local replica
    p2pswarm_expert_groups_total{where}               expert groups computed locally / remotely
    p2pswarm_coverage_units{state}                    units with live remote replicas / only the local one
    p2pswarm_workers                                  worker peers (once each, however many shards)
    p2pswarm_worker_shards                            shards those workers serve
    p2pswarm_replayed_sequences_total                 sequences rewound: a banned worker's unchecked rows were in them
    p2pswarm_replayed_rows_total                      rows fed again by those replays
    p2pswarm_withdrawn_tokens_total                   tokens already delivered that a replay withdrew
    p2pswarm_unfixable_finished_total                 requests that finished before such a ban (not replayable)
    p2pswarm_wire_bytes_total{direction}              expert-RPC bytes to (sent) / from (received) all remote owners
    p2pswarm_owner_wire_bytes_total{owner, direction} the same per remote owner now known
    p2pswarm_draft_tokens_total{outcome}              speculative decoding: drafts verified, by accepted / rejected
    p2pswarm_draft_acceptance                         accepted / drafted so far (NaN before any draft)
    p2pswarm_expert_cache_bytes{kind}                 the expert cache (--expert-cache): capacity / used
    p2pswarm_expert_cache_units                       units (layer, expert) cached now
    p2pswarm_expert_cache_lookups_total{result}       routed groups whose unit was cached (hit) or not (miss)
    p2pswarm_expert_cache_fetches_total               units fetched into the cache (slabs checked against the manifest)
    p2pswarm_expert_cache_fetch_bytes_total           their bytes
    p2pswarm_expert_cache_bad_slabs_total             slabs that failed their manifest hash (never cached)
    p2pswarm_expert_cache_no_owner_units              units routed while no live owner held them
    p2pswarm_verify_check_fetches_total{result}       verification checks of units the cache lacks: units
                                                      fetched and checked, picks refused by the budget
    p2pswarm_verify_check_fetch_bytes_total           slab bytes fetched for those checks (--verify-fetch-budget)

Wire bytes are counted at the transport stream, frame headers and handshakes included
(:mod:`p2pswarm.net.wire.counting`).
"""
from __future__ import annotations

import time
from collections import deque

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from p2pswarm.backbone.api.status_page import worker_counts

RATE_BIN_S = 5.0
RATE_HISTORY_S = 300.0
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class TokenRate:
    """Tokens generated per ``RATE_BIN_S`` bin over the last ``RATE_HISTORY_S``: the status page's
    tokens/s chart (Prometheus has the raw counter; the page must work without a Prometheus)."""

    def __init__(self, clock=time.time):
        self.clock = clock
        self.bins: deque[list[float]] = deque()  # [bin start, tokens]

    def add(self, n: int = 1) -> None:
        now = self.clock()
        start = now - now % RATE_BIN_S
        if not self.bins or self.bins[-1][0] != start:
            self.bins.append([start, 0.0])
        self.bins[-1][1] += n
        self._trim(now)

    def _trim(self, now: float) -> None:
        while self.bins and self.bins[0][0] < now - RATE_HISTORY_S:
            self.bins.popleft()

    def series(self) -> list[list[float]]:
        """``[[bin start (unix s), tokens/s], ...]`` for every bin of the window, zeros included."""
        now = self.clock()
        self._trim(now)
        have = {b[0]: b[1] for b in self.bins}
        last = now - now % RATE_BIN_S
        n = int(RATE_HISTORY_S / RATE_BIN_S)
        return [[t, have.get(t, 0.0) / RATE_BIN_S] for t in (last - RATE_BIN_S * i for i in range(n - 1, -1, -1))]


class _SwarmCollector:
    """Reads the dispatcher and the status snapshot at scrape time."""

    def __init__(self, dispatcher, coverage, replays=None, spec=None):
        self.dispatcher = dispatcher
        self.spec = spec  # the scheduler's SpecStats (speculative decoding)
        self.coverage = coverage  # () -> (live units, local-only units, workers)
        self.replays = replays  # the backbone's ReplayStats (replay on ban)

    def collect(self):
        s = self.dispatcher.stats
        yield CounterMetricFamily("p2pswarm_expert_requests", "Expert requests sent to remote owners", value=s.requests)
        yield CounterMetricFamily("p2pswarm_expert_fallbacks",
                                  "Owner failures whose experts were recomputed on the local replica",
                                  value=s.fallbacks)
        groups = CounterMetricFamily("p2pswarm_expert_groups", "Expert groups computed, by where", labels=["where"])
        groups.add_metric(["local"], s.local_groups)
        groups.add_metric(["remote"], s.remote_groups)
        yield groups
        live, local_only, _peers = self.coverage()
        units = GaugeMetricFamily("p2pswarm_coverage_units", "Coverage units by state", labels=["state"])
        units.add_metric(["remote"], live)
        units.add_metric(["local_only"], local_only)
        yield units
        peers, shards = worker_counts(self.dispatcher.owners)
        yield GaugeMetricFamily("p2pswarm_workers", "Worker peers this backbone routes to (once per peer, however "
                                "many shards it serves; the status page and swarm-status count the same)", value=peers)
        yield GaugeMetricFamily("p2pswarm_worker_shards", "Shards those workers serve (one expert owner each)",
                                value=shards)
        wire = CounterMetricFamily("p2pswarm_wire_bytes", "Expert-RPC bytes to/from all remote owners",
                                   labels=["direction"])
        wire.add_metric(["sent"], self.dispatcher.wire.sent)
        wire.add_metric(["received"], self.dispatcher.wire.received)
        yield wire
        per = CounterMetricFamily("p2pswarm_owner_wire_bytes", "Expert-RPC bytes to/from each remote owner",
                                  labels=["owner", "direction"])
        for o in self.dispatcher.owners:
            w = o.wire
            if w is not None:
                per.add_metric([o.name, "sent"], w.sent)
                per.add_metric([o.name, "received"], w.received)
        yield per
        sp = self.spec
        if sp is not None:
            drafts = CounterMetricFamily("p2pswarm_draft_tokens", "Drafted tokens verified (speculative decoding), by "
                                         "outcome", labels=["outcome"])
            drafts.add_metric(["accepted"], sp.accepted)
            drafts.add_metric(["rejected"], sp.drafted - sp.accepted)
            yield drafts
            yield GaugeMetricFamily("p2pswarm_draft_acceptance", "Accepted / drafted tokens so far (speculative "
                                    "decoding; NaN before any draft)",
                                    value=sp.acceptance if sp.acceptance is not None else float("nan"))
        cache = self.dispatcher.cache
        if cache is not None:
            yield from _cache_metrics(cache)
        r = self.replays
        if r is not None:
            for name, doc, value in (
                    ("replayed_sequences", "Sequences rewound because a banned worker's unchecked rows were in them",
                     r.sequences),
                    ("replayed_rows", "Rows fed again by replays on ban", r.rows),
                    ("withdrawn_tokens", "Tokens already delivered that a replay on ban withdrew", r.tokens_withdrawn),
                    ("unfixable_finished", "Requests finished before a ban of a worker whose unchecked rows they used",
                     r.finished_unfixable)):
                yield CounterMetricFamily(f"p2pswarm_{name}", doc, value=value)


def _cache_metrics(cache):
    """The expert cache's numbers (backbone/owners/expert_cache.py), read at scrape time."""
    st = cache.stats
    size = GaugeMetricFamily("p2pswarm_expert_cache_bytes", "Expert cache bytes: its bound and what it holds",
                             labels=["kind"])
    size.add_metric(["capacity"], cache.capacity)
    size.add_metric(["used"], cache.used)
    yield size
    yield GaugeMetricFamily("p2pswarm_expert_cache_units", "Routed-expert units (layer, expert) cached now",
                            value=len(cache.held))
    look = CounterMetricFamily("p2pswarm_expert_cache_lookups", "Routed groups by whether their unit was cached",
                               labels=["result"])
    look.add_metric(["hit"], st.hits)
    look.add_metric(["miss"], st.misses)
    yield look
    for name, doc, value in (
            ("fetches", "Units fetched into the expert cache", st.fetches),
            ("fetch_bytes", "Bytes of the units fetched into the expert cache", st.fetch_bytes),
            ("bad_slabs", "Fetched slabs that failed their manifest hash (never cached or computed)", st.bad_slabs)):
        yield CounterMetricFamily(f"p2pswarm_expert_cache_{name}", doc, value=value)
    yield GaugeMetricFamily("p2pswarm_expert_cache_no_owner_units",
                            "Units routed while no live owner held them (fetched, or their requests failed)",
                            value=len(st.no_owner))
    budget = cache.check_budget
    if budget is not None:
        checks = CounterMetricFamily("p2pswarm_verify_check_fetches",
                                     "Checks of units the expert cache lacks: fetched and checked, or refused by the "
                                     "budget", labels=["result"])
        checks.add_metric(["checked"], budget.checks)
        checks.add_metric(["refused"], budget.refused)
        yield checks
        yield CounterMetricFamily("p2pswarm_verify_check_fetch_bytes", "Slab bytes fetched to check units the "
                                  "expert cache lacks (dropped after the check)", value=budget.fetched_bytes)


class BackboneMetrics:
    def __init__(self, dispatcher, coverage, active, replays=None, spec=None):
        """``coverage()`` -> (units with a live remote replica, units only the local replica
        covers, remote owners); ``active()`` -> sequences generating now; ``replays``: the
        backbone's :class:`~p2pswarm.backbone.serving.runner.ReplayStats`; ``spec``: the scheduler's
        :class:`~p2pswarm.backbone.serving.speculation.SpecStats`."""
        self.registry = CollectorRegistry()
        r = self.registry
        self.http_requests = Counter("p2pswarm_http_requests", "HTTP requests answered",
                                     ["endpoint", "status"], registry=r)
        self.tokens = Counter("p2pswarm_tokens_generated", "Completion tokens generated", registry=r)
        self.prompt_tokens = Counter("p2pswarm_prompt_tokens", "Prompt tokens fed", registry=r)
        self.active = Gauge("p2pswarm_active_sequences", "Sequences generating now", registry=r)
        self.active.set_function(active)
        self.owner_latency = Histogram("p2pswarm_owner_request_seconds",
                                       "Expert request round trip per remote owner (compute included)",
                                       ["owner"], buckets=LATENCY_BUCKETS, registry=r)
        r.register(_SwarmCollector(dispatcher, coverage, replays, spec))
        self.rate = TokenRate()
        self.total_tokens = 0

    def observe_owner(self, owner, seconds: float) -> None:
        self.owner_latency.labels(owner.name).observe(seconds)

    def generated(self, n: int = 1) -> None:
        self.tokens.inc(n)
        self.total_tokens += n
        self.rate.add(n)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def wire_summary(dispatcher, generated: int) -> dict:
    """The backbone's wire bytes for ``/health`` and the status page: totals, per expert request,
    per generated token (both directions together) and per remote owner now known."""
    w, requests = dispatcher.wire, dispatcher.stats.requests
    total = w.sent + w.received
    return {"sent": w.sent, "received": w.received,
            "bytes_per_request": round(total / requests, 1) if requests else None,
            "bytes_per_token": round(total / generated, 1) if generated else None,
            "owners": {o.name: o.wire.as_dict() for o in dispatcher.owners if o.wire is not None}}
