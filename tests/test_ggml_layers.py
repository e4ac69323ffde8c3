"""The ggml kernel's one-graph DeltaNet layer (p2pswarm/engine/arch/qwen35moe/deltanet_graph.py).

- a qwen35moe DeltaNet layer's whole ``pre_moe_batch`` (all sequences) is ONE ggml graph compute,
  and it is what runs under the ggml kernel;
- it computes what the per-piece path computes (output, conv rows, recurrent state), to float
  rounding, over several steps of prefill and decode;
- a sequence alone gives the bits it gets in a batch of several, output and state, step by step
  (Q8_0: libggml's mat-muls are row-invariant there);
- a libggml without one of the graph's ops keeps the per-piece path;
- ``layer_in`` takes the experts' input, the router's logits and the shared expert from the graph.
"""
from __future__ import annotations

import numpy as np
import pytest

from p2pswarm.engine.ggml import runner as ggml_runner
from p2pswarm.engine.arch import load_dense
from p2pswarm.model.layout import ModelLayout
from p2pswarm.model.synth import make_model
from helpers.ggml import needs_ggml

pytestmark = needs_ggml
SIZES = [1, 1, 1, 5, 3, 3, 1]  # rows per sequence: runs of decode and prefill rows side by side


@pytest.fixture(scope="module")
def q35_q8(tmp_path_factory):
    path = tmp_path_factory.mktemp("layers") / "q35-q8.gguf"
    make_model(path, arch="qwen35moe", preset="tiny", qtype="q8_0", seed=31)
    return path


@pytest.fixture(scope="module")
def q35_f32(tmp_path_factory):
    path = tmp_path_factory.mktemp("layers") / "q35-f32.gguf"
    make_model(path, arch="qwen35moe", preset="tiny", seed=31)
    return path


def _model(path):
    model = load_dense(ModelLayout.open(path), "ggml")
    assert model.backend.tensors > 0
    return model


def _f32_model(path):
    """An F32 file: the ggml dense path takes no matrix (nothing is quantised); the layer graph maps
    the F32 tensors itself."""
    model = load_dense(ModelLayout.open(path), "ggml")
    assert model.backend.tensors == 0 and model.backend.ggml is not None
    return model


def _counting(monkeypatch):
    calls = [0]
    real = ggml_runner.GgmlRunner.compute

    def compute(self, graph, macs):
        calls[0] += 1
        return real(self, graph, macs)

    monkeypatch.setattr(ggml_runner.GgmlRunner, "compute", compute)
    return calls


def _rows(rng, model, steps):
    return [rng.standard_normal((sum(SIZES), model.n_embd)).astype(np.float32) for _ in range(steps)]


@pytest.mark.parametrize("qtype", ["f32", "q8_0"])
def test_deltanet_layer_is_one_graph_and_the_per_piece_math(request, qtype, monkeypatch):
    """F32: the same function to float rounding. Q8_0: both round the activations to Q8_0 before
    each mat-mul (llama.cpp's numerics), where a last-bit difference upstream can flip a rounded
    value, so the layer agrees to ~1e-4 relative, not to the last bit."""
    path = request.getfixturevalue("q35_q8" if qtype == "q8_0" else "q35_f32")
    model, ref = (_model(path), _model(path)) if qtype == "q8_0" else (_f32_model(path), _f32_model(path))
    ref._layer_graph = lambda il, segments: None  # the per-piece path (fused mat-muls, op, numpy)
    il = model.recurrent.index(True)
    states = [model.new_state() for _ in SIZES]
    ref_states = [ref.new_state() for _ in SIZES]
    calls = _counting(monkeypatch)
    for step, h in enumerate(_rows(np.random.default_rng(3), model, 3)):
        before, graphs = model.layer_graph_calls, calls[0]
        got = model.pre_moe_batch(il, h, [(s, 0, n) for s, n in zip(states, SIZES)])
        assert calls[0] - graphs == 1 and model.layer_graph_calls == before + 1, "not one graph"
        graphs = calls[0]
        want = ref.pre_moe_batch(il, h, [(s, 0, n) for s, n in zip(ref_states, SIZES)])
        # what it replaces: fused projections, delta rule, output projection (F32: numpy mat-muls)
        assert calls[0] - graphs == (3 if qtype == "q8_0" else 1)
        assert got.shape == want.shape and got.dtype == np.float32
        delta = np.abs(want - h).max()
        assert delta > 1e-2  # the layer does something
        if qtype == "f32":
            assert np.abs(got - want).max() <= 1e-5 * delta, step
        else:
            assert np.linalg.norm(got - want) <= 1e-3 * np.linalg.norm(want - h), step
        for a, b in zip(states, ref_states):
            sa, sb = a.extra[il], b.extra[il]
            assert np.abs(sa.conv - sb.conv).max() <= 1e-5 * np.abs(sb.conv).max(), step
            assert np.abs(sa.S - sb.S).max() <= 1e-4 * np.abs(sb.S).max(), step
            assert np.abs(sb.S).max() > 0 and np.abs(sb.conv).max() > 0


def test_deltanet_layer_graph_alone_equals_batched_bit_for_bit(q35_q8):
    model = _model(q35_q8)
    il = model.recurrent.index(True)
    batched = [model.new_state() for _ in SIZES]
    alone = [model.new_state() for _ in SIZES]
    for step, h in enumerate(_rows(np.random.default_rng(5), model, 3)):
        got = model.pre_moe_batch(il, h, [(s, 0, n) for s, n in zip(batched, SIZES)])
        at = 0
        for st, n in zip(alone, SIZES):
            one = model.pre_moe_batch(il, h[at:at + n], [(st, 0, n)])
            assert np.array_equal(one, got[at:at + n]), (step, n)
            at += n
        for a, b in zip(batched, alone):
            assert np.array_equal(a.extra[il].S, b.extra[il].S) and np.array_equal(a.extra[il].conv, b.extra[il].conv)


def test_a_library_without_an_op_keeps_the_per_piece_path(q35_q8, monkeypatch):
    model = _model(q35_q8)
    il = model.recurrent.index(True)
    monkeypatch.setattr(model.backend.ggml.lib, "ssm_conv", None)
    h = _rows(np.random.default_rng(7), model, 1)[0]
    out = model.pre_moe_batch(il, h, [(model.new_state(), 0, n) for n in SIZES])
    assert model.layer_graph_calls == 0 and np.isfinite(out).all()


@pytest.mark.parametrize("sizes", [[3] * 64, [1] * 256, [2, 1] * 60])
def test_many_sequences_in_one_layer_graph(q35_q8, sizes):
    """The graph's tensor budget holds for the issue's 256 rows and long runs of equal prefills (a
    budget overrun would abort the process, not raise); the first sequences equal themselves alone."""
    model = _model(q35_q8)
    il = model.recurrent.index(True)
    h = np.random.default_rng(len(sizes)).standard_normal((sum(sizes), model.n_embd)).astype(np.float32)
    out = model.pre_moe_batch(il, h, [(model.new_state(), 0, n) for n in sizes])
    assert model.layer_graph_calls == 1 and np.isfinite(out).all()
    at = 0
    for n in sizes[:3]:
        assert np.array_equal(model.pre_moe_batch(il, h[at:at + n], [(model.new_state(), 0, n)]), out[at:at + n])
        at += n


def test_a_misaligned_state_takes_the_per_piece_path(q35_q8):
    """A state whose conv rows are not ggml-aligned (e.g. replaced by a plain numpy copy) is never
    handed to ggml (a misaligned buffer aborts the process); the per-piece path computes it."""
    model = _model(q35_q8)
    il = model.recurrent.index(True)
    st = model.new_state()
    raw = np.zeros(st.extra[il].conv.size + 1, np.float32)
    start = 1 if raw.ctypes.data % 32 == 0 else 0
    st.extra[il].conv = raw[start:start + st.extra[il].conv.size].reshape(st.extra[il].conv.shape)
    h = _rows(np.random.default_rng(9), model, 1)[0][:2]
    out = model.pre_moe_batch(il, h, [(st, 0, 2)])
    assert model.layer_graph_calls == 0 and np.isfinite(out).all() and np.abs(st.extra[il].conv).max() > 0


def test_norms_and_the_shared_gate_are_in_the_graphs(q35_q8, monkeypatch):
    """Under the ggml kernel: a DeltaNet layer's post_attention_norm, router logits and shared expert
    (with its sigmoid gate) come out of its layer graph, in what ``layer_in`` returns (no graph of
    their own; ffn_input, route and shared run alone give the same bits), and the final norm is in
    the lm head's graph: numpy's formulas to float rounding (the activations are rounded to Q8_0
    before each mat-mul)."""
    from p2pswarm.engine import ops

    model = _model(q35_q8)
    il = model.recurrent.index(True)
    calls = _counting(monkeypatch)
    rng = np.random.default_rng(7)
    h_in = rng.standard_normal((5, model.n_embd)).astype(np.float32)
    lin = model.layer_in(il, h_in, [(model.new_state(), 0, 5)])
    assert calls[0] == 1, "the norm, the router or the shared expert ran a graph of its own"
    h, cur = lin.h, lin.cur
    assert model.shared_expert[il] and set(lin.extras) == {"shared"}
    w = model.w
    want = ops.rms_norm(h, np.asarray(w[f"blk.{il}.post_attention_norm.weight"]), model.eps)
    assert np.allclose(cur, want, rtol=1e-5, atol=1e-6)

    logits = model.output(h)
    assert calls[0] == 2
    x = ops.rms_norm(h, np.asarray(w["output_norm.weight"]), model.eps)
    want = x @ np.asarray(w[model.output_name], dtype=np.float32).T
    assert np.abs(logits - want).max() <= 2e-2 * np.abs(want).max()

    # each piece alone: a graph of its own, the same op and bits as the layer's graph
    assert np.array_equal(model.ffn_input(il, h), cur) and np.array_equal(model.ffn_input(il, h[2:4]), cur[2:4])
    got = lin.extras["shared"]
    ids2, wts2 = model.route(il, cur.copy())
    assert np.array_equal(model.shared(il, cur.copy()), got)
    assert np.array_equal(lin.ids, ids2) and np.array_equal(lin.weights, wts2)
    assert np.array_equal(model.shared(il, cur[1:3]), got[1:3])
    moe = rng.standard_normal(h.shape).astype(np.float32)
    assert np.array_equal(model.layer_out(il, lin, moe), h + (moe + got))
    p = f"blk.{il}."
    dense = {n: np.asarray(w[p + n + ".weight"], dtype=np.float32) for n in ("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")}
    g, u = cur @ dense["ffn_gate_shexp"].T, cur @ dense["ffn_up_shexp"].T
    s = (g / (1 + np.exp(-g)) * u) @ dense["ffn_down_shexp"].T
    gate = 1 / (1 + np.exp(-(cur @ np.asarray(w[p + "ffn_gate_inp_shexp.weight"], dtype=np.float32).reshape(-1))))
    want = s * gate[:, None]
    assert np.abs(got - want).max() <= 2e-2 * np.abs(want).max()
