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
