"""p2pswarm.backbone.serving.grouping against the per-group loops it replaced: same groups (experts and
rows), same order, on random routings (duplicated experts in a row, empty spans' neighbours, big and small
groups of one expert interleaved)."""
from __future__ import annotations

import numpy as np
import pytest

from p2pswarm.backbone.serving import grouping


def loop_expert_groups(ids):
    return [(int(e), np.nonzero((ids == e).any(axis=1))[0]) for e in np.unique(ids)]


def loop_invariant_groups(ids, spans, limit):
    groups, packs = [], {}
    for sp in spans:
        for e, idx in loop_expert_groups(ids[sp]):
            idx = idx + sp.start
            if len(idx) > limit:
                groups.append((e, idx))
                continue
            mine = packs.setdefault(e, [])
            if mine and len(mine[-1]) + len(idx) <= limit:
                mine[-1] = np.concatenate([mine[-1], idx])
            else:
                mine.append(idx)
    groups += [(e, idx) for e, mine in packs.items() for idx in mine]
    groups.sort(key=lambda g: (g[0], int(g[1][0])))
    return groups


def same_groups(a, b):
    assert [e for e, _ in a] == [e for e, _ in b]
    for (_, x), (_, y) in zip(a, b):
        assert x.tolist() == y.tolist()


def routing(rng, T, n_expert, k, dup=False):
    ids = np.stack([rng.choice(n_expert, k, replace=False) for _ in range(T)]).astype(np.int32)
    if dup and T:
        ids[rng.integers(T), 1] = ids[rng.integers(T), 0]  # an expert twice in one row
    return ids


@pytest.mark.parametrize("seed", range(6))
def test_groups_equal_the_loops(seed):
    rng = np.random.default_rng(seed)
    T = int(rng.integers(1, 80))
    n_expert, k = int(rng.choice([4, 16, 256])), 4 if seed % 2 else 8
    k = min(k, n_expert)
    ids = routing(rng, T, n_expert, k, dup=seed == 3)
    same_groups(grouping.expert_groups(ids), loop_expert_groups(ids))
    cuts = np.sort(rng.choice(np.arange(1, T), size=min(T - 1, int(rng.integers(0, 12))), replace=False)) if T > 1 else []
    bounds = [0, *map(int, cuts), T]
    spans = [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]
    for limit in (1, 2, 3, 8, 64):
        same_groups(grouping.invariant_groups(ids, spans, limit), loop_invariant_groups(ids, spans, limit))


def test_big_group_between_small_ones_of_the_same_expert():
    # expert 0: 1 row in sequence 0, 3 rows in sequence 1 (> limit 2), 1 row in sequence 2
    ids = np.array([[0, 1], [0, 2], [0, 3], [0, 4], [0, 5]], np.int32)
    spans = [slice(0, 1), slice(1, 4), slice(4, 5)]
    got = grouping.invariant_groups(ids, spans, 2)
    same_groups(got, loop_invariant_groups(ids, spans, 2))
    assert [(e, idx.tolist()) for e, idx in got][:2] == [(0, [0, 4]), (0, [1, 2, 3])]


def test_group_rows_are_read_only():
    ids = np.array([[0, 1], [1, 2]], np.int32)
    e, rows = grouping.expert_groups(ids)[0]
    with pytest.raises(ValueError):
        rows[0] = 5


@pytest.mark.parametrize("k", [1, 4, 8])
def test_one_row_groups_equal_the_sort(k):
    """A decode step's one row takes a set, not the sort: same groups, same order, int64 rows that
    cannot be written (an expert twice in the row included)."""
    rng = np.random.default_rng(k)
    for _ in range(50):
        ids = routing(rng, 1, 128, k, dup=k > 1 and rng.random() < 0.3).astype(rng.choice([np.int32, np.int64]))
        got = grouping.expert_groups(ids)
        experts, rows = grouping._pairs(ids)
        at = grouping._runs(experts)
        same_groups(got, [(int(experts[a]), rows[a:b]) for a, b in zip(at[:-1], at[1:])])
        same_groups(got, loop_expert_groups(ids))
        for _, r in got:
            assert r.dtype == np.int64 and not r.flags.writeable


class _Bank:
    """What ExpertsInFront.of asks of a bank: which experts it holds, their local ids."""
    expert_begin = 0

    def holds(self, layer, e):
        return e < 100

    def local_ids(self, experts, sizes):
        return np.repeat(np.array(experts, np.int32), sizes)


def _front_fields(ids, weights, groups):
    from p2pswarm.engine.experts.ggml_bank import ExpertsInFront

    h = np.zeros((ids.shape[0], 8), np.float32)
    f = ExpertsInFront.of(_Bank(), 0, h, h, ids, weights, groups, {})
    return None if f is None else (f.rows.tolist(), f.local.tolist(), f.sel.tolist(), f.weights.tolist(), f.P)


def test_experts_in_front_of_one_row_is_the_pairs_of_any_rows():
    """The one-row path of ExpertsInFront.of gives the general path's pairs: row 0 of a 2-row step
    whose row 1 repeats row 0's choice (the general path, its pairs restricted to row 0) and the
    refusals (an expert twice in the row, a slot without its group, a group the row did not choose)."""
    rng = np.random.default_rng(0)
    for _ in range(30):
        ids = rng.choice(100, 4, replace=False).reshape(1, 4)
        w = rng.random((1, 4)).astype(np.float32)
        got = _front_fields(ids, w, grouping.expert_groups(ids))
        two = np.concatenate([ids, ids])
        rows, local, sel, weights, P = _front_fields(two, np.concatenate([w, w]), grouping.expert_groups(two))
        # the 2-row pairs are (group, row) in group order: the row-0 pair of group j is at 2j
        assert got == ([0] * 4, local[::2], [s // 2 for s in sel[::2]], [weights[0][::2]], P // 2)
    ids = np.array([[5, 7, 9, 11]])
    w = np.ones((1, 4), np.float32)
    groups = grouping.expert_groups(ids)
    assert _front_fields(np.array([[5, 7, 9, 9]]), w, groups) is None  # an expert twice, 11 not chosen
    assert _front_fields(ids, w, groups[:3]) is None  # slot of 11 without its group
    assert _front_fields(ids, w, groups[:3] + [(12, groups[3][1])]) is None  # 12 not chosen
