"""gpt-oss (attention sinks, alternating sliding-window layers, YaRN, biases everywhere, the clamped
SwiGLU, softmax-over-selected routing, MXFP4 experts), checked against llama.cpp.

* F32: all-position logits within 1e-4 + 2e-5 * max|logit| of llama.cpp's, prefill and token-by-token
  decode, on 32 tokens with a window of 8 (the window slides 24 times); the same model with its
  window or its sinks ignored misses by far more (the test has teeth).
* MXFP4 experts: fed llama.cpp's own input to each layer's router, every layer routes exactly as
  llama.cpp did; the ggml kernel's experts on llama.cpp's rows within 1e-4 of llama.cpp's MoE output
  (the same ops); greedy tokens equal llama.cpp's for 32 steps wherever its top-2 margin is not a
  near-tie.
* split == monolithic bit for bit over 3 workers (in-process; and as OS processes through the
  libp2p DHT); batched == alone bit for bit.
* Every expert kernel computes gpt-oss experts as the backbone's replica does or refuses: numpy and
  ggml agree within the activation rounding, portable refuses in one line.
* Bad hyper-parameters and missing tensors are refused at load, the key or tensor named.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType

from p2pswarm.backbone.sessions.local import open_backbone
from p2pswarm.engine.arch import load_dense
from p2pswarm.engine.arch.gptoss import GptOss
from p2pswarm.engine.experts.numpy_bank import ExpertBank
from p2pswarm.engine.experts.ggml_bank import GgmlExpertBank
from p2pswarm.engine.kernels import make_bank
from p2pswarm.errors import ModelFormatError
from p2pswarm.model.layout import ModelLayout
from p2pswarm.model.slicer import slice_backbone, slice_experts
from p2pswarm.model.synth import describe, make_model

from conftest import assert_one_line_error, llama_logits, needs_llama, run_cli
from helpers.arch_checks import SCHEDULE, TOKENS
from helpers.arch_checks import alone as _alone
from helpers.arch_checks import backbone_logits, experts_in_front_and_per_call
from helpers.arch_checks import forward as _forward
from helpers.arch_checks import run_schedule as _run_schedule
from helpers.compare import assert_logits_close, tolerance
from helpers.gguf_edit import rewrite as _rewrite
from helpers.ggml import needs_ggml
from helpers.llama_ref import llama_intermediates

F32 = np.float32

VARIANTS = {
    "f32": dict(seed=41),
    # every layer slides, through the key llama.cpp reads (pattern 0)
    "f32-pattern0": dict(seed=42),
    "mxfp4": dict(seed=43, expert_qtype="mxfp4"),
}


def oss_model(models_dir: Path, name: str, **kw) -> Path:
    """A gpt-oss test model (the tiny preset: 4 layers, window 8), made once per session."""
    path = models_dir / f"oss-{name}.gguf"
    if not path.exists():
        make_model(path, arch="gpt-oss", preset="tiny", **(kw or VARIANTS[name]))
        if name == "f32-pattern0":
            tmp = path.with_suffix(".tmp")
            os.replace(path, tmp)
            _rewrite(tmp, path, set_keys={"gpt-oss.attention.sliding_window_pattern": (0, GGUFValueType.UINT32, None)})
            tmp.unlink()
    return path


async def our_logits(path, tokens=TOKENS, **kw):
    prefill, decode, disp = await backbone_logits(path, tokens, **kw)
    return prefill, decode, disp.stats


# ---------------------------------------------------------------------------------------------
# F32 logits against llama.cpp


@needs_llama
@pytest.mark.parametrize("variant", ["f32", "f32-pattern0"])
@pytest.mark.parametrize("kernel", ["numpy", pytest.param("ggml", marks=needs_ggml)])
@pytest.mark.slow
async def test_f32_logits_match_llama_cpp(models_dir, variant, kernel):
    path = oss_model(models_dir, variant)
    model = load_dense(ModelLayout.open(path))
    assert model.n_swa == 8 < len(TOKENS)
    assert model.swa == ([True] * 4 if variant == "f32-pattern0" else [True, False, True, False])
    ref = llama_logits(path, TOKENS)
    prefill, decode, _ = await our_logits(path, kernel=kernel)
    assert_logits_close(f"gpt-oss {variant} {kernel}", ref, prefill=prefill, decode=decode)


@needs_llama
@pytest.mark.slow
def test_window_and_sinks_are_what_match(models_dir):
    """The match has teeth: ignoring the window, or the sinks, or YaRN misses by >> the tolerance."""
    path = oss_model(models_dir, "f32")
    ref = llama_logits(path, TOKENS)
    layout = ModelLayout.open(path)
    model, bank = load_dense(layout), ExpertBank(layout)
    right = _forward(model, bank, TOKENS)
    assert np.abs(right - ref).max() <= tolerance(ref)
    wrong = []
    full = load_dense(layout)
    full.swa = [False] * full.n_layer
    wrong.append(_forward(full, bank, TOKENS))
    sinkless = load_dense(layout)
    for il in range(sinkless.n_layer):
        sinkless.w.provide(f"blk.{il}.attn_sinks.weight", np.full(sinkless.n_head, -1e30, F32))
    wrong.append(_forward(sinkless, bank, TOKENS))
    plain = load_dense(layout)
    plain.ext_factor, plain.freq_scale, plain.attn_factor = 0.0, 1.0, 1.0
    wrong.append(_forward(plain, bank, TOKENS))
    for w in wrong:
        assert np.abs(w - ref).max() > 10 * tolerance(ref)


@needs_llama
@needs_ggml
@pytest.mark.slow
@pytest.mark.parametrize("variant", ["f32", "f32-pattern0", "mxfp4"])
def test_layer_graph_matches_llama_cpp_past_the_window(models_dir, variant):
    """Under the ggml kernel every attention layer is one ggml graph (llama.cpp's ops: biases, YaRN
    RoPE, sinks by ``ggml_soft_max_add_sinks``, the window in the mask), and it is what ran (no
    numpy attention). Over 48 tokens (a 20-token prefill, then 28 decode steps, past several
    trims of the sliding caches: window 8) its logits are within the tolerance of llama.cpp's;
    the MXFP4 model's too."""
    path = oss_model(models_dir, variant)
    layout = ModelLayout.open(path)
    model = load_dense(layout, "ggml")
    bank = make_bank(layout, "ggml")
    tokens = [(7 * i + 3) % 500 for i in range(48)]
    state = model.new_state()
    rows = [_forward(model, bank, tokens[:20], state)]
    rows += [_forward(model, bank, tokens[i:i + 1], state, pos0=i) for i in range(20, 48)]
    assert model.layer_graph_calls == model.n_layer * 29
    slid = [state.kv[il] for il in range(model.n_layer) if model.swa[il]]
    assert slid and all(kv.first > 0 and kv.first + kv.n == 48 for kv in slid)
    ours, ref = np.concatenate(rows), llama_logits(path, tokens)
    print(f"gpt-oss {variant} layer graph vs llama.cpp: max |diff| {float(np.abs(ours - ref).max()):.3g}, "
          f"tolerance {tolerance(ref):.3g}")
    assert np.abs(ours - ref).max() <= tolerance(ref)


def test_swa_pattern_and_window_mask():
    """llama.cpp's pattern 2 (dense_first false): even layers slide; a query at p sees p-n+1..p."""
    from p2pswarm.engine.arch.gptoss.model import attention_sinks

    rng = np.random.default_rng(0)
    q = rng.standard_normal((6, 2, 8)).astype(F32)
    k = rng.standard_normal((6, 1, 8)).astype(F32)
    v = rng.standard_normal((6, 1, 8)).astype(F32)
    sinks = np.full(2, -1e30, F32)
    out = attention_sinks(q, k, v, 0, sinks, window=3)
    for t in range(6):  # query t alone against its window's keys
        lo = max(0, t - 2)
        alone = attention_sinks(q[t:t + 1], k[lo:t + 1], v[lo:t + 1], t - lo, sinks, window=None)
        assert np.allclose(out[t], alone[0], atol=1e-6)


@pytest.mark.slow
def test_sliding_window_cache_stays_bounded_and_logits_unchanged(models_dir):
    """A sliding layer's cache holds at most ~2 windows however long the sequence (a 24-token prefill,
    then 56 decode steps with a window of 8; the full layers keep all 80), and the logits are
    those of the untrimmed cache (the dropped keys were masked: the same function, float32 sums
    over fewer zero terms at most a last bit apart)."""
    from p2pswarm.engine.arch.gptoss.model import WindowKVCache
    from p2pswarm.engine.state import KVCache, SequenceState

    path = oss_model(models_dir, "f32")
    layout = ModelLayout.open(path)
    model, bank = load_dense(layout), ExpertBank(layout)
    tokens = [(7 * i + 3) % 500 for i in range(80)]
    untrimmed = SequenceState(kv={il: KVCache(model.n_head_kv, model.head_dim) for il in range(model.n_layer)})
    state = model.new_state()
    assert [isinstance(state.kv[il], WindowKVCache) for il in range(model.n_layer)] == model.swa
    rows, ref = [_forward(model, bank, tokens[:24], state)], [_forward(model, bank, tokens[:24], untrimmed)]
    held = []
    for i in range(24, 80):
        rows.append(_forward(model, bank, tokens[i:i + 1], state, pos0=i))
        ref.append(_forward(model, bank, tokens[i:i + 1], untrimmed, pos0=i))
        held.append(max(state.kv[il].k.shape[0] for il in range(model.n_layer) if model.swa[il]))
    w = model.n_swa
    for il in range(model.n_layer):
        kv = state.kv[il]
        if model.swa[il]:
            assert kv.first + kv.n == 80 and w - 1 <= kv.n < 2 * w and kv.first > 0
        else:
            assert kv.n == 80 and untrimmed.kv[il].n == 80
    assert max(held[8:]) <= 2 * w  # the prefill's buffer given back, then never grown past 2 windows
    ours, theirs = np.concatenate(rows), np.concatenate(ref)
    print(f"trimmed vs untrimmed: max |diff| {float(np.abs(ours - theirs).max()):.3g}, "
          f"equal bits {np.array_equal(ours, theirs)}")
    assert np.allclose(ours, theirs, rtol=1e-5, atol=1e-5 * float(np.abs(theirs).max()))
    assert (np.argmax(ours, axis=1) == np.argmax(theirs, axis=1)).all()


# ---------------------------------------------------------------------------------------------
# MXFP4 experts against llama.cpp


def _captured(path, n_layer):
    names = set()
    for il in range(n_layer):
        names |= {f"{n}-{il}" for n in ("attn_post_norm", "ffn_moe_topk", "ffn_moe_weights_softmax",
                                        "ffn_moe_out", "l_out")}
    return llama_intermediates(path, TOKENS, names)


@needs_llama
@needs_ggml
@pytest.mark.slow
def test_mxfp4_routing_matches_llama_cpp_layer_by_layer(models_dir):
    path = oss_model(models_dir, "mxfp4")
    layout = ModelLayout.open(path)
    assert {t.ggml_type for kinds in layout.expert_tensors.values() for k, t in kinds.items()
            if not k.endswith("_bias")} == {Q.MXFP4}
    cap = _captured(path, layout.n_layer)
    model = load_dense(layout)
    ggml_bank, numpy_bank = GgmlExpertBank(layout), ExpertBank(layout)
    from p2pswarm.backbone.serving.runner import combine, expert_groups

    for il in range(layout.n_layer):
        cur = np.ascontiguousarray(cap[f"attn_post_norm-{il}"])
        ids, w = model.route(il, cur)
        ref_ids = cap[f"ffn_moe_topk-{il}"]
        assert np.array_equal(ids, ref_ids), f"layer {il}: {(ids != ref_ids).any(axis=1).sum()} tokens rerouted"
        assert np.abs(w - cap[f"ffn_moe_weights_softmax-{il}"].reshape(w.shape)).max() < 1e-6
        groups = expert_groups(ids)
        ref = cap[f"ffn_moe_out-{il}"]
        for bank, bound in ((ggml_bank, 1e-5), (numpy_bank, 5e-2)):  # numpy does not round activations to Q8_0
            parts = dict(zip([e for e, _ in groups], bank.forward_groups(il, cur, groups)))
            moe = combine(ids, w, groups, parts)
            rel = float(np.linalg.norm(moe - ref) / np.linalg.norm(ref))
            print(f"layer {il} {bank.kernel}: routed experts rel {rel:.2e}")
            assert rel < bound


@needs_llama
@needs_ggml
@pytest.mark.slow
async def test_mxfp4_greedy_tokens_match_llama_cpp(models_dir):
    """32 greedy steps by our backbone (ggml kernel); llama.cpp fed the same tokens picks the same
    argmax at every step where its own top-2 margin is not a near-tie (< 1e-3)."""
    path = oss_model(models_dir, "mxfp4")
    prompt = TOKENS[:4]
    async with open_backbone(path, workers=0, kernel="ggml") as swarm:
        bb = swarm.backbone
        state = bb.new_state()
        logits = await bb.forward(prompt, state)
        tokens = list(prompt)
        for _ in range(32):
            nxt = int(np.argmax(logits[-1]))
            tokens.append(nxt)
            logits = await bb.forward([nxt], state)
    ref = llama_logits(path, tokens)
    chosen = tokens[len(prompt):]
    compared = 0
    for step, tok in enumerate(chosen):
        row = ref[len(prompt) - 1 + step]
        top2 = np.sort(row)[-2:]
        if top2[1] - top2[0] < 1e-3:
            continue
        compared += 1
        assert int(np.argmax(row)) == tok, f"step {step}: llama.cpp {int(np.argmax(row))}, ours {tok}"
    assert compared >= 28
    assert len(set(chosen)) > 3  # not a degenerate loop of one token


# ---------------------------------------------------------------------------------------------
# Split == monolithic, batched == alone


@pytest.mark.parametrize("variant,kernel", [("f32", "numpy"), pytest.param("mxfp4", "ggml", marks=needs_ggml)])
async def test_split_equals_monolithic(models_dir, variant, kernel):
    path = oss_model(models_dir, variant)
    mono_p, mono_d, _ = await our_logits(path, kernel=kernel)
    split_p, split_d, stats = await our_logits(path, workers=3, kernel=kernel)
    assert stats.fallbacks == 0 and stats.remote_groups > 0 and stats.local_groups == 0
    assert np.array_equal(mono_p, split_p) and np.array_equal(mono_d, split_d)


@pytest.mark.parametrize("kernel", ["numpy", pytest.param("ggml", marks=needs_ggml)])
async def test_batched_equals_alone(models_dir, kernel):
    path = oss_model(models_dir, "mxfp4")
    async with open_backbone(path, workers=0, kernel=kernel) as mono:
        batched = await _run_schedule(mono.backbone, True)
        alone = await _alone(mono.backbone)
    for i, step in enumerate(SCHEDULE):
        for (s, _), x in zip(step, batched[i]):
            assert np.array_equal(x, alone[(i, s)]), (i, s)


@needs_ggml
async def test_experts_in_front_of_the_next_layer_give_the_per_call_bits(models_dir):
    """On the local path a layer's MXFP4 experts, their combine and residual run in front of the
    next layer's attention graph, the last layer's in front of the final norm and lm head (one
    graph per layer boundary, ``Backbone.fused_layers`` counts them): a prefill of one sequence and its token-by-token decode give the bits of the per-call
    path (the bank's graph, numpy's combine and ``h + moe``, then the layer's graph), which is
    also what split workers compute (test_split_equals_monolithic)."""
    path = oss_model(models_dir, "mxfp4-q8_0", seed=44, expert_qtype="mxfp4", qtype="q8_0")  # the head on ggml too
    got, n_layer = await experts_in_front_and_per_call(path)
    (p1, d1, n1), (p0, d0, n0) = got[True], got[False]
    assert n0 == 0 and n1 == n_layer * (1 + len(TOKENS))  # every layer end of every step fused, the last too
    assert np.array_equal(p1, p0) and np.array_equal(d1, d0)


@needs_ggml
async def test_decode_step_as_one_graph_gives_the_layer_by_layer_bits(models_dir):
    """On the local path a one-sequence decode step is ONE graph (embedding, every layer with its
    experts, the router's top-k by a Python node inside it, the head): ``GgmlRunner.computes`` goes
    up by 1 a step, ``Backbone.one_graph_steps`` counts them, and the graph is kept. Interleaved with batched steps of
    three sequences (prefill, then decode, which run layer by layer), every step's logits and the
    groups the dispatcher counts are those of the layer-by-layer path (``decode_as_one_graph`` off)."""
    path = oss_model(models_dir, "mxfp4-q8_0", seed=44, expert_qtype="mxfp4", qtype="q8_0")  # the head on ggml too
    prompts = [TOKENS[:5], TOKENS[5:7], TOKENS[7:15]]
    got = {}
    for one in (True, False):
        async with open_backbone(path, workers=0, kernel="ggml") as mono:
            bb = mono.backbone
            bb.model.decode_as_one_graph = one
            runner = bb.model.backend.runner
            demand, counted = bb.dispatcher.demand, []
            count = demand.add
            demand.add = lambda layer, groups, now=None: (  # type: ignore[method-assign]
                counted.append((layer, [(e, r.tolist()) for e, r in groups])), count(layer, groups, now))
            states = [bb.new_state() for _ in prompts]
            out = await bb.forward_batch(list(zip(prompts, states)))
            graphs = []
            for step in range(5):
                out += await bb.forward_batch([([TOKENS[(20 + step + i) % len(TOKENS)]], st) for i, st in enumerate(states)])
                for i, st in enumerate(states):
                    before, built = runner.computes, runner.graph_stats["built"]
                    out.append(await bb.forward([TOKENS[(3 * step + i) % len(TOKENS)]], st))
                    graphs.append((runner.computes - before, runner.graph_stats["built"] - built))
            stats = bb.dispatcher.stats
            got[one] = (out, graphs, bb.one_graph_steps, (counted, stats.layers, stats.local_groups))
    (o1, g1, n1, d1), (o0, g0, n0, d0) = got[True], got[False]
    assert n1 == 15 and n0 == 0
    # one graph a step, kept: built again only where a sequence's caches moved (in its key: a
    # sliding layer's trim gives a long prompt's buffer back), not every step
    assert [n for n, _ in g1] == [1] * 15 and sum(b for _, b in g1) <= 6 and min(n for n, _ in g0) > 1
    assert len(o1) == len(o0) and all(np.array_equal(a, b) for a, b in zip(o1, o0))
    assert d1 == d0


@pytest.mark.slow
@pytest.mark.parametrize("variant,kernel", [("f32", "numpy"), pytest.param("mxfp4", "ggml", marks=needs_ggml)])
def test_split_equals_monolithic_over_the_swarm(models_dir, tmp_path, variant, kernel):
    """3 workers as OS processes, found through the libp2p DHT: `logits --swarm` == monolithic."""
    from p2pswarm.model.slicer import split_ranges

    from helpers.procs import assert_swarm_prefill_and_decode_exact, shard_swarm

    path = oss_model(models_dir, variant)
    env = dict(os.environ, P2PSWARM_KERNEL=kernel, P2PSWARM_HOME=str(tmp_path / "home"))
    with shard_swarm(path, tmp_path, env, split_ranges(16, 3)) as (boot, _):
        assert_swarm_prefill_and_decode_exact(path, TOKENS[:17], boot.addr, tmp_path, env, kernel=kernel)


# ---------------------------------------------------------------------------------------------
# Slices, kernels, the file


def test_shards_carry_the_expert_biases_and_backbone_the_rest(models_dir, tmp_path):
    path = oss_model(models_dir, "mxfp4")
    src = ModelLayout.open(path)
    shard = ModelLayout.open(slice_experts(path, tmp_path / "s.gguf", None, (5, 11)).path)
    data = src.reader.data
    for il, kinds in shard.expert_tensors.items():
        assert set(kinds) == {"gate", "up", "down", "gate_bias", "up_bias", "down_bias"}
        for kind, t in kinds.items():  # each kind is the source's byte range of experts 5..10
            off, n = src.expert_tensors[il][kind].slabs(5, 11)
            assert bytes(shard.reader.data[t.data_offset:t.data_offset + t.nbytes]) == bytes(data[off:off + n])
    bb = slice_backbone(path, tmp_path / "bb.gguf").path
    names = {t.name for t in ModelLayout.open(bb, require_experts=False).reader.tensors}
    assert "blk.0.ffn_gate_inp.bias" in names and "blk.0.attn_sinks.weight" in names
    assert not any("_exps." in n for n in names)
    # a shard computes its experts exactly as the full model's bank
    x = np.random.default_rng(1).standard_normal((5, 256)).astype(F32)
    for a, b in zip(ExpertBank(shard).forward_groups(2, x, [(7, np.arange(5))]),
                    ExpertBank(src).forward_groups(2, x, [(7, np.arange(5))])):
        assert np.array_equal(a, b)


def test_portable_kernel_refuses_gpt_oss(models_dir):
    layout = ModelLayout.open(oss_model(models_dir, "mxfp4"))
    with pytest.raises(ModelFormatError, match="portable kernel does not compute gpt-oss experts"):
        make_bank(layout, "portable")


def test_worker_answers_only_in_its_own_family(models_dir, tmp_path):
    """A gpt-oss worker does not offer portable answers (its hello lists its own family only), and
    asked for them says why in one line."""
    from p2pswarm.engine.kernels import portable_family
    from p2pswarm.errors import UserError
    from p2pswarm.worker.expert_worker import ExpertWorker

    shard = slice_experts(oss_model(models_dir, "f32"), tmp_path / "s.gguf", None, (0, 8)).path
    w = ExpertWorker(shard, kernel="numpy")
    assert w.families == ("numpy",)
    with pytest.raises(UserError, match="portable kernel does not compute gpt-oss experts"):
        w.bank_for(portable_family())


def test_mxfp4_experts_have_the_planned_scale_and_size(models_dir):
    """The random MXFP4 blocks dequantise (gguf-py) to weights of std ~1/sqrt(n_embd); an expert is
    its three MXFP4 matrices (17 bytes per 32 weights) and three F32 bias rows."""
    layout = ModelLayout.open(oss_model(models_dir, "mxfp4"))
    gate = ExpertBank(layout)._weights(0, 3)[0]
    assert gate.shape == (256, 256) and 0.03 < float(gate.std()) < 0.1  # ~1/sqrt(256)
    info = describe(layout.path)
    assert info["bytes_per_expert"] == 3 * 256 * 256 // 32 * 17 + 4 * (256 + 256 + 256)


@pytest.mark.slow
def test_make_model_gpt_oss_command(tmp_path):
    out = tmp_path / "m.gguf"
    proc = run_cli("make-model", "--arch", "gpt-oss", "-o", str(out), "--layers", "2", "--expert-type", "mxfp4",
                   "--sliding-window", "16", "-q", check=True)
    assert "gpt-oss" in proc.stdout and "MXFP4" in proc.stdout
    model = GptOss(ModelLayout.open(out))
    assert model.n_swa == 16 and model.n_layer == 2
    bad = run_cli("make-model", "--arch", "qwen3moe", "-o", str(tmp_path / "x.gguf"), "--sliding-window", "4")
    assert_one_line_error(bad, "sliding_window")


@pytest.mark.parametrize("change,needle", [
    ({"gpt-oss.attention.head_count_kv": (3, GGUFValueType.UINT32, None)}, "gpt-oss.attention.head_count"),
    ({"gpt-oss.attention.sliding_window": (0, GGUFValueType.UINT32, None)}, "gpt-oss.attention.sliding_window"),
    ({"gpt-oss.expert_used_count": (17, GGUFValueType.UINT32, None)}, "gpt-oss.expert_used_count"),
    ({"gpt-oss.rope.scaling.type": ("longrope", GGUFValueType.STRING, None)}, "gpt-oss.rope.scaling.type"),
    ({"gpt-oss.attention.sliding_window_pattern": ("2", GGUFValueType.STRING, None)},
     "gpt-oss.attention.sliding_window_pattern"),
])
@pytest.mark.slow
def test_bad_hyper_parameters_are_refused_at_load(models_dir, tmp_path, change, needle):
    bad = _rewrite(oss_model(models_dir, "f32"), tmp_path / "bad.gguf", set_keys=change)
    proc = run_cli("logits", str(bad), "--tokens", "1,2,3", "--out", str(tmp_path / "x.npy"), "--workers", "0")
    assert_one_line_error(proc, needle)


@pytest.mark.parametrize("drop", [
    ("key", "gpt-oss.attention.sliding_window"),
    ("key", "gpt-oss.attention.layer_norm_rms_epsilon"),
    ("tensor", "blk.1.attn_sinks.weight"),
    ("tensor", "blk.0.ffn_gate_inp.bias"),
    ("tensor", "blk.2.attn_output.bias"),
    ("tensor", "blk.3.ffn_down_exps.bias"),
])
@pytest.mark.slow
def test_missing_key_or_tensor_is_one_line(models_dir, tmp_path, drop):
    what, name = drop
    bad = _rewrite(oss_model(models_dir, "f32"), tmp_path / "bad.gguf",
                   drop_key=name if what == "key" else None, drop_tensor=name if what == "tensor" else None)
    proc = run_cli("logits", str(bad), "--tokens", "1,2,3", "--out", str(tmp_path / "x.npy"), "--workers", "0")
    assert_one_line_error(proc, name)


@needs_llama
@needs_ggml
@pytest.mark.slow
def test_geometry_gpt_oss_120b_loads_in_llama_cpp(tmp_path):
    """gpt-oss-120b's layer geometry (2 layers, MXFP4 experts, Q8_0 dense): llama.cpp's loader takes
    it, and on llama.cpp's own rows each layer routes as it does and the ggml kernel's experts give
    its MoE output (128 experts, top-4, ff 2880, 64 heads of 64, window 128 on layer 0)."""
    from p2pswarm.backbone.serving.runner import combine, expert_groups

    path = tmp_path / "g.gguf"
    make_model(path, arch="gpt-oss", preset="geometry-gpt-oss-120b", layers=2, qtype="q8_0")
    try:
        info = describe(path)
        assert info["bytes_per_expert"] == 13_253_760 and info["expert_types"] == ["F32", "MXFP4"]
        layout = ModelLayout.open(path)
        model = load_dense(layout)
        assert (model.n_embd, model.n_head, model.n_head_kv, model.head_dim, model.n_expert, model.n_expert_used,
                model.n_ff_exp, model.n_swa, model.swa) == (2880, 64, 8, 64, 128, 4, 2880, 128, [True, False])
        assert model.freq_scale == 1 / 32 and model.ext_factor == 1.0 and model.n_ctx_orig == 4096
        names = {f"{n}-{il}" for il in range(2) for n in ("attn_post_norm", "ffn_moe_topk", "ffn_moe_out")}
        cap = llama_intermediates(path, TOKENS[:8], names)
        bank = GgmlExpertBank(layout)
        for il in range(2):
            cur = np.ascontiguousarray(cap[f"attn_post_norm-{il}"])
            ids, w = model.route(il, cur)
            assert np.array_equal(ids, cap[f"ffn_moe_topk-{il}"]), il
            groups = expert_groups(ids)
            moe = combine(ids, w, groups, dict(zip([e for e, _ in groups], bank.forward_groups(il, cur, groups))))
            ref = cap[f"ffn_moe_out-{il}"]
            assert float(np.linalg.norm(moe - ref) / np.linalg.norm(ref)) < 1e-5
    finally:
        path.unlink(missing_ok=True)
