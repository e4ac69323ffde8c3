"""Sampled verification of untrusted workers: recompute a random sample of their outputs, bit for bit.

Exactness makes this a strict test: a worker computes each (expert, rows) group with the same kernel
family as the backbone's local replica (the handshake and records check it), so its outputs must
equal the replica's *bit for bit*; any difference is a wrong answer, never rounding.

Sampling. Every output row a remote worker is asked for is selected with probability ``rate``
(``--verify-rate``), by a seeded RNG per backbone (``--verify-seed``; default: fresh entropy, so a
worker cannot predict it). Where the replica's kernel gives a row the same bits whatever rows
share its call (measured by the backbone's probe: libggml on Q8_0 for calls of up to 520 rows,
K-quants up to 7; ``Dispatcher.exact_rows``), only the selected rows are recomputed, so a check
costs about ``rate`` of the work; elsewhere (OpenBLAS is never row-invariant, docs/architecture.md)
a group with a selected row is recomputed *whole*, since only the same rows in the same call give
the same bits there. The recomputation starts when the request is sent and runs in a thread
beside it (the worker cannot tell a checked request from another), so a step waits for
max(round trip, local check), not their sum.

Detection. A worker that falsifies a fraction ``p`` of its rows, each row checked with probability
``r``: every row it serves is caught independently with probability at least ``r * p`` (where
whole groups are compared, more when groups hold several rows), hence

    P(caught within n rows) >= 1 - (1 - r p)^n,   n_q = ln(1 - q) / ln(1 - r p) rows for confidence q.

At r = 0.01, p = 0.01: 46,000 rows (about 2,900 decode tokens of a 16-row-per-token model) for 99%.
An honest worker is never banned: a mismatch needs a differing bit, and the spine guarantees none.

What the step uses. On a mismatch the dispatcher throws away *all* of that worker's outputs for
the request (one wrong row makes every row of the reply suspect) and uses the local replica's, so
the step's result is exact from the detecting request on; rows of earlier, unsampled requests were
used as they came (that is what sampling means: at r = 1 nothing wrong is ever used).

Replay on ban makes the outputs exact anyway: every sequence records the first position computed
from a worker's unverified rows, and when that worker is banned, the sequences still running that
used them are rewound to there and recomputed (p2pswarm.backbone.serving.scheduler, docs/market.md). Only a
sequence that had already *finished* cannot be fixed: it is logged (request id, worker) and counted
(/health ``replays.finished_unfixable``).

With a partial expert cache (``--expert-cache``) the replica holds some units only. A picked group
of a unit the cache holds is recomputed as above; one of a unit it lacks is checked on the unit's
slabs fetched for the check (by byte range from any holder, each slab checked against the signed
manifest: the worker's own shard server will do, since the bytes are checked, not the peer), held
beside the cache for that check and dropped after. :class:`CheckFetchBudget` bounds it: at most
``--verify-fetch-budget`` bytes a minute (default :data:`DEFAULT_CHECK_FETCH_BYTES`) and
:data:`CHECK_UNITS_MAX` units held for checking at once; a pick past either is not checked (its
rows count as used unverified: a later ban still replays them). So with a cache of share ``c`` of
the demand, the share of picks that can be checked is ``c`` plus what the budget buys of the
rest: each check of an uncached unit costs one unit's slabs (docs/benchmarks.md, "expert cache").
"""
from __future__ import annotations

import hashlib
import logging
import time
import zlib
from dataclasses import dataclass

import msgpack
import numpy as np

log = logging.getLogger("p2pswarm.market")

DEFAULT_VERIFY_RATE = 0.01
#: ``--verify-fetch-budget``'s default: bytes a backbone may fetch per :data:`CHECK_PERIOD_S` to
#: check units its expert cache lacks (64 MB a minute: about 8.5 Mbit/s, a few units of a 671B model)
DEFAULT_CHECK_FETCH_BYTES = 64_000_000
CHECK_PERIOD_S = 60.0
#: units held for checking at once (the bounded store beside the cache; each dropped after its check)
CHECK_UNITS_MAX = 4

#: one check of a remote request: (index of the group, positions of its rows to recompute)
Check = tuple[int, np.ndarray]


def mark_unverified(taint: dict[str, np.ndarray], peer: str, n_rows: int, groups: list[tuple[int, np.ndarray]],
                    picked: list[Check]) -> None:
    """Mark the rows of ``groups`` that ``peer`` answered and no check covered (all but the
    ``picked`` rows) in ``taint[peer]``, a mask over the step's ``n_rows`` rows: what a later ban
    of that peer must replay."""
    mask = taint.get(peer)
    if mask is None:
        mask = taint[peer] = np.zeros(n_rows, dtype=bool)
    checked = dict(picked)
    for j, (_, idx) in enumerate(groups):
        at = checked.get(j)
        if at is None:
            mask[idx] = True
        elif len(at) < len(idx):
            keep = np.ones(len(idx), dtype=bool)
            keep[at] = False
            mask[idx[keep]] = True


def rows_for_confidence(rate: float, falsified: float, confidence: float = 0.99) -> float:
    """Rows a worker falsifying a ``falsified`` fraction of its rows can serve before it is caught
    with probability ``confidence``: ln(1 - q) / ln(1 - r p)."""
    rp = rate * falsified
    if rp <= 0:
        return float("inf")
    if rp >= 1:
        return 1.0
    return float(np.log1p(-confidence) / np.log1p(-rp))


class CheckFetchBudget:
    """What checks of units the expert cache lacks may fetch: ``bytes_per_period`` every
    ``period_s`` (a fixed window) and ``units_max`` units held at once. :meth:`take` reserves a
    check's bytes and a slot or says no (the pick goes unchecked), :meth:`release` frees the slot.
    Why a budget: a check's fetch is a whole unit's slabs for a few rows, so unbounded checking at a
    1% rate could cost more of the link than the work it checks."""

    def __init__(self, bytes_per_period: int = DEFAULT_CHECK_FETCH_BYTES, period_s: float = CHECK_PERIOD_S,
                 units_max: int = CHECK_UNITS_MAX, clock=time.monotonic):
        self.bytes_per_period = int(bytes_per_period)
        self.period_s = period_s
        self.units_max = units_max
        self.clock = clock
        self._start = clock()
        self.spent = 0  # bytes reserved in the current period
        self.held = 0  # units held for checking now
        self.checks = 0  # units fetched and checked
        self.fetched_bytes = 0  # slab bytes fetched for checks, in all
        self.refused = 0  # units not fetched: over the budget or the bound
        self.picks_fetched = 0  # picks on units the cache lacks, checked on fetched slabs
        self.picks_refused = 0  # picks on units the cache lacks, left unchecked (budget or bound)
        self.failed = 0  # units whose fetch did not bring them (no holder answered in time)

    def take(self, nbytes: int) -> bool:
        now = self.clock()
        if now - self._start >= self.period_s:
            self._start, self.spent = now, 0
        if self.held >= self.units_max or self.spent + nbytes > self.bytes_per_period:
            self.refused += 1
            return False
        self.spent += nbytes
        self.held += 1
        return True

    def release(self, n: int = 1) -> None:
        self.held = max(0, self.held - n)

    def status(self) -> dict:
        return {"bytes_per_period": self.bytes_per_period, "period_s": self.period_s, "units_max": self.units_max,
                "checks": self.checks, "fetched_bytes": self.fetched_bytes, "refused": self.refused,
                "picks_fetched": self.picks_fetched, "picks_refused": self.picks_refused, "failed": self.failed}


@dataclass(frozen=True)
class Evidence:
    """What a ban rests on: the first mismatching row of a checked group, and a digest of it all."""

    worker: str
    layer: int
    expert: int
    row: int  # index of the row in the layer's input (the token's position in the batch)
    max_abs_delta: float  # over the checked rows of the group
    rows_differing: int
    rows_in_group: int  # rows checked (the whole group, or its selected rows where that is exact)
    input_sha256: str  # of the checked input rows
    worker_sha256: str  # of the worker's outputs for those rows
    replica_sha256: str  # of the local replica's outputs
    rows_served: int  # rows this worker had served us when caught (this request included)
    rows_checked: int  # rows of this worker checked so far

    def summary(self) -> str:
        return (f"layer {self.layer} expert {self.expert} row {self.row}: max |delta| {self.max_abs_delta:.3g} "
                f"({self.rows_differing}/{self.rows_in_group} rows differ), caught after {self.rows_served} rows "
                f"served, {self.rows_checked} checked")

    def digest(self) -> str:
        return hashlib.sha256(b"p2pswarm-evidence-v1\x00" + msgpack.packb(self.__dict__, use_bin_type=True)).hexdigest()


def _sha(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def compare_group(worker: str, layer: int, expert: int, idx: np.ndarray, inputs: np.ndarray, got: np.ndarray,
                  want: np.ndarray) -> tuple[int, float, int] | None:
    """``(first differing row, max |delta|, rows differing)`` if ``got`` differs from ``want`` in any
    bit (NaN payloads and signed zeros included), else None."""
    if got.shape == want.shape and got.dtype == want.dtype and got.tobytes() == want.tobytes():
        return None
    if got.shape != want.shape:
        return int(idx[0]) if len(idx) else -1, float("inf"), len(idx)
    bits_differ = (got.view(np.uint32) != want.view(np.uint32)).any(axis=1)
    rows = np.flatnonzero(bits_differ)
    with np.errstate(invalid="ignore", over="ignore"):
        delta = np.abs(got.astype(np.float64) - want.astype(np.float64))
    md = float(np.nanmax(delta)) if np.isfinite(delta).any() else float("inf")
    if not np.isfinite(delta).all():
        md = float("inf")
    return int(idx[rows[0]]), md, len(rows)


class Verifier:
    """Picks which rows of each remote request to recompute, and keeps per-worker counts."""

    def __init__(self, rate: float = DEFAULT_VERIFY_RATE, seed: int | None = None):
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"verify rate {rate} is not in [0, 1]")
        self.rate = rate
        self.seed = seed
        self._rngs: dict[str, np.random.Generator] = {}
        self.rows_served: dict[str, int] = {}
        self.rows_checked: dict[str, int] = {}
        self.groups_checked = 0
        self.mismatches = 0

    def _rng(self, worker: str) -> np.random.Generator:
        """One stream per worker (seeded: from the seed and the worker's id), so what one worker is
        checked on never depends on the order concurrent requests to others were made in."""
        rng = self._rngs.get(worker)
        if rng is None:
            key = None if self.seed is None else [self.seed, zlib.crc32(worker.encode())]
            rng = self._rngs[worker] = np.random.default_rng(key)
        return rng

    def pick(self, worker: str, groups, exact_rows: int = 1) -> list[Check]:
        """What of ``worker``'s groups to recompute: each group with a selected row, as
        ``(group index, positions)``. ``positions`` are the selected rows only when the group holds
        at most ``exact_rows`` rows (where the replica's kernel gives a row the same bits in a
        call of any of its rows, :attr:`Dispatcher.exact_rows`), else every row of the group: a
        check costs about ``rate`` of the work it checks, not every row of any group one row of
        which was drawn (a decode step of 64 sequences on a 16-expert model routes ~16 rows to
        each expert, and whole-group checks recomputed 15% of the work, not 1%)."""
        if self.rate <= 0 or not groups:
            return []
        if self.rate >= 1:
            return [(i, np.arange(len(idx))) for i, (_, idx) in enumerate(groups)]
        sizes = [len(idx) for _, idx in groups]
        draws = self._rng(worker).random(sum(sizes)) < self.rate
        # only the groups with a draw are visited (a few of hundreds: numpy per group was ~3% of a
        # 0.3-core backbone's samples with 4 workers, bench/device_swarm.py --py-spy)
        ends = np.cumsum(sizes)
        picked = []
        for i in np.unique(np.searchsorted(ends, np.flatnonzero(draws), side="right")).tolist():
            n, end = sizes[i], int(ends[i])
            picked.append((i, np.flatnonzero(draws[end - n : end]) if n <= exact_rows else np.arange(n)))
        return picked

    def check(self, worker: str, layer: int, cur: np.ndarray, groups, outs, picked: list[Check],
              refs: list[np.ndarray]) -> Evidence | None:
        """Compare the picked rows' outputs with the replica's (``refs``: one per pick, its rows);
        Evidence for the first mismatch."""
        self.rows_served[worker] = self.rows_served.get(worker, 0) + sum(len(idx) for _, idx in groups)
        self.rows_checked[worker] = self.rows_checked.get(worker, 0) + sum(len(at) for _, at in picked)
        self.groups_checked += len(picked)
        for (i, at), want in zip(picked, refs):
            e, idx = groups[i]
            idx, got = idx[at], outs[i][at]
            diff = compare_group(worker, layer, e, idx, cur, got, want)
            if diff is None:
                continue
            self.mismatches += 1
            row, md, n = diff
            return Evidence(worker, layer, int(e), row, md, n, len(idx), _sha(cur[idx]), _sha(got), _sha(want),
                            self.rows_served[worker], self.rows_checked[worker])
        return None
