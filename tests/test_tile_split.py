"""The Q8_0 lone-tail split (``p2pswarm.engine.ggml.dense.mul_mat_rows``): a Q8_0 mat-mul of
``4q + 1`` rows runs as ``4q`` rows (llamafile's tiles) + 1 row (libggml's one-row ``vec_dot``)
because llamafile's 4x1 remainder tile costs more than ``vec_dot`` on AVX-512. It must change no
bit anywhere:

- each matrix, each row count 1-13: the split result is the unsplit one, and each row is the row
  computed alone (what a decode step computes);
- it splits where it says (Q8_0, 4q + 1 rows from 5) and nowhere else (other row counts, F32);
- whole qwen35moe layer graphs (DeltaNet and gated attention, a speculative verification's
  5 and 9 positions, stepped) and the lm head give the same bits split and unsplit.
"""
from __future__ import annotations

import numpy as np
import pytest

from p2pswarm.engine.arch import load_dense
from p2pswarm.engine.ggml import dense
from p2pswarm.model.layout import ModelLayout
from p2pswarm.model.synth import make_model
from helpers.ggml import needs_ggml

pytestmark = needs_ggml


@pytest.fixture(scope="module")
def q35_q8(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiles") / "q35-q8.gguf"
    make_model(path, arch="qwen35moe", preset="tiny", qtype="q8_0", seed=43, tied=False)  # a Q8_0 head of its own
    return path


def _q8_matrices(model) -> list:
    mats = [w for w in model.w.loaded().values()
            if isinstance(w, dense.QuantisedMatrix) and w.ggml_type == dense.GGML_TYPE_Q8_0]
    assert len(mats) >= 8  # the DeltaNet / attention projections, the shared expert, the head
    return mats


def test_split_rows_says_where_it_splits(q35_q8):
    model = load_dense(ModelLayout.open(q35_q8), "ggml")
    w = _q8_matrices(model)[0].tensor
    assert [dense.split_rows(w, n) for n in range(1, 14)] == [0, 0, 0, 0, 4, 0, 0, 0, 8, 0, 0, 0, 12]
    f32 = next(v for v in model.w.loaded().values()
               if isinstance(v, dense.QuantisedMatrix) and v.ggml_type == dense.GGML_TYPE_F32)
    assert dense.split_rows(f32.tensor, 5) == 0  # the F32 router: another kernel, never split
    assert dense.split_cost(100, 5) == (500, dense.SPLIT_TENSORS) and dense.split_cost(100, 4) == (0, 0)


def test_split_matmul_is_the_unsplit_one_and_each_row_alone(q35_q8, monkeypatch):
    model = load_dense(ModelLayout.open(q35_q8), "ggml")
    rng = np.random.default_rng(3)
    for m in _q8_matrices(model):
        x = rng.standard_normal((13, m.shape[1])).astype(np.float32)
        alone = np.concatenate([m.rmatmul_t(x[i:i + 1]) for i in range(13)])
        for n in range(1, 14):
            monkeypatch.setattr(dense, "SPLIT_LONE_TAIL", True)
            split = m.rmatmul_t(x[:n])
            monkeypatch.setattr(dense, "SPLIT_LONE_TAIL", False)
            whole = m.rmatmul_t(x[:n])
            assert np.array_equal(split, whole), (m.name, n)
            assert np.array_equal(split, alone[:n]), (m.name, n)


def _verify_layers(model, h0: np.ndarray, tokens: int) -> list[np.ndarray]:
    """Every layer's layer_in / layer_out on ``tokens`` decode positions verified as one chunk (the
    positions as one-row segments of one state), after a 3-row prefill; the arrays they return and
    the DeltaNet / KV state, as ``layer_in`` leaves it."""
    state = model.new_state()
    out = []
    for rows, segs in ((h0[:3], [(state, 0, 3)]), (h0[3:3 + tokens], [(state, 3 + j, 1) for j in range(tokens)])):
        h = rows
        for il in range(model.n_layer):
            lin = model.layer_in(il, h, segs)
            out += [lin.h, lin.cur, lin.ids, lin.weights, *(lin.extras[k] for k in sorted(lin.extras))]
            h = model.layer_out(il, lin, np.zeros_like(lin.cur))
            out.append(h)
        out.append(model.output(h))
    return out


@pytest.mark.parametrize("tokens", [5, 9])
def test_layer_graphs_and_head_give_the_same_bits_split_and_unsplit(q35_q8, monkeypatch, tokens):
    model = load_dense(ModelLayout.open(q35_q8), "ggml")
    kinds = {model.recurrent_layer(il) for il in range(model.n_layer)}
    assert kinds == {True, False}  # DeltaNet and gated attention layers both
    h0 = np.random.default_rng(tokens).standard_normal((3 + tokens, model.n_embd)).astype(np.float32)
    got: dict = {}
    split_rows, splits = dense.split_rows, []

    def counted(w, n):
        s = split_rows(w, n)
        splits.append(s)
        return s

    monkeypatch.setattr(dense, "split_rows", counted)
    for on in (False, True, False):
        monkeypatch.setattr(dense, "SPLIT_LONE_TAIL", on)
        splits.clear()
        got.setdefault(on, []).append(_verify_layers(model, h0, tokens))
        # split: each of the verification chunk's Q8_0 projections (every layer) and its head, as
        # many as the 3-row prefill's (none split there)
        assert (splits.count(tokens - 1) == splits.count(0) >= 3 * model.n_layer + 1) if on else not any(splits)
    assert all(np.array_equal(a, b) for a, b in zip(got[False][0], got[False][1]))  # the run repeats exactly
    assert len(got[True][0]) == len(got[False][0])
    for i, (a, b) in enumerate(zip(got[True][0], got[False][0])):
        assert np.array_equal(a, b), i
