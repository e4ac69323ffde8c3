"""deepseek2 (DeepSeek-V2/V3/R1, Kimi K2: MLA, YaRN, leading dense layers, shared expert, softmax or
sigmoid + bias group-limited routing), checked against llama.cpp, which nobody here wrote.

* F32: our logits within 1e-4 + 2e-5 * max|logit| of llama.cpp's, prefill and token-by-token decode
  (32 tokens), for V3's form (q_lora, split attn_k_b/attn_v_b, sigmoid + exp_probs_b, 4 groups of
  which 2 are used, scale 2.5, YaRN factor 40), the older attn_kv_b form of the same weights, a
  V2 form (softmax over groups, no YaRN) and V2-Lite's (plain attn_q, softmax, no groups, no norm).
  A plain-RoPE engine (YaRN ignored) would miss by far more than the tolerance.
* Q4_K_M (llama.cpp's quantiser): each layer, fed llama.cpp's own input to it (its eval callback),
  routes to exactly the experts llama.cpp chose; greedy tokens equal llama.cpp's for 32 steps.
* Split == monolithic bit for bit (3 in-process workers; 3 worker processes through the libp2p
  swarm), batched == alone bit for bit.
* Inconsistent hyper-parameters are refused at load, one line naming the key.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType

from p2pswarm.backbone.sessions.local import open_backbone
from p2pswarm.engine.arch.deepseek2 import mla
from p2pswarm.engine.arch import load_dense
from p2pswarm.errors import ModelFormatError
from p2pswarm.model.layout import ModelLayout
from p2pswarm.model.synth import make_model

from conftest import assert_one_line_error, needs_llama, run_cli
from helpers.arch_checks import backbone_logits
from helpers.compare import assert_logits_close, tolerance
from helpers.gguf_edit import rewrite
from helpers.llama_ref import llama_greedy, llama_intermediates, llama_logits
from helpers.procs import assert_swarm_prefill_and_decode_exact, shard_swarm
from p2pswarm.backbone.serving.generate import sequence_logits

F32 = np.float32
TOKENS = [5, 211, 37, 90, 14, 14, 14, 302, 8, 66, 129, 3, 250, 77, 41, 19, 180, 222, 6, 51, 97, 140, 12, 260,
          33, 71, 2, 118, 199, 45, 88, 301]
V2 = dict(gating="softmax", exp_probs_b=False, weights_norm=False, weights_scale=16.0, yarn_factor=0.0,
          n_group=4, n_group_used=3)
VARIANTS = {
    "v3": dict(seed=41),  # the tiny preset: DeepSeek-V3's structure
    "v3-kv-b": dict(seed=41, options=dict(mla_split=False)),  # the same weights, attn_kv_b unsplit
    "v2": dict(seed=42, options=V2),
    "v2-lite": dict(seed=43, options=dict(V2, q_lora_rank=0, n_group=0, n_group_used=0, weights_scale=1.0,
                                            mla_split=False)),
    "tied": dict(seed=44, tied=True),
}


def ds_model(models_dir: Path, name: str, **kw) -> Path:
    """A deepseek2 test model, made once per session."""
    path = models_dir / f"ds2-{name}.gguf"
    if not path.exists():
        make_model(path, arch="deepseek2", preset="tiny", **(kw or VARIANTS[name]))
    return path


async def our_logits(path, tokens=TOKENS, **kw):
    prefill, decode, disp = await backbone_logits(path, tokens, **kw)
    return prefill, decode, disp.stats


# ---------------------------------------------------------------------------------------------
# F32 logits against llama.cpp


@needs_llama
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.slow
async def test_f32_logits_match_llama_cpp(models_dir, variant):
    path = ds_model(models_dir, variant)
    ref = llama_logits(path, TOKENS)
    prefill, decode, _ = await our_logits(path, kernel="numpy")
    assert_logits_close(f"deepseek2 {variant}", ref, prefill=prefill, decode=decode)


async def test_both_mla_forms_are_the_same_function(models_dir):
    """attn_kv_b and the split attn_k_b + attn_v_b of one seed: the same weights, the same bits."""
    split, unsplit = ds_model(models_dir, "v3"), ds_model(models_dir, "v3-kv-b")
    names = {t.name for t in ModelLayout.open(split).reader.tensors}
    assert "blk.0.attn_k_b.weight" in names and "blk.0.attn_kv_b.weight" not in names
    assert "blk.0.attn_kv_b.weight" in {t.name for t in ModelLayout.open(unsplit).reader.tensors}
    a, b = await our_logits(split, TOKENS[:12], kernel="numpy"), await our_logits(unsplit, TOKENS[:12], kernel="numpy")
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])


@needs_llama
@pytest.mark.slow
async def test_yarn_is_what_makes_it_match(models_dir, monkeypatch):
    """The test has teeth: the same engine with plain RoPE and scale (YaRN ignored) misses by far."""
    path = ds_model(models_dir, "v3")
    ref = llama_logits(path, TOKENS[:16])
    monkeypatch.setattr(mla.Yarn, "from_hparams", classmethod(lambda cls, hp, n_rot, n_ctx: cls(
        n_rot, float(hp("rope.freq_base", 10000.0)))))
    plain, _, _ = await our_logits(path, TOKENS[:16], kernel="numpy")
    assert float(np.abs(plain - ref).max()) > 20 * tolerance(ref)


def test_yarn_scale_follows_llama_cpp():
    """DeepSeek-V3's numbers: factor 40, mscale_all_dim 1 (stored as 0.1): kq_scale = (1 + 0.1 ln 40)^2
    / sqrt(192); the rope's own magnitude is 1."""
    keys = {"rope.freq_base": 10000.0, "rope.scaling.type": "yarn", "rope.scaling.factor": 40.0,
            "rope.scaling.original_context_length": 4096, "rope.scaling.yarn_log_multiplier": 0.1}
    y = mla.Yarn.from_hparams(lambda k, d=None: keys.get(k, d), 64, 163840)
    assert abs(y.kq_scale(192) - (1 + 0.1 * np.log(40)) ** 2 / np.sqrt(192)) < 1e-7  # float32, as llama.cpp
    cos, sin = y.cos_sin(np.arange(5))
    assert np.allclose(cos ** 2 + sin ** 2, 1.0, atol=1e-6)
    assert np.allclose(cos[:, 0], np.cos(np.arange(5)), atol=1e-6)  # the fastest pair extrapolates
    assert np.allclose(cos[:, -1], np.cos(np.arange(5) * 10000.0 ** (-62 / 64) / 40), atol=1e-6)  # interpolates


# ---------------------------------------------------------------------------------------------
# Q4_K_M: routing per layer and greedy tokens against llama.cpp


def q4km_model(models_dir: Path) -> Path:
    return ds_model(models_dir, "q4_k_m", seed=45, qtype="q4_k_m")


@needs_llama
@pytest.mark.slow
def test_q4_k_m_routing_matches_llama_cpp_layer_by_layer(models_dir):
    """Each MoE layer from llama.cpp's own input to it (our dense path on the ggml kernel, as the
    backbone runs it): the experts chosen equal llama.cpp's ``ffn_moe_topk``; the router alone on
    llama.cpp's ``ffn_norm`` rows too."""
    path = q4km_model(models_dir)
    layout = ModelLayout.open(path)
    assert {t.tensor_type for t in layout.reader.tensors} & {Q.Q4_K, Q.Q6_K}
    model = load_dense(layout, "ggml")
    assert model.backend.tensors > 0
    names = {f"l_out-{il}" for il in range(model.n_layer)}
    moe_layers = [il for il in range(model.n_layer) if il >= model.n_dense_lead]
    assert moe_layers and model.n_dense_lead == 1
    names |= {f"{n}-{il}" for il in moe_layers for n in ("ffn_norm", "ffn_moe_topk", "ffn_inp")}
    cap = llama_intermediates(path, TOKENS, names)
    for il in moe_layers:
        h_in = cap[f"l_out-{il - 1}"]
        h = model.pre_moe(il, h_in, model.new_state(), 0)
        cur = model.ffn_input(il, h)
        ids, _ = model.route(il, cur)
        router_ids, _ = model.route(il, cap[f"ffn_norm-{il}"])
        rel = float(np.linalg.norm(h - cap[f"ffn_inp-{il}"]) / np.linalg.norm(cap[f"ffn_inp-{il}"]))
        print(f"layer {il}: attention + residual rel diff {rel:.2e}, routing equal {np.array_equal(ids, cap[f'ffn_moe_topk-{il}'])}")
        assert np.array_equal(router_ids, cap[f"ffn_moe_topk-{il}"]), f"layer {il}: router on llama.cpp's rows"
        assert np.array_equal(ids, cap[f"ffn_moe_topk-{il}"]), f"layer {il}: routing from llama.cpp's layer input"
        assert rel == 0.0  # llama.cpp's ops in llama.cpp's order: its bits


@needs_llama
@pytest.mark.slow
async def test_q4_k_m_prefill_logits_are_llama_cpps_bits(models_dir):
    """On the ggml kernel the whole forward pass is llama.cpp's ops on the same bytes, in its order:
    all-position logits equal llama.cpp's exactly, for 300 tokens (past the 256-position cache
    padding). What it took, each a last-bit difference that the 8-bit activation rounding of the
    next quantised mat-mul turned into ~0.1 on the logits: the MLA core as llama.cpp's graph,
    YaRN's kq_scale in float32, ggml's RMSNorm, ggml's sigmoid for the router and a float64 sum for
    the top-k weights' normalisation (ggml's sum_rows)."""
    path = q4km_model(models_dir)
    tokens = [(7919 * i + 11) % 540 for i in range(300)]
    ref = llama_logits(path, tokens)
    async with open_backbone(path, kernel="ggml") as swarm:
        ours = await sequence_logits(swarm.backbone, tokens)
    assert np.array_equal(ours, ref), float(np.abs(ours - ref).max())


@needs_llama
@pytest.mark.slow
async def test_q4_k_m_greedy_tokens_match_llama_cpp(models_dir):
    """32 greedy steps on the ggml kernel (prefill, then one token per step) equal llama.cpp's own
    greedy run's; no step is a near-tie (top-2 margin under 1e-3), and the logits each token was
    picked from are within 1e-4 of llama.cpp's (measured 3e-6: the MLA core is llama.cpp's ops,
    engine/arch/deepseek2/ggml_mla.py; a prefill's logits are its bits exactly, see the routing test)."""
    path = q4km_model(models_dir)
    prompt = TOKENS[:8]
    ref_toks, ref_rows = llama_greedy(path, prompt, 32)
    async with open_backbone(path, kernel="ggml") as swarm:
        bb = swarm.backbone
        state = bb.new_state()
        logits = await bb.forward(prompt, state)
        toks, rows = [], []
        for _ in range(32):
            rows.append(logits[-1])
            toks.append(int(np.argmax(logits[-1])))
            logits = await bb.forward([toks[-1]], state)
    top2 = -np.sort(-ref_rows, axis=1)[:, :2]
    margin = float((top2[:, 0] - top2[:, 1]).min())
    diff = float(np.abs(np.stack(rows) - ref_rows).max())
    print(f"generated {toks}; llama.cpp's smallest top-2 margin {margin:.3g}, max |logit diff| {diff:.3g}")
    assert margin > 1e-3, "a near-tie: pick another seed"
    assert toks == ref_toks
    assert len(set(toks)) > 3  # not a degenerate loop
    assert diff < 1e-4


# ---------------------------------------------------------------------------------------------
# Split == monolithic, batched == alone


async def test_split_equals_monolithic_and_batched_equals_alone(models_dir):
    path = ds_model(models_dir, "v3")
    mono_prefill, mono_decode, mono_stats = await our_logits(path, TOKENS[:20], kernel="numpy")
    assert mono_stats.requests == 0 and np.isfinite(mono_prefill).all()
    prefill, decode, stats = await our_logits(path, TOKENS[:20], workers=3, kernel="numpy")
    assert stats.requests > 0 and stats.local_groups == 0 and stats.fallbacks == 0
    assert np.array_equal(prefill, mono_prefill) and np.array_equal(decode, mono_decode)
    async with open_backbone(path, workers=3, transport="inproc", kernel="numpy") as swarm:
        bb = swarm.backbone
        seqs = [TOKENS[i:i + 4 + 2 * i] for i in range(3)]
        batched = await bb.forward_batch([(s, bb.new_state()) for s in seqs])
        alone = [await bb.forward(s, bb.new_state()) for s in seqs]
    assert all(np.array_equal(a, b) for a, b in zip(batched, alone))


@pytest.mark.slow
async def test_ggml_mla_core_split_and_batched_exact(models_dir):
    """Q4_K_M on the ggml kernel (the llama.cpp-ops MLA core): 3 workers == monolithic and
    batched == alone, bit for bit."""
    path = q4km_model(models_dir)
    mono = await our_logits(path, TOKENS[:20], kernel="ggml")
    split = await our_logits(path, TOKENS[:20], workers=3, kernel="ggml")
    assert split[2].requests > 0 and split[2].fallbacks == 0 and split[2].local_groups == 0
    assert np.array_equal(mono[0], split[0]) and np.array_equal(mono[1], split[1])
    async with open_backbone(path, workers=3, transport="inproc", kernel="ggml") as swarm:
        bb = swarm.backbone
        assert bb.model._ggml_core()
        seqs = [TOKENS[i:i + 4 + 2 * i] for i in range(3)]
        batched = await bb.forward_batch([(s, bb.new_state()) for s in seqs])
        alone = [await bb.forward(s, bb.new_state()) for s in seqs]
        # and decode steps of all three together == each alone
        states = [bb.new_state() for _ in seqs]
        for s, st in zip(seqs, states):
            await bb.forward(s, st)
        step = await bb.forward_batch([([7], st) for st in states])
        solo = []
        for s in seqs:
            st = bb.new_state()
            await bb.forward(s, st)
            solo.append(await bb.forward([7], st))
    assert all(np.array_equal(a, b) for a, b in zip(batched, alone))
    assert all(np.array_equal(a, b) for a, b in zip(step, solo))


@pytest.mark.slow
def test_ggml_mla_layer_is_one_graph_and_reuses_its_decode_graph(models_dir, monkeypatch):
    """On the ggml kernel an MLA layer is ONE ggml compute, prefill or decode (no numpy between
    pieces); a decode step's graph is kept and run again; the cache is written in place, grows
    past its capacity and past the 256-position padding with the same bits as the per-piece numpy
    cache would hold (within float32 noise of the numpy MLA, which rounds differently)."""
    path = q4km_model(models_dir)
    model = load_dense(ModelLayout.open(path), "ggml")
    assert model.backend.tensors > 0 and model._ggml_core()
    runner = model.backend.runner
    computes = []
    real = runner.compute
    monkeypatch.setattr(runner, "compute", lambda graph, macs: (computes.append(1), real(graph, macs))[1])
    rng = np.random.default_rng(3)
    h = rng.standard_normal((300, model.n_embd)).astype(np.float32)
    st = model.new_state()
    out = [model.pre_moe(1, h[:270], st, 0)]
    assert len(computes) == 1  # a 270-row prefill: one graph
    for i in range(270, 300):  # decode steps, past the cache's first capacity
        computes.clear()
        out.append(model.pre_moe(1, h[i:i + 1], st, i))
        assert len(computes) == 1
    assert runner.graph_stats["reused"] > 0
    cache = st.extra[1]
    assert cache.n == 300 and cache.rows.ctypes.data % 32 == 0
    model.ggml_core = False  # the numpy MLA on the same rows: close, and its cache rows close
    ref_state = model.new_state()
    ref = model.pre_moe(1, h, ref_state, 0)
    got = np.concatenate(out)
    assert float(np.abs(got - ref).max()) < 1e-2 * float(np.abs(ref).max())
    assert np.allclose(cache.rows[:300], ref_state.extra[1].rows[:300], rtol=1e-3, atol=1e-3)
    assert not np.array_equal(got, ref)  # two different computations (the test would see a silent fallback)


@pytest.mark.slow
def test_split_equals_monolithic_through_the_libp2p_swarm(models_dir, tmp_path):
    """Three worker processes (experts 0-5, 6-10, 11-15 of every MoE layer) found through a
    bootstrap node's DHT; `logits --swarm` equals the monolithic run, prefill and decode."""
    path = ds_model(models_dir, "v3")
    env = dict(os.environ, P2PSWARM_KERNEL="numpy", P2PSWARM_HOME=str(tmp_path / "home"))
    with shard_swarm(path, tmp_path, env, [(0, 6), (6, 11), (11, 16)]) as (boot, _):
        assert_swarm_prefill_and_decode_exact(path, TOKENS[:17], boot.addr, tmp_path, env)


def test_shards_hold_only_the_moe_layers(models_dir, tmp_path):
    from p2pswarm.model.slicer import slice_experts

    layout = ModelLayout.open(ds_model(models_dir, "v3"))
    assert layout.expert_layers == [1, 2, 3]
    slice_experts(layout.path, tmp_path / "s.gguf", None, (4, 8))
    assert ModelLayout.open(tmp_path / "s.gguf").expert_layers == [1, 2, 3]


# ---------------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize("keys,needle", [
    ({"deepseek2.expert_group_count": 5}, "deepseek2.expert_group_count"),  # does not divide 16 experts
    ({"deepseek2.expert_group_used_count": 4}, "deepseek2.expert_group_used_count"),  # all 4 groups
    ({"deepseek2.leading_dense_block_count": 4}, "deepseek2.leading_dense_block_count"),  # no MoE layer
    ({"deepseek2.rope.dimension_count": 31}, "deepseek2.rope.dimension_count"),  # odd
    ({"deepseek2.expert_gating_func": 3}, "deepseek2.expert_gating_func"),  # unsupported
])
def test_inconsistent_hyper_parameters_refused_at_load(models_dir, tmp_path, keys, needle):
    keys = {k: (v, GGUFValueType.UINT32, None) for k, v in keys.items()}
    bad = rewrite(ds_model(models_dir, "v3"), tmp_path / "bad.gguf", set_keys=keys)
    with pytest.raises(ModelFormatError, match=needle.replace(".", r"\.")):
        load_dense(ModelLayout.open(bad))


async def test_mtp_blocks_are_not_run(models_dir, tmp_path):
    """A file whose last block is a multi-token-prediction block (``nextn_predict_layers`` 1): the
    forward pass runs the blocks before it, so the 4-block v3 model computes what the 3-layer model
    of the same seed computes (tensors are seeded by name: layers 0-2 are the same), bit for bit."""
    mtp = rewrite(ds_model(models_dir, "v3"), tmp_path / "mtp.gguf",
                  set_keys={"deepseek2.nextn_predict_layers": (1, GGUFValueType.UINT32, None)})
    three = ds_model(models_dir, "v3-3layers", seed=41, layers=3)
    assert load_dense(ModelLayout.open(mtp)).n_layer == 3
    a, b = await our_logits(mtp, TOKENS[:8], kernel="numpy"), await our_logits(three, TOKENS[:8], kernel="numpy")
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])


@pytest.mark.slow
def test_missing_key_or_tensor_is_one_line(models_dir, tmp_path):
    src = ds_model(models_dir, "v3")
    no_key = rewrite(src, tmp_path / "nokey.gguf", drop_key="deepseek2.attention.kv_lora_rank")
    proc = run_cli("logits", str(no_key), "--tokens", "1,2,3", "--workers", "0", "--out", str(tmp_path / "a.npy"))
    assert_one_line_error(proc, "deepseek2.attention.kv_lora_rank")
    no_tensor = rewrite(src, tmp_path / "notensor.gguf", drop_tensor="blk.2.attn_kv_a_mqa.weight")
    proc = run_cli("logits", str(no_tensor), "--tokens", "1,2,3", "--workers", "0", "--out", str(tmp_path / "b.npy"))
    assert_one_line_error(proc, "blk.2.attn_kv_a_mqa.weight")


@pytest.mark.slow
def test_make_model_deepseek2_command(tmp_path):
    out = tmp_path / "m.gguf"
    proc = run_cli("make-model", "-o", str(out), "--arch", "deepseek2", "--layers", "2", "-q", check=True)
    assert "deepseek2" in proc.stdout
    layout = ModelLayout.open(out)
    assert layout.arch == "deepseek2" and layout.n_layer == 2 and layout.expert_layers == [1]
    assert layout.hparams["leading_dense_block_count"] == 1


def test_geometry_671b_shapes():
    """The preset's per-layer sizes are DeepSeek-V3's (the plan only: the file would be GBs)."""
    from p2pswarm.model import synth_deepseek2 as sd

    p = sd.PRESETS_DEEPSEEK2["geometry-671b"].refine(2, {}, {})
    assert (p.n_layer, p.n_dense_lead, p.n_embd, p.n_expert, p.n_expert_used, p.n_ff_exp) == (2, 1, 7168, 256, 8, 2048)
    plans = {t.name: t for t in p.plan(1000, "f32", "q4_k", False, False)}
    assert plans["blk.1.attn_q_b.weight"].shape == (128 * 192, 1536)
    assert plans["blk.1.attn_kv_a_mqa.weight"].shape == (576, 7168)
    assert plans["blk.1.attn_k_b.weight"].shape == (128, 512, 128)
    assert plans["blk.0.ffn_gate.weight"].shape == (18432, 7168)
    per_expert = sum(plans[f"blk.1.ffn_{k}_exps.weight"].nbytes for k in ("gate", "up", "down")) // 256
    assert per_expert == 3 * 7168 * 2048 // 256 * 144  # Q4_K: 144 bytes per 256 weights


def test_ggml_layer_graph_folds_the_ffn_side_with_the_pieces_bits(models_dir, monkeypatch):
    """On the ggml kernel ``layer_in`` is ONE graph per layer: the MLA, ffn_norm and, on the
    leading dense layer, its FFN and residual (``layer_out`` then computes nothing), on a MoE
    layer the router's logits and sigmoid and the shared expert (llama.cpp's deepseek2.cpp in one
    graph). Prefill and decode rows, one sequence and two: the same bits as the pieces (a graph
    each for the MLA, ffn_norm, the router and the FFN, numpy between)."""
    from p2pswarm.engine.arch.common import LayerByPieces

    path = q4km_model(models_dir)
    model = load_dense(ModelLayout.open(path), "ggml")
    assert model._ggml_core() and model.n_dense_lead == 1 and model.n_expert_shared
    runner = model.backend.runner
    computes = []
    real = runner.compute
    monkeypatch.setattr(runner, "compute", lambda graph, macs: (computes.append(1), real(graph, macs))[1])
    rng = np.random.default_rng(5)
    E = model.n_embd
    fused_st, piece_st = [model.new_state(), model.new_state()], [model.new_state(), model.new_state()]
    for il in range(model.n_layer):
        assert model._ffn_fused(il)
    for step, (rows, segs) in enumerate([((7, 5), [(0, 0, 7), (1, 0, 5)]), ((1,), [(0, 7, 1)]),
                                         ((1, 1), [(0, 8, 1), (1, 5, 1)])]):
        h = rng.standard_normal((sum(rows), E)).astype(np.float32)
        for il in range(model.n_layer):
            computes.clear()
            lin = model.layer_in(il, h, [(fused_st[s], p0, n) for s, p0, n in segs])
            assert len(computes) == 1, f"step {step} layer {il}"
            ref = LayerByPieces.layer_in(model, il, h, [(piece_st[s], p0, n) for s, p0, n in segs])
            for name in ("h", "cur", "ids", "weights"):
                assert np.array_equal(getattr(lin, name), getattr(ref, name)), (step, il, name)
            moe = (0.1 * rng.standard_normal((h.shape[0], E))).astype(np.float32)
            computes.clear()
            out = model.layer_out(il, lin, moe)
            assert len(computes) == 0  # the dense FFN / shared expert came with the layer's graph
            assert np.array_equal(out, model.post_moe(il, ref.h, ref.cur, moe)), (step, il)
            assert set(lin.extras) == ({"out"} if il < model.n_dense_lead else {"shared"})
