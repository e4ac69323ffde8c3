"""A layer's routed experts as groups, and their outputs added back in top-k order.

``combine`` sums the weighted expert outputs in top-k order, never in arrival order: that is what
makes the split run bit-identical to the monolithic one whatever the timing. Its own module, below
the layer loop (:mod:`p2pswarm.backbone.runner`) and the MTP drafter (:mod:`p2pswarm.backbone.mtp`),
because both use it and the runner keeps the drafter's hidden rows: in the runner, the drafter
had to import it back lazily (an import cycle)."""
from __future__ import annotations

import numpy as np

from p2pswarm.backbone import grouping
from p2pswarm.contracts import Groups

F32 = np.float32


def expert_groups(ids: np.ndarray) -> Groups:
    """(expert, token indices) for every expert chosen in a layer; experts ascending, tokens in order
    (one sort of the layer's pairs, not numpy calls per expert: p2pswarm.backbone.grouping)."""
    return grouping.expert_groups(ids)


def combine(ids: np.ndarray, weights: np.ndarray, groups: Groups, partials: dict[int, np.ndarray]) -> np.ndarray:
    """sum_j w[t, j] * out_{ids[t, j]}[t], summed ((y0 + y1) + y2) + ... in top-k order."""
    return combine_outputs(ids, weights, groups, [partials[e] for e, _ in groups])


def combine_outputs(ids: np.ndarray, weights: np.ndarray, groups: Groups, outs: list[np.ndarray]) -> np.ndarray:
    """:func:`combine` with one output per group, in group order: an expert may have several groups
    (one per sequence in a batch-invariant step), each covering its own rows."""
    T, k = ids.shape
    n_embd = outs[0].shape[1]
    y = np.empty((k, T, n_embd), dtype=F32)
    for (e, rows), out in zip(groups, outs):
        r, slot = np.nonzero(ids[rows] == e)
        y[slot, rows[r]] = out[r]
    y *= weights.T[:, :, None]
    acc = y[0].copy()
    for j in range(1, k):
        acc += y[j]
    return acc
