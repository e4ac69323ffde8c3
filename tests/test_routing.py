"""The shared router (p2pswarm.engine.routing): every gating variant llama.cpp's build_moe_ffn has for
the archs we serve, its GGUF keys and their checks.

The variants are checked against a second, deliberately plain implementation (row by row, Python
lists, the formulas of DeepSeek-V3's reference modeling code) and on hand-made cases whose answer is
known; the softmax case against the qwen router it must equal bit for bit."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from p2pswarm.engine import ops
from p2pswarm.engine.arch.deepseek2 import DeepSeek2
from p2pswarm.engine.arch.glm4moe import Glm4MoE
from p2pswarm.engine.routing import NORM_MIN, RouterSpec, no_experts, route
from p2pswarm.errors import ModelFormatError
from p2pswarm.model.layout import ModelLayout

F32 = np.float32


def plain_route(logits, spec: RouterSpec, bias):
    """Row by row, lists: the reference the vectorised router is checked against."""
    ids_all, w_all = [], []
    for row in np.asarray(logits, dtype=F32):
        if spec.gating == "softmax":
            e = np.exp(row - row.max())
            probs = e / e.sum()
        else:
            probs = F32(1) / (F32(1) + np.exp(-row))
        sel = [float(p) + (0.0 if bias is None else float(b)) for p, b in
               zip(probs, bias if bias is not None else [0] * len(probs))]
        sel = [float(F32(s)) for s in sel]
        allowed = set(range(spec.n_expert))
        if spec.n_group > 1:
            per = spec.n_expert // spec.n_group
            scores = []
            for g in range(spec.n_group):
                top = sorted(sel[g * per:(g + 1) * per], reverse=True)[:2]
                scores.append((float(F32(top[0] + top[1])), g))
            kept = sorted(scores, key=lambda s: (-s[0], s[1]))[: spec.n_group_used]
            allowed = {g * per + j for _, g in kept for j in range(per)}
        ranked = sorted(allowed, key=lambda e: (-sel[e], e))[: spec.n_expert_used]
        w = [probs[e] for e in ranked]
        if spec.norm_weights:
            w = [x / max(sum(w), NORM_MIN) for x in w]
        w = [x * spec.scale for x in w]
        ids_all.append(ranked)
        w_all.append(w)
    return np.array(ids_all), np.array(w_all, dtype=np.float64)


def test_softmax_is_the_qwen_router_bit_for_bit():
    rng = np.random.default_rng(1)
    for n, E, k in ((1, 16, 4), (37, 128, 8), (5, 256, 8), (0, 16, 4)):
        logits = rng.standard_normal((n, E)).astype(F32) * 3
        want = ops.route_topk(logits, k)
        got = route(logits, RouterSpec(E, k, "softmax", norm_weights=True))
        assert got[0].dtype == np.int64 and got[1].dtype == F32
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])


@pytest.mark.parametrize("spec", [
    RouterSpec(64, 6, "softmax"),  # DeepSeek-V2-Lite: softmax, no norm, scale 1
    RouterSpec(64, 6, "softmax", n_group=8, n_group_used=3, scale=16.0),  # DeepSeek-V2: groups
    RouterSpec(256, 8, "sigmoid", n_group=8, n_group_used=4, norm_weights=True, scale=2.5),  # V3/R1
    RouterSpec(384, 8, "sigmoid", norm_weights=True, scale=2.827),  # Kimi K2: one group
    RouterSpec(160, 8, "sigmoid", norm_weights=True, scale=2.5),  # GLM-4.5
])
@pytest.mark.parametrize("with_bias", [False, True])
def test_variants_match_the_plain_reference(spec, with_bias):
    rng = np.random.default_rng(spec.n_expert + spec.n_group)
    logits = rng.standard_normal((40, spec.n_expert)).astype(F32) * 2
    bias = (rng.standard_normal(spec.n_expert) * 0.5).astype(F32) if with_bias else None
    ids, w = route(logits, spec, bias)
    ref_ids, ref_w = plain_route(logits, spec, bias)
    assert ids.shape == w.shape == (40, spec.n_expert_used)
    assert np.array_equal(ids, ref_ids)
    np.testing.assert_allclose(w, ref_w, rtol=2e-6, atol=0)
    if spec.n_group > 1:  # every row's experts lie in at most n_group_used groups
        per = spec.n_expert // spec.n_group
        assert max(len(set((row // per).tolist())) for row in ids) <= spec.n_group_used


def test_bias_picks_but_does_not_weigh():
    """The score-correction bias changes which experts win; their weights are the unbiased
    sigmoid probabilities, normalised and scaled."""
    logits = np.array([[2.0, 1.0, 0.0, -1.0]], F32)
    spec = RouterSpec(4, 2, "sigmoid", norm_weights=False, scale=1.0)
    assert route(logits, spec)[0].tolist() == [[0, 1]]
    bias = np.array([0.0, 0.0, 0.0, 1.0], F32)  # sigmoid(-1) + 1 = 1.27 beats sigmoid(1) = 0.73
    ids, w = route(logits, spec, bias)
    assert ids.tolist() == [[3, 0]]
    assert np.array_equal(w, ops.sigmoid(logits)[:, [3, 0]])
    ids, w2 = route(logits, RouterSpec(4, 2, "sigmoid", norm_weights=True, scale=2.5), bias)
    p = ops.sigmoid(logits)[0, [3, 0]]
    assert np.array_equal(w2[0], (p / np.sum(p)) * F32(2.5))


def test_group_limit_can_drop_the_best_expert():
    """Groups rank by the sum of their two best scores, so a group with one outstanding expert can
    lose to groups with two good ones, and that expert is not chosen."""
    # 4 groups of 2, sigmoid scores: group 0 = 0.993 + 0.000, group 1 = 2 x 0.881, group 2 =
    # 2 x 0.818, group 3 = 2 x 0.5: groups 1 and 2 are kept, expert 0 (the best) is not
    logits = np.array([[5.0, -9.0, 2.0, 2.0, 1.5, 1.5, 0.0, 0.0]], F32)
    spec = RouterSpec(8, 2, "sigmoid", n_group=4, n_group_used=2)
    ids, _ = route(logits, spec)
    assert ids.tolist() == [[2, 3]]
    assert route(logits, RouterSpec(8, 2, "sigmoid"))[0].tolist() == [[0, 2]]


def test_ties_keep_the_lower_id():
    logits = np.zeros((3, 8), F32)
    ids, w = route(logits, RouterSpec(8, 3, "sigmoid", norm_weights=True))
    assert ids.tolist() == [[0, 1, 2]] * 3 and np.allclose(w, 1 / 3)
    # tied groups: the lower group wins; inside the kept groups the lower id first
    ids, _ = route(logits, RouterSpec(8, 4, "sigmoid", n_group=4, n_group_used=2))
    assert ids.tolist() == [[0, 1, 2, 3]] * 3
    logits[:, 6:] = 1.0  # group 3 now best, then tied groups 0-2: group 0
    ids, _ = route(logits, RouterSpec(8, 4, "sigmoid", n_group=4, n_group_used=2))
    assert ids.tolist() == [[6, 7, 0, 1]] * 3


def test_norm_sum_is_clamped_and_sigmoid_underflows_quietly():
    logits = np.full((1, 4), -30.0, F32)  # sigmoid ~ 9e-14: the sum is far below 2^-14
    ids, w = route(logits, RouterSpec(4, 2, "sigmoid", norm_weights=True))
    p = ops.sigmoid(logits[0, :2])
    assert ids.tolist() == [[0, 1]] and np.array_equal(w[0], p / NORM_MIN)
    with np.errstate(all="raise"):  # exp(100) overflows: sigmoid 0, as expf gives in C, no warning
        ids, w = route(np.full((1, 4), -100.0, F32), RouterSpec(4, 2, "sigmoid", norm_weights=True))
    assert ids.tolist() == [[0, 1]] and not w.any()


def test_no_experts_shape():
    ids, w = no_experts(5)
    assert ids.shape == w.shape == (5, 0) and ids.dtype == np.int64 and w.dtype == F32


def _layout(arch="glm4moe", **hp) -> ModelLayout:
    base = {"expert_count": 160, "expert_used_count": 8}
    base.update(hp)
    return ModelLayout(path=Path("m.gguf"), reader=None, arch=arch, hparams=base, n_layer=1,
                       n_expert=base["expert_count"], n_expert_used=base["expert_used_count"])


def test_from_layout_reads_the_keys():
    s = RouterSpec.from_layout(_layout(expert_gating_func=2, expert_weights_norm=True, expert_weights_scale=2.5))
    assert s == RouterSpec(160, 8, "sigmoid", 1, 1, True, 2.5)
    assert RouterSpec.from_layout(_layout(), default_gating="sigmoid").gating == "sigmoid"
    assert RouterSpec.from_layout(_layout("deepseek2")) == RouterSpec(160, 8, "softmax")  # softmax unless told
    assert RouterSpec.from_layout(_layout(expert_gating_func=1), default_gating="sigmoid").gating == "softmax"
    # each architecture declares what llama.cpp's loader assumes when the key is absent
    assert (Glm4MoE.DEFAULT_GATING, DeepSeek2.DEFAULT_GATING) == ("sigmoid", "softmax")  # GLM-4.5's; V2's
    s = RouterSpec.from_layout(_layout("deepseek2", expert_count=256, expert_gating_func=2, expert_group_count=8,
                                       expert_group_used_count=4, expert_weights_scale=0.0))
    assert (s.n_group, s.n_group_used, s.scale, s.norm_weights) == (8, 4, 1.0, False)
    assert RouterSpec.from_layout(_layout("qwen3moe"), norm_weights=True).norm_weights


@pytest.mark.parametrize("hp, key", [
    (dict(expert_group_count=7, expert_group_used_count=2), "expert_group_count"),  # 160 % 7
    (dict(expert_group_count=160, expert_group_used_count=2), "expert_group_count"),  # 1 per group
    (dict(expert_group_count=8, expert_group_used_count=9), "expert_group_used_count"),
    (dict(expert_group_count=8, expert_group_used_count=0), "expert_group_used_count"),
    (dict(expert_group_count=40, expert_group_used_count=1), "expert_group_used_count"),  # 4 < top-8
    (dict(expert_used_count=161), "expert_used_count"),
    (dict(expert_used_count=0), "expert_used_count"),
    (dict(expert_gating_func=4), "expert_gating_func"),
    (dict(expert_weights_scale=float("nan")), "expert_weights_scale"),
    (dict(expert_used_count=[8, 6]), "expert_used_count"),
])
def test_from_layout_refuses_inconsistent_keys(hp, key):
    with pytest.raises(ModelFormatError) as exc:
        RouterSpec.from_layout(_layout(**hp))
    msg = str(exc.value)
    assert f"glm4moe.{key} " in msg and "\n" not in msg
