"""The ggml kernel's gated-attention layer as one graph (p2pswarm/engine/ggml/attention.py).

* With the ggml kernel a qwen35moe attention layer's ``pre_moe_batch`` is ONE graph run (one
  ``runner.compute``), numpy's attention never runs, and it matches the per-piece path.
* A sequence alone == the same sequence batched beside others of different lengths, prefill and
  decode rows mixed, KV caches growing past their capacity mid-call: bit for bit.
* F32, F16, Q8_0 and Q4_K_M, teacher-forced from llama.cpp's own input to the layer: its output (attention +
  residual) against llama.cpp's ``attn_residual``, for the graph and the per-piece path.
"""
from __future__ import annotations

import numpy as np
import pytest

from p2pswarm.backbone.serving.runner import probe_dense_invariance
from p2pswarm.engine.ggml import attention as ggml_attention
from p2pswarm.engine import ops
from p2pswarm.engine.arch import load_dense
from p2pswarm.model.layout import ModelLayout
from p2pswarm.model.synth import make_model

from conftest import needs_llama
from helpers.ggml import needs_ggml
from helpers.llama_ref import llama_intermediates

pytestmark = needs_ggml
F32 = np.float32
TOKENS = [5, 211, 37, 90, 14, 14, 14, 302, 8, 66, 129, 3, 250, 77, 41, 19, 180, 222, 6, 51, 97, 140, 12, 260]


def _model(models_dir, qtype: str, kernel: str = "ggml"):
    path = models_dir / f"q35-attn-{qtype}.gguf"
    if not path.exists():
        make_model(path, arch="qwen35moe", preset="tiny", seed=41, **({} if qtype == "f32" else {"qtype": qtype}))
    model = load_dense(ModelLayout.open(path), kernel)
    return model, next(il for il in range(model.n_layer) if not model.recurrent[il])


def _counting(model, monkeypatch):
    """Count graph runs of the dense runner and make numpy's attention fail if it is reached."""
    runner = model.backend.runner
    runs = [0]
    compute = runner.compute

    def counted(graph, macs):
        runs[0] += 1
        return compute(graph, macs)

    monkeypatch.setattr(runner, "compute", counted)

    def no_numpy(*a, **k):
        raise AssertionError("numpy attention ran under the ggml kernel")

    monkeypatch.setattr(ops, "attention", no_numpy)
    return runs


@pytest.mark.parametrize("qtype", ["q8_0", "f32"])
def test_attention_layer_is_one_graph(models_dir, qtype, monkeypatch):
    model, il = _model(models_dir, qtype)
    rng = np.random.default_rng(3)
    h = rng.standard_normal((9, model.n_embd)).astype(F32)
    # the per-piece path (numpy between ggml graphs) on the same rows, for comparison
    model.attention_graph = False
    st_ref = model.new_state()
    want = [model.pre_moe(il, h[:6], st_ref, 0), model.pre_moe(il, h[6:7], st_ref, 6),
            model.pre_moe(il, h[7:9], st_ref, 7)]
    model.attention_graph = True
    assert ggml_attention.available(model.backend.runner)
    runs = _counting(model, monkeypatch)
    st = model.new_state()
    got = []
    for a, b in ((0, 6), (6, 7), (7, 9)):  # prefill, one decode row, two more
        before = runs[0]
        got.append(model.pre_moe(il, h[a:b], st, a))
        assert runs[0] - before == 1, "one graph per layer call"
    assert st.kv[il].n == 9
    for g, w in zip(got, want):
        # same function as the per-piece path, up to float rounding (Q8_0 rounds the projections'
        # inputs, which usually hides it)
        assert np.allclose(g, w, rtol=1e-5, atol=1e-5), float(np.abs(g - w).max())
    # keys/values in the cache are the ones the per-piece path stores (RoPE'd, normed)
    assert np.allclose(st.kv[il].k[:9], st_ref.kv[il].k[:9], rtol=1e-5, atol=1e-5)
    assert np.allclose(st.kv[il].v[:9], st_ref.kv[il].v[:9], rtol=1e-5, atol=1e-5)


def test_alone_equals_batched_bit_for_bit(models_dir, monkeypatch):
    """Four sequences of different lengths, three calls: prefill chunks and decode rows mixed, one
    sequence's cache growing past its 64 positions inside a batched call."""
    model, il = _model(models_dir, "q8_0")
    runs = _counting(model, monkeypatch)
    E = model.n_embd
    rng = np.random.default_rng(7)
    schedule = [[(0, 60), (1, 3), (2, 1)], [(0, 10), (1, 1), (2, 5), (3, 7)], [(0, 1), (1, 1), (3, 1), (2, 2)]]
    rows = {(i, s): rng.standard_normal((n, E)).astype(F32) for i, step in enumerate(schedule) for s, n in step}
    states, pos = {}, {}
    batched = {}
    for i, step in enumerate(schedule):
        h = np.concatenate([rows[(i, s)] for s, _ in step])
        segs = [(states.setdefault(s, model.new_state()), pos.get(s, 0), n) for s, n in step]
        before = runs[0]
        out = model.pre_moe_batch(il, h, segs)
        assert runs[0] - before == 1  # every sequence of the step in one graph
        at = 0
        for s, n in step:
            batched[(i, s)] = out[at:at + n]
            at += n
            pos[s] = pos.get(s, 0) + n
    assert states[0].kv[il].n == 71 and states[0].kv[il].k.shape[0] >= 71
    for s in range(4):
        st, p = model.new_state(), 0
        for i, step in enumerate(schedule):
            for s2, n in step:
                if s2 == s:
                    alone = model.pre_moe(il, rows[(i, s)], st, p)
                    assert np.array_equal(alone, batched[(i, s)]), (i, s)
                    p += n
    # and the backbone's probe agrees: this layer's layer_in may be batched in the invariant mode
    assert probe_dense_invariance(model, il).layer_in


@pytest.mark.slow
@needs_llama
@pytest.mark.parametrize("qtype", ["f32", "f16", "q8_0", "q4_k_m"])
def test_layer_against_llama_cpp(models_dir, qtype):
    """The attention layer on llama.cpp's own input to it: our attn + residual against llama.cpp's
    ``attn_residual``, the one graph and the per-piece path each. On quantised weights the graph
    rounds the projections' inputs as llama.cpp does (ggml's own mul_mat), so it lands within
    float rounding of llama.cpp there too."""
    model, il = _model(models_dir, qtype)
    names = {f"l_out-{il - 1}", f"attn_residual-{il}", f"attn_post_norm-{il}"}
    cap = llama_intermediates(model.layout.path, TOKENS, names)
    h_in, ref, ref_cur = cap[f"l_out-{il - 1}"], cap[f"attn_residual-{il}"], cap[f"attn_post_norm-{il}"]
    diffs = {}
    for graph in (True, False):
        model.attention_graph = graph
        got = model.pre_moe(il, h_in, model.new_state(), 0)
        cur = model.ffn_input(il, got)
        diffs[graph] = [(float(np.abs(a - b).max()), float(np.linalg.norm(a - b) / np.linalg.norm(b)))
                        for a, b in ((got, ref), (cur, ref_cur))]
    for i, what in enumerate(("attn_residual", "attn_post_norm")):
        (g, gr), (p, pr) = diffs[True][i], diffs[False][i]
        print(f"\n{qtype} attention layer {il} vs llama.cpp {what} ({len(TOKENS)} tokens): one graph max |diff| "
              f"{g:.3g} (rel {gr:.2e}); per-piece {p:.3g} (rel {pr:.2e})", end="")
        assert gr < 1e-5 and g < 1e-4


def test_ffn_input_comes_from_the_layer_graph(models_dir, monkeypatch):
    """post_attention_norm is computed in the layer's graph and handed out by ``layer_in`` with the
    h it returned (no graph of its own); ffn_input alone, on that h or rows of it, runs a graph of
    its own with the same bits, close to numpy's RMSNorm."""
    model, il = _model(models_dir, "q8_0")
    runs = _counting(model, monkeypatch)
    h_in = np.random.default_rng(5).standard_normal((7, model.n_embd)).astype(F32)
    lin = model.layer_in(il, h_in, [(model.new_state(), 0, 7)])
    assert runs[0] == 1  # one graph: the norm (and the router) came with the layer's
    h, cur = lin.h, lin.cur
    got = [model.ffn_input(il, h[a:b]) for a, b in ((0, 2), (2, 3), (3, 7))]
    assert runs[0] == 4 and np.array_equal(np.concatenate(got), cur)
    assert np.array_equal(model.ffn_input(il, h), cur)
    want = ops.rms_norm(h, np.asarray(model.w[f"blk.{il}.post_attention_norm.weight"]), model.eps)
    assert np.allclose(cur, want, rtol=1e-5, atol=1e-6)
