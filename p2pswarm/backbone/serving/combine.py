"""A layer's routed experts as groups, and their outputs added back in top-k order.

``combine`` sums the weighted expert outputs in top-k order, never in arrival order: that is what
makes the split run bit-identical to the monolithic one whatever the timing. Its own module, below
the layer loop (:mod:`p2pswarm.backbone.serving.runner`) and the MTP drafter (:mod:`p2pswarm.backbone.serving.mtp`),
because both use it and the runner keeps the drafter's hidden rows: in the runner, the drafter
had to import it back lazily (an import cycle)."""
from __future__ import annotations

import numpy as np

from p2pswarm.backbone.serving import grouping
from p2pswarm.contracts import Groups

F32 = np.float32


def expert_groups(ids: np.ndarray) -> Groups:
    """(expert, token indices) for every expert chosen in a layer; experts ascending, tokens in order
    (one sort of the layer's pairs, not numpy calls per expert: p2pswarm.backbone.serving.grouping)."""
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
    # Each output row goes to (its top-k slot, its row). The slots of all groups' rows come from
    # one comparison of the layer's (row, expert) pairs, and each group is then one assignment of
    # its output as it is: not four numpy calls and a copy of the output per group (a layer has
    # hundreds of small groups; the per-group calls were most of the combine's time with workers).
    every = np.concatenate([rows for _, rows in groups])
    match = ids[every] == np.repeat(np.array([e for e, _ in groups], dtype=ids.dtype),
                                    [len(rows) for _, rows in groups])[:, None]
    if (match.sum(axis=1) == 1).all():  # every row of a group chose its expert once (top-k: always)
        slots = match.argmax(axis=1)
        at = 0
        for (_, rows), out in zip(groups, outs):
            n = len(rows)
            y[slots[at:at + n], rows] = out
            at += n
    else:  # (a row that did not choose its group's expert, or chose it twice: only its matches)
        for (e, rows), out in zip(groups, outs):
            r, slot = np.nonzero(ids[rows] == e)
            y[slot, rows[r]] = out[r]
    y *= weights.T[:, :, None]
    acc = y[0].copy()
    for j in range(1, k):
        acc += y[j]
    return acc


def combine_rows(ids: np.ndarray, weights: np.ndarray, groups: Groups, outs: list[np.ndarray],
                 rows: np.ndarray) -> np.ndarray:
    """:func:`combine_outputs` of rows ``rows`` of the step only (ascending; the groups may hold
    other rows too, and need not cover those others): the same bits for those rows, row by row."""
    where = np.full(ids.shape[0], -1, np.int64)
    where[rows] = np.arange(len(rows))
    sub_groups, sub_outs = [], []
    for (e, r), out in zip(groups, outs):
        keep = where[r] >= 0
        if keep.any():
            sub_groups.append((e, where[r[keep]]))
            sub_outs.append(out[keep])
    return combine_outputs(ids[rows], weights[rows], sub_groups, sub_outs)
