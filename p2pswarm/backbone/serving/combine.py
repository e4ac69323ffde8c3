"""A layer's routed experts as groups, and their outputs added back in top-k order.

``combine`` sums the weighted expert outputs in top-k order, never in arrival order: that is what
makes the split run bit-identical to the monolithic one whatever the timing. Its own module, below
the layer loop (:mod:`p2pswarm.backbone.serving.runner`) and the MTP drafter (:mod:`p2pswarm.backbone.serving.mtp`),
because both use it and the runner keeps the drafter's hidden rows: in the runner, the drafter
had to import it back lazily (an import cycle)."""
from __future__ import annotations

import threading

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
    y = _slot_buffer(k, T, n_embd)
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
    # slot by slot, each weighted just before it is added (while it is in cache): the products and
    # the sums of y *= weights.T[:, :, None]; acc = y[0] + y[1] + ..., bit for bit, in one pass over y
    for j in range(k):
        yj = y[j]
        yj *= weights[:, j:j + 1]
        if j == 0:
            acc = yj.copy()
        else:
            acc += yj
    return acc


#: the most bytes of (k, T, n_embd) slot outputs a thread keeps between combines (64 MiB: a
#: 640-row step of 3072-wide rows and top-8); a bigger step's gets fresh memory each time
SCRATCH_KEEP_BYTES = 64 << 20
_scratch = threading.local()


def _slot_buffer(k: int, T: int, n_embd: int) -> np.ndarray:
    """A (k, T, n_embd) float32 array for one combine's slot outputs: this thread's kept buffer.
    Why kept: memory new to the process costs a page fault and zeroing on its first write, ~1 ms
    per MiB on this machine's VM against ~0.1 to write memory already mapped, and a fresh array per
    combine (3 MiB at 32 decode rows) was given back to the kernel and faulted in anew each time:
    the combine cost 15-29 us per (expert, row) pair inside a backbone against 3-5 us hot
    (docs/benchmarks.md, issue 46 section 9). A (slot, row) no group fills keeps what the buffer
    held, as np.empty's did: the groups of a routing fill every one."""
    n = k * T * n_embd
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.size < n:
        if 4 * n > SCRATCH_KEEP_BYTES:
            return np.empty((k, T, n_embd), dtype=F32)
        buf = _scratch.buf = np.empty(n, dtype=F32)
    return buf[:n].reshape(k, T, n_embd)


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
