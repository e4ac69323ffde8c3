"""qwen35moe (Qwen3.5 MoE: Gated DeltaNet + gated attention + shared expert), checked against
llama.cpp, which nobody here wrote.

* F32 models: our logits within 1e-4 + 2e-5 * max|logit| of llama.cpp's (F32 KV cache, flash
  attention off) on 32 tokens, prefill and token-by-token decode, for separate and fused experts,
  IMROPE sections other than the default (and a wrong section rule would fail), Hk == Hv and
  Hk != Hv DeltaNets, tied output.
* Chunked DeltaNet (prefill) == recurrent DeltaNet (decode) to <= 1e-6 relative.
* Split == monolithic, bit for bit, 1, 3 and 7 workers, in-process and over sockets.
* Quantised models (Q8_0, and Q4_K_M from llama.cpp's own quantiser): each layer is fed
  llama.cpp's input for it, captured from inside llama.cpp's forward pass through its eval
  callback, and must route exactly as llama.cpp routed; per-layer relative errors are printed.
* A qwen35moe GGUF missing a required key or tensor: one line naming it.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from p2pswarm.backbone.serving.runner import combine, expert_groups
from p2pswarm.backbone.sessions.local import open_backbone
from p2pswarm.engine import ops
from p2pswarm.engine.arch.qwen35moe import deltanet
from p2pswarm.engine.arch import load_dense
from p2pswarm.engine.experts.numpy_bank import ExpertBank
from p2pswarm.model.layout import ModelLayout
from p2pswarm.model.slicer import slice_experts
from p2pswarm.model.synth import describe, make_model
from p2pswarm.worker.expert_worker import ExpertWorker

from conftest import assert_one_line_error, llama_logits, needs_llama, run_cli
from helpers.arch_checks import TOKENS, experts_in_front_and_per_call
from helpers.arch_checks import forward as _forward
from helpers.compare import assert_logits_close, tolerance
from helpers.ggml import needs_ggml
from helpers.gguf_edit import rewrite as _rewrite
from helpers.llama_ref import llama_intermediates
from p2pswarm.backbone.serving.generate import sequence_logits

F32 = np.float32


# Every variant is the tiny qwen35moe preset (3 DeltaNet layers + 1 gated-attention layer, Hk 2,
# Hv 4, 16 experts top-4, shared expert) with one thing changed.
VARIANTS = {
    "separate": dict(seed=21),
    "fused": dict(seed=21, fused_experts=True),  # same weights as "separate", one gate_up tensor
    # pairs 0, 3, 6 fall to the e stream (position 0): those dims are not rotated
    "rope-sections": dict(seed=22, rope_sections=(0, 3, 3, 2)),
    # sum(sections) 4 < 16 pairs: the sector wraps; half the layers full attention
    "rope-sections-wrap": dict(seed=23, rope_sections=(1, 1, 1, 1), n_rot=32, full_attention_interval=2),
    "hk-eq-hv": dict(seed=24, ssm_group_count=4, ssm_time_step_rank=4),
    "hk-ne-hv-x3": dict(seed=25, ssm_group_count=2, ssm_time_step_rank=6),
    "tied": dict(seed=26, tied=True),
}


def q35_model(models_dir: Path, name: str, **kw) -> Path:
    """A qwen35moe test model, made once per session."""
    path = models_dir / f"q35-{name}.gguf"
    if not path.exists():
        make_model(path, arch="qwen35moe", preset="tiny", **(kw or VARIANTS[name]))
    return path


async def our_logits(path, tokens=TOKENS, workers=0, transport="inproc"):
    async with open_backbone(path, workers=workers, transport=transport) as swarm:
        prefill = await sequence_logits(swarm.backbone, tokens)
        decode = await sequence_logits(swarm.backbone, tokens, decode=True)
        stats = swarm.backbone.dispatcher.stats
    return prefill, decode, stats




# ---------------------------------------------------------------------------------------------
# F32 logits against llama.cpp


@pytest.mark.slow
@needs_llama
@pytest.mark.parametrize("variant", [v for v in VARIANTS if v != "separate"])
async def test_f32_logits_match_llama_cpp(models_dir, variant):
    path = q35_model(models_dir, variant)
    ref = llama_logits(path, TOKENS)
    prefill, decode, _ = await our_logits(path)
    assert_logits_close(f"qwen35moe {variant}", ref, prefill=prefill, decode=decode)
    if variant == "fused":  # same weights as "separate": the same function, bit for bit
        sep_prefill, sep_decode, _ = await our_logits(q35_model(models_dir, "separate"))
        assert np.array_equal(prefill, sep_prefill) and np.array_equal(decode, sep_decode)


@pytest.mark.slow
@needs_llama
def test_f32_logits_command_matches_llama_cpp(models_dir, tmp_path):
    """`p2pswarm logits` itself (a real process), prefill and --decode, on the separate-experts model."""
    path = q35_model(models_dir, "separate")
    ref = llama_logits(path, TOKENS)
    tol = tolerance(ref)
    ids = ",".join(map(str, TOKENS))
    for flag in ([], ["--decode"]):
        out = tmp_path / f"l{len(flag)}.npy"
        run_cli("logits", str(path), "--tokens", ids, "--out", str(out), "--workers", "0", *flag, check=True)
        ours = np.load(out)
        diff = float(np.abs(ours - ref).max())
        print(f"qwen35moe separate {'decode' if flag else 'prefill'} (p2pswarm logits): max |diff| {diff:.3g} "
              f"(tolerance {tol:.3g})")
        assert ours.shape == ref.shape and diff <= tol


@needs_llama
@pytest.mark.slow
async def test_wrong_section_rule_would_be_caught(models_dir):
    """The sections test has teeth: plain NEOX rope (ignoring the section rule) misses by >> tolerance."""
    path = q35_model(models_dir, "rope-sections")
    ref = llama_logits(path, TOKENS)
    layout = ModelLayout.open(path)
    model, bank = load_dense(layout), ExpertBank(layout)
    right = _forward(model, bank, TOKENS)
    model.rope_sections = (8, 8, 8, 0)  # covers every pair: plain NEOX
    wrong = _forward(model, bank, TOKENS)
    assert np.abs(right - ref).max() <= tolerance(ref) < np.abs(wrong - ref).max() / 10





# ---------------------------------------------------------------------------------------------
# The pieces


def test_imrope_section_rule():
    pos = np.arange(7)
    # covering sections (the real [11, 11, 10, 0] with 64 rotary dims, and the tiny preset's): NEOX
    for sections, n_rot in (((11, 11, 10, 0), 64), ((3, 3, 2, 0), 16)):
        assert (ops.imrope_positions(pos, n_rot, sections) == pos[:, None]).all()
        x = np.random.default_rng(0).standard_normal((7, 3, n_rot * 2)).astype(F32)
        assert np.array_equal(ops.rope_imrope(x, pos, n_rot, 1e6, sections), ops.rope_neox(x, pos, n_rot, 1e6))
    # (0, 3, 3, 2): sectors 0, 3, 6 have sector % 3 == 0 but sector >= 3 * s0 = 0 -> e (position 0)
    pp = ops.imrope_positions(pos, 16, (0, 3, 3, 2))
    assert (pp[:, [0, 3, 6]] == 0).all() and (pp[:, [1, 2, 4, 5, 7]] == pos[:, None]).all()
    # (1, 1, 1, 1) over 16 pairs: sector = i mod 4; 0 -> t, 1 -> h, 2 -> w, 3 -> e
    pp = ops.imrope_positions(pos, 32, (1, 1, 1, 1))
    assert (pp[:, 3::4] == 0).all() and (pp[:, 0::4] == pos[:, None]).all()
    # explicit (t, h, w, e) streams pick the right one
    p4 = np.stack([pos, 100 + pos, 200 + pos, 300 + pos], axis=1)
    assert (ops.imrope_positions(p4, 8, (1, 1, 1, 1))[:, :4] == p4).all()


def _random_deltanet(T, H=4, dk=32, dv=32, seed=0):
    rng = np.random.default_rng(seed)
    q = deltanet.l2_norm(rng.standard_normal((T, H, dk)).astype(F32), 1e-6)
    k = deltanet.l2_norm(rng.standard_normal((T, H, dk)).astype(F32), 1e-6)
    v = rng.standard_normal((T, H, dv)).astype(F32)
    a = -np.exp(rng.uniform(np.log(0.02), np.log(0.5), (1, H))).astype(F32)
    g = deltanet.softplus(rng.standard_normal((T, H)).astype(F32)) * a
    beta = ops.sigmoid(rng.standard_normal((T, H)).astype(F32))
    S0 = rng.standard_normal((H, dk, dv)) * 0.3
    return q, k, v, g, beta, S0


@pytest.mark.parametrize("T", [1, 63, 64, 65, 200])
def test_chunked_deltanet_equals_recurrent(T):
    q, k, v, g, beta, S0 = _random_deltanet(T, seed=T)
    o_r, S_r = deltanet.delta_rule_recurrent(q, k, v, g, beta, S0)
    o_c, S_c = deltanet.delta_rule_chunked(q, k, v, g, beta, S0)
    rel_o = np.abs(o_c - o_r).max() / np.abs(o_r).max()
    rel_s = np.abs(S_c - S_r).max() / np.abs(S_r).max()
    print(f"T={T}: chunked vs recurrent, output {rel_o:.2e}, state {rel_s:.2e} (relative)")
    assert rel_o <= 1e-6 and rel_s <= 1e-6
    # any chunk size is the same computation
    o_7, S_7 = deltanet.delta_rule_chunked(q, k, v, g, beta, S0, chunk=7)
    assert np.abs(o_7 - o_r).max() / np.abs(o_r).max() <= 1e-6 and np.abs(S_7 - S_r).max() <= 1e-9


def test_chunked_deltanet_equals_recurrent_in_the_model(models_dir):
    """The whole model on 150 tokens (chunks of 64, 64, 22): chunked prefill == recurrent prefill, and
    a prefill cut in two pieces (carried conv rows and S) == one prefill."""
    layout = ModelLayout.open(q35_model(models_dir, "separate"))
    model, bank = load_dense(layout), ExpertBank(layout)
    toks = [(37 * i + 11) % 540 for i in range(150)]
    model.deltanet_mode = "recurrent"
    rec = _forward(model, bank, toks)
    model.deltanet_mode = "chunked"
    chk = _forward(model, bank, toks)
    rel = float(np.abs(chk - rec).max() / np.abs(rec).max())
    print(f"model, 150 tokens: chunked vs recurrent logits, relative {rel:.2e}")
    assert rel <= 1e-6
    state = model.new_state()
    first = _forward(model, bank, toks[:70], state, 0)
    second = _forward(model, bank, toks[70:], state, 70)
    pieces = np.concatenate([first, second])
    assert np.abs(pieces - chk).max() / np.abs(chk).max() <= 1e-5


def test_conv_state_carries():
    rng = np.random.default_rng(3)
    m = rng.standard_normal((10, 6)).astype(F32)
    w = rng.standard_normal((6, 4)).astype(F32)
    whole, st_whole = deltanet.causal_conv1d(m, np.zeros((3, 6), F32), w)
    a, st = deltanet.causal_conv1d(m[:4], np.zeros((3, 6), F32), w)
    b, st = deltanet.causal_conv1d(m[4:], st, w)
    assert np.allclose(np.concatenate([a, b]), whole, atol=1e-6) and np.array_equal(st, st_whole)
    # output t is sum_i X[t + i] * w[:, i], X = [3 zero rows; m]: the current token weighs w[:, 3]
    assert np.allclose(whole[0], m[0] * w[:, 3], atol=1e-6)
    assert np.allclose(whole[5], sum(m[2 + i] * w[:, i] for i in range(4)), atol=1e-5)


def test_l2_norm_and_softplus_follow_ggml():
    x = np.array([[3.0, 4.0], [0.0, 1e-8]], dtype=F32)
    y = deltanet.l2_norm(x, 1e-6)
    assert np.allclose(y[0], [0.6, 0.8]) and np.allclose(y[1], [0.0, 1e-2])  # eps floors the norm
    assert deltanet.softplus(np.array([25.0], F32))[0] == F32(25.0)
    assert np.isclose(deltanet.softplus(np.array([0.0], F32))[0], np.log(2.0))


def test_state_per_sequence(models_dir):
    """Two sequences interleaved through one model: each has its own KV caches, conv rows and S."""
    layout = ModelLayout.open(q35_model(models_dir, "separate"))
    model, bank = load_dense(layout), ExpertBank(layout)
    a, b = TOKENS[:12], TOKENS[12:24]
    alone_a, alone_b = _forward(model, bank, a), _forward(model, bank, b)
    sa, sb = model.new_state(), model.new_state()
    assert set(sa.kv) == {3} and set(sa.extra) == {0, 1, 2}
    outs_a, outs_b = [], []
    for i in range(12):
        outs_a.append(_forward(model, bank, [a[i]], sa, i))
        outs_b.append(_forward(model, bank, [b[i]], sb, i))
    for alone, outs in ((alone_a, outs_a), (alone_b, outs_b)):
        assert np.abs(np.concatenate(outs) - alone).max() < 1e-4 * np.abs(alone).max()


# ---------------------------------------------------------------------------------------------
# Split == monolithic


@pytest.mark.parametrize("transport", ["inproc", pytest.param("socket", marks=pytest.mark.slow)])
@pytest.mark.parametrize("variant", [pytest.param("separate", marks=pytest.mark.slow), "fused"])
async def test_split_equals_monolithic(models_dir, variant, transport):
    path = q35_model(models_dir, variant)
    mono_prefill, mono_decode, mono_stats = await our_logits(path, TOKENS[:24])
    assert mono_stats.requests == 0 and np.isfinite(mono_prefill).all()
    assert np.abs(mono_prefill - mono_decode).max() < 1e-4 * np.abs(mono_prefill).max()
    for workers in (1, 3, 7):
        prefill, decode, stats = await our_logits(path, TOKENS[:24], workers, transport)
        assert stats.requests > 0 and stats.local_groups == 0 and stats.fallbacks == 0
        assert np.array_equal(prefill, mono_prefill), f"{workers} workers prefill differs"
        assert np.array_equal(decode, mono_decode), f"{workers} workers decode differs"


def test_fused_shard_is_a_byte_range_copy(models_dir, tmp_path):
    src = ModelLayout.open(q35_model(models_dir, "fused"))
    assert set(src.expert_tensors[0]) == {"gate_up", "down"}
    assert src.expert_tensors[0]["gate_up"].shape == (16, 512, 256)
    shard = tmp_path / "shard.gguf"
    slice_experts(src.path, shard, None, (5, 11))
    s = ModelLayout.open(shard)
    for layer in range(4):
        for kind in ("gate_up", "down"):
            st, t = s.expert_tensors[layer][kind], src.expert_tensors[layer][kind]
            off, n = t.slabs(5, 11)
            assert s.reader.data[st.data_offset : st.data_offset + st.nbytes].tobytes() == \
                src.reader.data[off : off + n].tobytes()
    # a worker on the shard computes what the full model's bank computes, bit for bit
    x = np.random.default_rng(2).standard_normal((3, 256)).astype(F32)
    worker, full = ExpertWorker(shard, kernel="numpy"), ExpertBank(src)
    for e in (5, 10):
        assert np.array_equal(worker.bank.forward(1, e, x), full.forward(1, e, x))
    # fused and separate experts of the same seed are the same weights
    sep = ExpertBank(ModelLayout.open(q35_model(models_dir, "separate")))
    assert np.array_equal(sep.forward(2, 7, x), full.forward(2, 7, x))


# ---------------------------------------------------------------------------------------------
# Quantised models: teacher-forced layer by layer against llama.cpp's own intermediate tensors

# (llama_intermediates, from tests/helpers/llama_ref.py, reads llama.cpp's named tensors in its child process.)

# llama.cpp rounds the activations before a mat-mul with quantised weights to the weights'
# "vec_dot" type: Q8_0 blocks of 32 for Q8_0/Q4_0/Q5_x, Q8_K blocks of 256 for K-quants. Our
# engine does not (it multiplies by the dequantised weights in float32), which moves outputs by
# ~0.5% and can flip a near-tie in the router. To test routing at the precision it deserves, this
# test-only emulation rounds the same way (x86 kernels: round to nearest even; Q8_0 scale in F16).


def _round_q8_0(x):
    xb = x.reshape(*x.shape[:-1], -1, 32)
    amax = np.abs(xb).max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax != 0, F32(127) / amax, F32(0)).astype(F32)
    d = (amax / F32(127)).astype(np.float16).astype(F32)
    return (np.rint(xb * inv) * d).reshape(x.shape).astype(F32)


def _round_q8_k(x):
    xb = x.reshape(*x.shape[:-1], -1, 256)
    mx = np.take_along_axis(xb, np.argmax(np.abs(xb), axis=-1)[..., None], axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = np.where(mx != 0, F32(-127) / mx, F32(0)).astype(F32)
        d = np.where(mx != 0, F32(1) / iscale, F32(0)).astype(F32)
    return (np.minimum(np.rint(xb * iscale), 127) * d).reshape(x.shape).astype(F32)


_ACT_ROUNDING = {Q.Q8_0: _round_q8_0, Q.Q4_0: _round_q8_0, Q.Q4_1: _round_q8_0, Q.Q5_0: _round_q8_0,
                 Q.Q5_1: _round_q8_0, Q.Q2_K: _round_q8_k, Q.Q3_K: _round_q8_k, Q.Q4_K: _round_q8_k,
                 Q.Q5_K: _round_q8_k, Q.Q6_K: _round_q8_k,
                 Q.F16: lambda x: x.astype(np.float16).astype(F32)}


class _Rounded(np.ndarray):
    """A dequantised weight that remembers how llama.cpp rounds what it is multiplied with."""

    round_input = None


def _tag(w, ggml_type):
    fn = _ACT_ROUNDING.get(ggml_type)
    if fn is None:
        return w
    v = w.view(_Rounded)
    v.round_input = fn
    return v


def _emulating_matmul(x, w):
    fn = getattr(w, "round_input", None)
    x = np.asarray(x)
    return (fn(x) if fn is not None else x) @ np.asarray(w).T


class _RoundingWeights:
    def __init__(self, inner, layout):
        self.inner = inner
        self.types = {t.name: t.tensor_type for t in layout.reader.tensors}

    def has(self, name):
        return self.inner.has(name)

    def shape(self, name):
        return self.inner.shape(name)

    def __getitem__(self, name):
        return _tag(self.inner[name], self.types[name])


class _RoundingBank(ExpertBank):
    def _load(self, layer, expert):
        gate, up, down = super()._load(layer, expert)
        ts = self.layout.expert_tensors[layer]
        gu = (ts.get("gate_up") or ts["gate"]).ggml_type
        return _tag(gate, gu), _tag(up, gu), _tag(down, ts["down"].ggml_type)


def _rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _teacher_forced(model, bank, cap):
    """Each layer from llama.cpp's input to it: our ffn input, routing and output vs llama.cpp's."""
    rows = []
    state = model.new_state()
    for il in range(model.n_layer):
        h_in = cap["model.input_embed"] if il == 0 else cap[f"l_out-{il - 1}"]
        h = model.pre_moe(il, h_in, state, 0)
        cur = model.ffn_input(il, h)
        ids, w = model.route(il, cur)
        ref_ids = cap[f"ffn_moe_topk-{il}"]
        router_ids, _ = model.route(il, cap[f"attn_post_norm-{il}"])  # the router alone, on llama's rows
        groups = expert_groups(ids)
        partials = dict(zip([e for e, _ in groups], bank.forward_groups(il, cur, groups)))
        moe = combine(ids, w, groups, partials)
        out = model.post_moe(il, h, cur, moe)
        rows.append(dict(
            layer=il, kind="deltanet" if model.recurrent[il] else "attention",
            same_routing=bool(np.array_equal(ids, ref_ids)),
            tokens_rerouted=int((ids != ref_ids).any(axis=1).sum()),
            router_same_on_llama_rows=bool(np.array_equal(router_ids, ref_ids)),
            attn=_rel(h, cap[f"attn_residual-{il}"]), ffn_in=_rel(cur, cap[f"attn_post_norm-{il}"]),
            weights=float(np.abs(w - cap[f"ffn_moe_weights_norm-{il}"]).max()) if np.array_equal(ids, ref_ids)
            else float("nan"),
            moe=_rel(moe, cap[f"ffn_moe_out-{il}"]), out=_rel(out, cap[f"l_out-{il}"])))
    return rows


def _print_rows(title, rows):
    print(f"\n{title}\n| layer | kind | routing == llama.cpp | router on llama's rows | attn+res rel | ffn input rel "
          f"| top-k weights max abs | routed experts rel | layer out rel |\n|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        routing = "yes" if r["same_routing"] else f"NO ({r['tokens_rerouted']} tokens)"
        print(f"| {r['layer']} | {r['kind']} | {routing} | {'yes' if r['router_same_on_llama_rows'] else 'NO'} "
              f"| {r['attn']:.2e} | {r['ffn_in']:.2e} | {r['weights']:.2e} | {r['moe']:.2e} | {r['out']:.2e} |")


@needs_llama
@pytest.mark.slow
@pytest.mark.parametrize("qtype", ["q8_0", "q4_k_m"])
def test_quantised_routing_matches_llama_cpp_layer_by_layer(models_dir, qtype, monkeypatch):
    path = q35_model(models_dir, f"{qtype}-8layers", seed=31, qtype=qtype, layers=8)
    layout = ModelLayout.open(path)
    types = {t.tensor_type for t in layout.reader.tensors}
    assert types & ({Q.Q8_0} if qtype == "q8_0" else {Q.Q4_K, Q.Q6_K})
    names = {"model.input_embed"}
    for il in range(layout.n_layer):
        names |= {f"{n}-{il}" for n in ("attn_residual", "attn_post_norm", "ffn_moe_topk", "ffn_moe_weights_norm",
                                        "ffn_moe_out", "l_out")}
    cap = llama_intermediates(path, TOKENS, names)

    # 1. our engine as it is: the router on llama.cpp's own ffn input routes identically; the
    #    whole layer from llama.cpp's input differs by the activation rounding we do not do.
    plain = _teacher_forced(load_dense(layout), ExpertBank(layout), cap)
    _print_rows(f"{qtype}, engine as is (no activation rounding), teacher-forced", plain)
    assert all(r["router_same_on_llama_rows"] for r in plain)
    assert max(r["out"] for r in plain) < 0.05

    # 2. with llama.cpp's activation rounding emulated: every layer routes exactly as llama.cpp did
    monkeypatch.setattr(ops, "matmul", _emulating_matmul)
    model = load_dense(layout)
    model.w = _RoundingWeights(model.w, layout)
    emulated = _teacher_forced(model, _RoundingBank(layout), cap)
    _print_rows(f"{qtype}, with llama.cpp's activation rounding emulated, teacher-forced", emulated)
    assert all(r["same_routing"] for r in emulated), [r["layer"] for r in emulated if not r["same_routing"]]
    assert max(r["ffn_in"] for r in emulated) < 1e-3
    assert float(np.median([r["out"] for r in emulated])) < 1e-5
    assert max(r["out"] for r in emulated) < 5e-3  # a rare rounding flip, never a different function


@needs_llama
@pytest.mark.slow
def test_teacher_forced_f32_is_exact(models_dir):
    """The capture itself, on F32: every layer within float rounding of llama.cpp's."""
    path = q35_model(models_dir, "separate")
    layout = ModelLayout.open(path)
    names = {"model.input_embed"} | {f"{n}-{il}" for il in range(4) for n in (
        "attn_residual", "attn_post_norm", "ffn_moe_topk", "ffn_moe_weights_norm", "ffn_moe_out", "l_out")}
    rows = _teacher_forced(load_dense(layout), ExpertBank(layout), llama_intermediates(path, TOKENS, names))
    _print_rows("f32, teacher-forced", rows)
    assert all(r["same_routing"] for r in rows) and max(r["out"] for r in rows) < 1e-5


# ---------------------------------------------------------------------------------------------
# Refusals: a qwen35moe GGUF missing what the forward pass needs




@pytest.mark.slow
@pytest.mark.parametrize("drop", [
    ("key", "qwen35moe.ssm.state_size"),
    ("key", "qwen35moe.rope.dimension_sections"),
    ("key", "qwen35moe.attention.layer_norm_rms_epsilon"),
    ("tensor", "blk.0.ssm_a"),
    ("tensor", "blk.1.ssm_conv1d.weight"),
    ("tensor", "blk.3.attn_q_norm.weight"),
    ("tensor", "blk.2.post_attention_norm.weight"),
    ("tensor", "blk.0.ffn_up_shexp.weight"),
])
def test_missing_key_or_tensor_is_one_line(models_dir, tmp_path, drop):
    what, name = drop
    bad = _rewrite(q35_model(models_dir, "separate"), tmp_path / "bad.gguf",
                   drop_key=name if what == "key" else None, drop_tensor=name if what == "tensor" else None)
    proc = run_cli("logits", str(bad), "--tokens", "1,2,3", "--out", str(tmp_path / "x.npy"), "--workers", "0")
    assert_one_line_error(proc, name)


@pytest.mark.slow
def test_layer_kinds_from_recurrent_layers_and_mtp_blocks(models_dir, tmp_path):
    """``attention.recurrent_layers`` overrides the interval; ``nextn_predict_layers`` trailing blocks
    (multi-token prediction) are not part of the forward pass."""
    from gguf import GGUFValueType as T

    src = q35_model(models_dir, "separate")
    ref, _ = _forward_path(src)
    # the same kinds spelled as a list (interval key gone): same logits
    same = _rewrite(src, tmp_path / "rec.gguf", drop_key="qwen35moe.full_attention_interval", set_keys={
        "qwen35moe.attention.recurrent_layers": ([True, True, True, False], T.ARRAY, T.BOOL)})
    got, model = _forward_path(same)
    assert model.recurrent == [True, True, True, False] and np.array_equal(got, ref)
    # a list that disagrees with the tensors: one line naming what layer 1 lacks
    wrong = _rewrite(src, tmp_path / "wrong.gguf", set_keys={
        "qwen35moe.attention.recurrent_layers": ([True, False, True, False], T.ARRAY, T.BOOL)})
    proc = run_cli("logits", str(wrong), "--tokens", "1,2", "--out", str(tmp_path / "x.npy"), "--workers", "0")
    assert_one_line_error(proc, "blk.1.attn_q.weight")
    # 4 blocks of which the last is an MTP block == the 3-block model of the same seed, bit for bit
    three = q35_model(models_dir, "separate-3-layers", seed=21, layers=3)
    mtp = _rewrite(src, tmp_path / "mtp.gguf", set_keys={"qwen35moe.nextn_predict_layers": (1, T.UINT32, None)})
    got, model = _forward_path(mtp)
    assert model.n_layer == 3 and model.n_layer_nextn == 1
    assert np.array_equal(got, _forward_path(three)[0])


def _forward_path(path):
    layout = ModelLayout.open(path)
    model = load_dense(layout)
    return _forward(model, ExpertBank(layout), TOKENS[:16]), model


# ---------------------------------------------------------------------------------------------
# make-model --arch qwen35moe


@pytest.mark.slow
def test_make_model_qwen35moe_command(tmp_path):
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    proc = run_cli("make-model", "--arch", "qwen35moe", "-o", str(a), "--seed", "5", "--fused-experts",
                   "--rope-sections", "0,3,3,2", "--ssm-group-count", "2", "--ssm-time-step-rank", "6", "--tied",
                   check=True)
    assert "qwen35moe tiny" in proc.stdout and "fused" in proc.stdout and "tied" in proc.stdout
    make_model(b, arch="qwen35moe", seed=5, fused_experts=True, rope_sections=(0, 3, 3, 2), ssm_group_count=2,
               ssm_time_step_rank=6, tied=True)
    assert hashlib.sha256(a.read_bytes()).digest() == hashlib.sha256(b.read_bytes()).digest()
    lay = ModelLayout.open(a)
    assert lay.hparams["rope.dimension_sections"] == [0, 3, 3, 2] and lay.hparams["ssm.time_step_rank"] == 6
    assert not lay.has_tensor("output.weight") and describe(a)["fused_experts"]
    # refusals, one line each
    assert_one_line_error(run_cli("make-model", "-o", str(tmp_path / "c.gguf"), "--fused-experts"),
                          "only to --arch qwen35moe")
    assert_one_line_error(run_cli("make-model", "--arch", "qwen35moe", "-o", str(tmp_path / "c.gguf"),
                                  "--ssm-group-count", "3"), "multiple")
    proc = run_cli("make-model", "--arch", "qwen35moe", "-o", str(tmp_path / "c.gguf"), "--rope-sections", "1,2")
    assert proc.returncode == 2 and "--rope-sections" in proc.stderr.strip().splitlines()[-1]  # argparse's usage error
    assert not (tmp_path / "c.gguf").exists()


@needs_llama
@pytest.mark.slow
def test_geometry_122b_qwen35moe_loads_in_llama_cpp(tmp_path, monkeypatch):
    """The 122B's geometry (a DeltaNet and an attention layer, Q4_K experts, Q8_0 dense): llama.cpp
    runs it, and layer by layer from llama.cpp's inputs we route as it does (with its activation
    rounding emulated; 256 experts, top-8)."""
    path = tmp_path / "g.gguf"
    make_model(path, arch="qwen35moe", preset="geometry-122b", qtype="q8_0")
    try:
        info = describe(path)
        assert info["bytes_per_expert"] == 5_308_416 and info["expert_types"] == ["Q4_K"]
        layout = ModelLayout.open(path)
        assert layout.n_expert == 256 and layout.n_expert_used == 8 and layout.hparams["embedding_length"] == 3072
        toks = TOKENS[:8]
        names = {"model.input_embed"} | {f"{n}-{il}" for il in range(2) for n in (
            "attn_residual", "attn_post_norm", "ffn_moe_topk", "ffn_moe_weights_norm", "ffn_moe_out", "l_out")}
        cap = llama_intermediates(path, toks, names)
        monkeypatch.setattr(ops, "matmul", _emulating_matmul)
        model = load_dense(layout)
        assert model.recurrent == [True, False]
        model.w = _RoundingWeights(model.w, layout)
        rows = _teacher_forced(model, _RoundingBank(layout), cap)
        _print_rows(f"geometry-122b qwen35moe ({info['file_bytes'] / 1e9:.2f} GB), emulated rounding, teacher-forced",
                    rows)
        assert all(r["same_routing"] for r in rows) and max(r["out"] for r in rows) < 5e-3
    finally:
        path.unlink(missing_ok=True)


@needs_ggml
async def test_experts_in_front_of_the_next_layer_give_the_per_call_bits(models_dir):
    """On the local path a layer's Q4_K experts, their combine and ``h + (moe + shared)`` run in
    front of the next layer's graph (DeltaNet or gated attention), the last layer's in front of
    the final norm and lm head (``Backbone.fused_layers`` counts them): a prefill of one sequence (groups of 8+ rows, where a K-quant takes
    another kernel: the same op on the same rows) and its token-by-token decode give the bits of
    the per-call path (the bank's graph, numpy's combine, ``layer_out``, the next layer's graph)."""
    path = q35_model(models_dir, "q4k-experts", seed=27, qtype="q8_0", expert_qtype="q4_k")
    got, n_layer = await experts_in_front_and_per_call(path)
    (p1, d1, n1), (p0, d0, n0) = got[True], got[False]
    assert n0 == 0 and n1 == n_layer * (1 + len(TOKENS))  # every layer end of every step fused, the last too
    assert np.array_equal(p1, p0) and np.array_equal(d1, d0)
