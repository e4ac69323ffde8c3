"""p2pswarm.backbone.serving.combine against the per-group loop it replaced: the same bits on random
routings (one group per expert, several groups of one expert as the batch-invariant mode makes
them, an expert twice in one row), since split == monolithic rests on the combine's order."""
from __future__ import annotations

import numpy as np
import pytest

from p2pswarm.backbone.serving import grouping
from p2pswarm.backbone.serving.combine import combine_outputs


def loop_combine(ids, weights, groups, outs):
    """The combine as it was: four numpy calls and a copy of the output per group."""
    T, k = ids.shape
    y = np.empty((k, T, outs[0].shape[1]), dtype=np.float32)
    for (e, rows), out in zip(groups, outs):
        r, slot = np.nonzero(ids[rows] == e)
        y[slot, rows[r]] = out[r]
    y *= weights.T[:, :, None]
    acc = y[0].copy()
    for j in range(1, k):
        acc += y[j]
    return acc


@pytest.mark.parametrize("seed", range(8))
def test_combine_equals_the_per_group_loop(seed):
    rng = np.random.default_rng(seed)
    T, n_expert, k = int(rng.integers(1, 70)), int(rng.choice([8, 64, 256])), int(rng.choice([1, 2, 8]))
    ids = np.stack([rng.choice(n_expert, k, replace=False) for _ in range(T)]).astype(np.int32)
    if seed % 4 == 3 and k > 1:
        ids[rng.integers(T), 1] = ids[rng.integers(T), 0]  # an expert twice in a row: the fallback's case
    weights = rng.random((T, k)).astype(np.float32)
    bounds = np.unique(np.concatenate([[0, T], rng.integers(0, T, 3)]))
    spans = [slice(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]
    for groups in (grouping.expert_groups(ids), grouping.invariant_groups(ids, spans, 2)):
        outs = [rng.standard_normal((len(rows), 48)).astype(np.float32) for _, rows in groups]
        want = loop_combine(ids, weights, groups, outs)
        got = combine_outputs(ids, weights, groups, outs)
        assert got.dtype == np.float32 and got.tobytes() == want.tobytes()


def test_kept_slot_buffer_gives_the_same_bits_across_sizes_and_threads(monkeypatch):
    """The slot outputs live in a buffer each thread keeps (combine._slot_buffer): calls of other
    sizes before, between and after, in another thread at the same time, and a step too big to
    keep, all give the per-group loop's bits; a thread's second call reuses its memory."""
    import threading

    from p2pswarm.backbone.serving import combine

    rng = np.random.default_rng(7)

    def case(T):
        ids = np.stack([rng.choice(64, 8, replace=False) for _ in range(T)]).astype(np.int32)
        weights = rng.random((T, 8)).astype(np.float32)
        groups = grouping.invariant_groups(ids, [slice(0, T // 2), slice(T // 2, T)], 3)
        outs = [rng.standard_normal((len(rows), 32)).astype(np.float32) for _, rows in groups]
        return ids, weights, groups, outs, loop_combine(ids, weights, groups, outs).tobytes()

    cases = [case(T) for T in (40, 3, 17, 40, 64)]
    errors: list[str] = []

    def run_all():
        for ids, weights, groups, outs, want in cases:
            if combine_outputs(ids, weights, groups, outs).tobytes() != want:
                errors.append(f"{threading.current_thread().name}: {ids.shape[0]} rows differ")

    others = [threading.Thread(target=run_all) for _ in range(2)]
    for t in others:
        t.start()
    run_all()
    for t in others:
        t.join()
    assert not errors
    a, b = combine._slot_buffer(8, 10, 32), combine._slot_buffer(8, 20, 32)
    assert np.shares_memory(a, b)  # kept: no fresh pages for the second
    monkeypatch.setattr(combine, "SCRATCH_KEEP_BYTES", 1024)  # every one too big to keep: fresh arrays
    run_all()
    assert not errors
