"""A layer's expert groups, with numpy calls per layer, not per group.

Why: a decode step of 64 sequences on a 256-expert, top-8 model has ~500 (sequence, expert)
pairs a layer. Finding each group's rows with its own ``(ids == e).any(axis=1)`` and ``nonzero``
(and, in the batch-invariant mode, once more per sequence), then scattering each group's outputs
back with a ``nonzero`` of its own, cost ~15% of a 0.3-core backbone's GIL samples with 4 workers
(``bench/device_swarm.py --py-spy``, docs/benchmarks.md "What stops the curve"): Python per
group, paid whether the experts are computed here or on workers. Here one sort of the layer's
(expert, row) pairs gives every group: 4-6x less time (64 decode rows, 256 experts, top-8:
1.66 -> 0.27 ms a layer in the batch-invariant mode). (The combine stays a loop per group: one
scatter of every output measured slower, its temporaries as big as the layer's outputs.)

Same groups, same order as the per-group loops these replace (tests/test_grouping.py compares
them on random routings). The row arrays of the groups are read-only views of one
array: nothing may change a group's rows in place.
"""
from __future__ import annotations

import numpy as np

from p2pswarm.contracts import Groups


def _pairs(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every (expert, row) pair of a routing, each once, sorted by expert then row: (experts, rows)."""
    T = ids.shape[0]
    keys = np.unique(ids.astype(np.int64) * max(T, 1) + np.arange(T, dtype=np.int64)[:, None])
    experts, rows = np.divmod(keys, max(T, 1))
    rows.flags.writeable = False
    return experts, rows


def _runs(values: np.ndarray) -> list[int]:
    """Start positions of the runs of equal values, and the length at the end."""
    if not len(values):
        return [0]
    return np.flatnonzero(np.r_[True, values[1:] != values[:-1]]).tolist() + [len(values)]


#: a one-row routing's row array (read-only): a one-sequence decode step's every group is this row
_ROW0 = np.zeros(1, np.int64)
_ROW0.flags.writeable = False


def expert_groups(ids: np.ndarray) -> Groups:
    """(expert, token indices) for every expert chosen in a layer; experts ascending, tokens in order.
    One row (a one-sequence decode step, every layer every token): the same groups from a set of its
    ids, without the sort's numpy calls (~19 -> ~2 us a layer)."""
    if ids.shape[0] == 1:
        return [(e, _ROW0[:]) for e in sorted(set(ids[0].tolist()))]
    experts, rows = _pairs(ids)
    at = _runs(experts)
    return [(int(experts[a]), rows[a:b]) for a, b in zip(at[:-1], at[1:])]


def invariant_groups(ids: np.ndarray, spans: list[slice], limit: int) -> Groups:
    """One group per (sequence, expert) (``spans``: each sequence's rows), except that sequences'
    groups of one expert with at most ``limit`` rows each are merged, in span order, while the
    merged group stays that small; sorted by (expert, first row). (The batch-invariant mode's
    groups: :meth:`Backbone._invariant_groups` says why that is exact.)"""
    T = ids.shape[0]
    seq = np.full(T, -1, np.int64)
    for i, sp in enumerate(spans):
        seq[sp] = i
    experts, rows = _pairs(ids)
    seqs = seq[rows]
    keep = seqs >= 0  # (rows outside every span are in no group)
    order = np.lexsort((rows[keep], seqs[keep], experts[keep]))
    experts, rows, seqs = experts[keep][order], rows[keep][order], seqs[keep][order]
    rows.flags.writeable = False
    at = _runs(experts * (len(spans) + 1) + seqs)  # runs of one (expert, sequence)
    exp_at = experts[at[:-1]].tolist() if len(experts) else []
    packed: list[tuple[int, list[tuple[int, int]]]] = []  # (expert, [(start, end) of its runs])
    big: list[tuple[int, int, int]] = []
    last_e, last_n = -1, 0
    for e, a, b in zip(exp_at, at[:-1], at[1:]):
        n = b - a
        if n > limit:
            big.append((e, a, b))
            continue
        if e == last_e and packed and last_n + n <= limit:
            packed[-1][1].append((a, b))
            last_n += n
        else:
            packed.append((e, [(a, b)]))
            last_e, last_n = e, n
    groups: Groups = [(e, rows[a:b]) for e, a, b in big]
    for e, parts in packed:
        if all(parts[i][1] == parts[i + 1][0] for i in range(len(parts) - 1)):
            groups.append((e, rows[parts[0][0]:parts[-1][1]]))
        else:  # (a big run of the expert lies between: not one slice)
            groups.append((e, np.concatenate([rows[a:b] for a, b in parts])))
    groups.sort(key=lambda g: (g[0], int(g[1][0])))
    return groups


def one_row_spans(sp: slice) -> list[slice]:
    """``sp`` cut into one-row spans."""
    return [slice(i, i + 1) for i in range(sp.start, sp.stop)]


def renumbered(ospans: list[list[slice]]) -> list[list[slice]]:
    """Each item's out spans as positions in the concatenation of all items' out rows, in order."""
    at, out = 0, list[list[slice]]()
    for item in ospans:
        out.append([])
        for sp in item:
            out[-1].append(slice(at, at + sp.stop - sp.start))
            at += sp.stop - sp.start
    return out
