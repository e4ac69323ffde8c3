"""Sampled verification of untrusted workers: recompute a random sample of their outputs, bit for bit.

Exactness makes this a strict test: a worker computes each (expert, rows) group with the same kernel
family as the backbone's local replica (the handshake and records check it), so its outputs must
equal the replica's *bit for bit*; any difference is a wrong answer, never rounding.

Sampling. Every output row a remote worker is asked for is selected with probability ``rate``
(``--verify-rate``), by a seeded RNG per backbone (``--verify-seed``; default: fresh entropy, so a
worker cannot predict it). A group with a selected row is recomputed *whole* on the local replica:
mat-muls are not row-invariant under OpenBLAS (docs/architecture.md), so only the same rows in
the same call give the same bits. The recomputation starts when the request is sent and runs in a
thread beside it (the worker cannot tell a checked request from another), so a step waits for
max(round trip, local check), not their sum; only selected groups are recomputed.

Detection. A worker that falsifies a fraction ``p`` of its rows, each row checked with probability
``r``: every row it serves is caught independently with probability at least ``r * p`` (whole
groups are compared, so more when groups hold several rows), hence

    P(caught within n rows) >= 1 - (1 - r p)^n,   n_q = ln(1 - q) / ln(1 - r p) rows for confidence q.

At r = 0.01, p = 0.01: 46,000 rows (about 2,900 decode tokens of a 16-row-per-token model) for 99%.
An honest worker is never banned: a mismatch needs a differing bit, and the spine guarantees none.

What the step uses. On a mismatch the dispatcher throws away *all* of that worker's outputs for
the request (one wrong row makes every row of the reply suspect) and uses the local replica's, so
the step's result is exact from the detecting request on; rows of earlier, unsampled requests were
used as they came (that is what sampling means: at r = 1 nothing wrong is ever used).

Replay on ban makes the outputs exact anyway: every sequence records the first position computed
from a worker's unverified rows, and when that worker is banned, the sequences still running that
used them are rewound to there and recomputed (p2pswarm.backbone.scheduler, docs/market.md). Only a
sequence that had already *finished* cannot be fixed: it is logged (request id, worker) and counted
(/health ``replays.finished_unfixable``).
"""
from __future__ import annotations

import hashlib
import logging
import zlib
from dataclasses import dataclass

import msgpack
import numpy as np

log = logging.getLogger("p2pswarm.market")

DEFAULT_VERIFY_RATE = 0.01


def rows_for_confidence(rate: float, falsified: float, confidence: float = 0.99) -> float:
    """Rows a worker falsifying a ``falsified`` fraction of its rows can serve before it is caught
    with probability ``confidence``: ln(1 - q) / ln(1 - r p)."""
    rp = rate * falsified
    if rp <= 0:
        return float("inf")
    if rp >= 1:
        return 1.0
    return float(np.log1p(-confidence) / np.log1p(-rp))


@dataclass(frozen=True)
class Evidence:
    """What a ban rests on: the first mismatching row of a checked group, and a digest of it all."""

    worker: str
    layer: int
    expert: int
    row: int  # index of the row in the layer's input (the token's position in the batch)
    max_abs_delta: float  # over the whole group
    rows_differing: int
    rows_in_group: int
    input_sha256: str  # of the group's input rows
    worker_sha256: str  # of the worker's outputs for the group
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
    """Picks which groups of each remote request to recompute, and keeps per-worker counts."""

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

    def pick(self, worker: str, groups) -> list[int]:
        """Indices of ``worker``'s groups to recompute: those with at least one row selected."""
        if self.rate <= 0 or not groups:
            return []
        if self.rate >= 1:
            return list(range(len(groups)))
        draws = self._rng(worker).random(sum(len(idx) for _, idx in groups)) < self.rate
        picked, pos = [], 0
        for i, (_, idx) in enumerate(groups):
            if draws[pos : pos + len(idx)].any():
                picked.append(i)
            pos += len(idx)
        return picked

    def check(self, worker: str, layer: int, cur: np.ndarray, groups, outs, picked: list[int],
              refs: list[np.ndarray]) -> Evidence | None:
        """Compare the picked groups' outputs with the replica's; Evidence for the first mismatch."""
        self.rows_served[worker] = self.rows_served.get(worker, 0) + sum(len(idx) for _, idx in groups)
        self.rows_checked[worker] = self.rows_checked.get(worker, 0) + sum(len(groups[i][1]) for i in picked)
        self.groups_checked += len(picked)
        for i, want in zip(picked, refs):
            e, idx = groups[i]
            diff = compare_group(worker, layer, e, idx, cur, outs[i], want)
            if diff is None:
                continue
            self.mismatches += 1
            row, md, n = diff
            return Evidence(worker, layer, int(e), row, md, n, len(idx), _sha(cur[idx]), _sha(outs[i]), _sha(want),
                            self.rows_served[worker], self.rows_checked[worker])
        return None
