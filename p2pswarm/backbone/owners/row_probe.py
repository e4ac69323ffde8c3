"""Whether a kernel's mat-muls give a row the same bits whatever rows share the call, measured.

Why measured, not assumed: OpenBLAS never does (its kernels depend on the row count), libggml
does for Q8_0 but switches kernels at 8 rows for K-quants, and which a layer uses depends on the
file and the build. Two users: the batch-invariant mode (batch a piece across sequences only where
it is row-invariant) and the verifier (check a group on its sampled rows alone only where that
gives the bits the whole call gives). The expert part belongs to the backbone's local replica
(:meth:`p2pswarm.backbone.dispatch.dispatcher.LocalOwner.row_invariance`); the lm head's to the runner.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

import numpy as np

#: rows of the one call the expert row-invariance probe compares smaller calls against: a prefill
#: step's groups (64 prompts of 5 tokens route ~80 rows to each of 16 experts) lie within it, so
#: the verifier may check those row by row too (measured: libggml's Q8_0 is invariant to 600 rows)
PROBE_ROWS = 520
#: the row counts compared against the one PROBE_ROWS-row call (kernel switch points, block edges)
PROBE_SIZES = [*range(1, 10), 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256, 257, 511, 512]

Rows = Callable[[np.ndarray], np.ndarray]


@dataclass(frozen=True)
class RowInvariance:
    """The experts' measurement: ``invariant`` (every probed row count gives the full call's bits)
    and, where not, ``small`` (the most rows of one expert a call may hold and still give every row
    the bits it gets in any smaller call: libggml's K-quants 7, OpenBLAS 1)."""

    invariant: bool
    small: int

    @property
    def exact_rows(self) -> int:
        """The most rows of a group the verifier may check on their sampled rows alone."""
        return PROBE_ROWS if self.invariant else self.small


def probe_rows(n_embd: int) -> np.ndarray:
    return np.random.default_rng(0).standard_normal((PROBE_ROWS, n_embd)).astype(np.float32)


def invariant(fn: Rows, x: np.ndarray) -> bool:
    """Rows 3.. of every :data:`PROBE_SIZES` call equal the same rows of one call of all of ``x``."""
    full = fn(x)
    return all(np.array_equal(fn(x[3 : 3 + n]), full[3 : 3 + n]) for n in PROBE_SIZES)


def small_limit(fn: Rows, x: np.ndarray, cap: int = 16) -> int:
    """The most rows (up to ``cap``) a call may hold and give each row its one-row bits."""
    alone = np.concatenate([fn(x[i:i + 1]) for i in range(cap)])
    limit = 1
    for n in range(2, cap + 1):
        if not (np.array_equal(fn(x[:n]), alone[:n]) and np.array_equal(fn(x[cap - n:cap]), alone[cap - n:])):
            break
        limit = n
    return limit


def probe_expert_rows(bank: Any, n_layer: int, n_embd: int) -> RowInvariance:
    """Measure ``bank``'s experts, one probe per distinct set of expert tensor types (expert 0 of
    the first layer of each). The numpy kernel is never taken as invariant (OpenBLAS)."""
    if bank.kernel == "numpy":
        return RowInvariance(False, 1)
    layout = getattr(bank, "layout", None)
    kinds_of = getattr(layout, "expert_tensors", {})
    layers = []
    seen = set()
    for il in range(n_layer):
        key = tuple(sorted((k, getattr(t, "ggml_type", None)) for k, t in kinds_of.get(il, {}).items()))
        if key in seen or not bank.holds(il, 0):
            continue
        seen.add(key)
        layers.append(il)
    if not layers:  # nothing held to measure (an empty expert cache): take the safe answer
        return RowInvariance(False, 1)
    x = probe_rows(n_embd)
    if all(invariant(partial(bank.forward, il, 0), x) for il in layers):
        return RowInvariance(True, 1)
    # the failing tensor types (and any others) decide the small-call size
    small = min((small_limit(partial(bank.forward, il, 0), x) for il in layers), default=1)
    return RowInvariance(False, small)
