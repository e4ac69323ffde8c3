"""The ggml kernel's one-graph DeltaNet layer (p2pswarm/engine/ggml_layers.py).

- a qwen35moe DeltaNet layer's whole ``pre_moe_batch`` (all sequences) is ONE ggml graph compute,
  and it is what runs under the ggml kernel;
- it computes what the per-piece path computes (output, conv rows, recurrent state), to float
  rounding, over several steps of prefill and decode;
- a sequence alone gives the bits it gets in a batch of several, output and state, step by step
  (Q8_0: libggml's mat-muls are row-invariant there);
- a libggml without one of the graph's ops keeps the per-piece path.
"""
from __future__ import annotations

import numpy as np
import pytest

from p2pswarm.engine import ggml_kernel as gk
from p2pswarm.engine.arch import load_dense
from p2pswarm.engine.kernels import use_kernel_for_dense
from p2pswarm.model.layout import ModelLayout
from p2pswarm.model.synth import make_model
from helpers.ggml import needs_ggml

pytestmark = needs_ggml
SIZES = [1, 5, 1, 3]  # rows per sequence: decode and prefill side by side


@pytest.fixture(scope="module")
def q35_q8(tmp_path_factory):
    path = tmp_path_factory.mktemp("layers") / "q35-q8.gguf"
    make_model(path, arch="qwen35moe", preset="tiny", qtype="q8_0", seed=31)
    return path


def _model(path):
    model = load_dense(ModelLayout.open(path))
    assert use_kernel_for_dense(model, "ggml") > 0
    return model


def _counting(monkeypatch):
    calls = [0]
    real = gk.GgmlRunner.compute

    def compute(self, graph, macs):
        calls[0] += 1
        return real(self, graph, macs)

    monkeypatch.setattr(gk.GgmlRunner, "compute", compute)
    return calls


def _rows(rng, model, steps):
    return [rng.standard_normal((sum(SIZES), model.n_embd)).astype(np.float32) for _ in range(steps)]


def test_deltanet_layer_is_one_graph_and_the_per_piece_math(q35_q8, monkeypatch):
    model, ref = _model(q35_q8), _model(q35_q8)
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
        assert calls[0] - graphs >= 3  # what it replaces: projections, delta rule, output projection
        assert got.shape == want.shape and got.dtype == np.float32
        delta = np.abs(want - h).max()
        assert delta > 1e-2  # the layer does something
        assert np.abs(got - want).max() <= 1e-4 * delta + 1e-6, step
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
    monkeypatch.setattr(model.w.ggml_dense.lib, "ssm_conv", None)
    h = _rows(np.random.default_rng(7), model, 1)[0]
    out = model.pre_moe_batch(il, h, [(model.new_state(), 0, n) for n in SIZES])
    assert model.layer_graph_calls == 0 and np.isfinite(out).all()
