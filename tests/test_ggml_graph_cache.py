"""Kept ggml graphs (GgmlRunner.graph): a decode step's graphs are built once and run again.

* A batched decode loop through a qwen35moe model (DeltaNet and attention layers as one graph each,
  the router, the shared expert, the lm head, the replica's routed experts) reuses its graphs from the second step on, and its
  logits and every sequence's state are the bits of the same loop with the cache off; a sequence
  replaced by a new one mid-run (new state memory) gets graphs of its own, and the same bits.
* Attention spans come in multiples of KV_PAD: a sequence decoding across a span boundary gets one
  new graph there, and the bits of the uncached run.
* Room: a key's graph is kept on its second build; a graph in use is never dropped for a new one
  (the new one is built per call instead); a graph unused for STALE_CALLS calls makes room; a prefill's layer graphs (many rows per sequence)
  are not kept; the kept bytes stay within the cap.
* Scratch: a call's scratch context above KEEP_BYTES is kept by a runner given ``keep_bytes``
  (the backbone's) and the next such call pages nothing in; it is freed after IDLE_RELEASE_S
  without one, and at once by a runner without ``keep_bytes`` (a worker's) or over it.
"""
from __future__ import annotations

import resource
import time

import numpy as np
import pytest

from p2pswarm.backbone.serving.runner import combine, expert_groups
from p2pswarm.engine.ggml import attention as ggml_attention
from p2pswarm.engine.arch import load_dense
from p2pswarm.engine.ggml.lib import GGML_TYPE_F32, load_libggml
from p2pswarm.engine.ggml.runner import GgmlRunner, f32_view
from p2pswarm.engine.kernels import make_bank
from p2pswarm.model.layout import ModelLayout
from p2pswarm.model.synth import make_model

from helpers.ggml import needs_ggml

pytestmark = needs_ggml


def _open(models_dir, cache: bool):
    path = models_dir / "q35-graph-cache-q8_0.gguf"
    if not path.exists():
        make_model(path, arch="qwen35moe", preset="tiny", seed=23, qtype="q8_0")
    layout = ModelLayout.open(path)
    model = load_dense(layout, "ggml")
    runner = model.backend.runner
    if not cache:
        runner.graph_cache_bytes = 0
    return model, make_bank(layout, "ggml", graph_cache_bytes=(64 << 20) if cache else 0), runner


def _step(model, bank, segs, tokens):
    """One step of the layer loop (the backbone's, synchronously) for ``segs`` = (state, pos0, n)."""
    h = model.embed(np.asarray(tokens))
    for il in range(model.n_layer):
        lin = model.layer_in(il, h, segs)
        groups = expert_groups(lin.ids)
        partials = dict(zip([e for e, _ in groups], bank.forward_groups(il, lin.cur, groups)))
        h = model.layer_out(il, lin, combine(lin.ids, lin.weights, groups, partials))
    for st, _, n in segs:
        st.n_past += n
    return model.output(h)


def _prefill(model, bank, tokens):
    st = model.new_state()
    _step(model, bank, [(st, 0, len(tokens))], tokens)
    return st


def _state_bits(model, st) -> list[bytes]:
    out = []
    for il in range(model.n_layer):
        if model.recurrent[il]:
            out += [st.extra[il].conv.tobytes(), st.extra[il].buf.tobytes()]
        else:
            kv = st.kv[il]
            out += [kv.k[:kv.n].tobytes(), kv.vt[..., :kv.n].tobytes()]
    return out


def _run(models_dir, cache: bool):
    model, bank, runner = _open(models_dir, cache)
    prompts = [[5, 211, 37, 90], [14, 14, 302, 8, 66], [129, 3, 250]]
    states = [_prefill(model, bank, p) for p in prompts]
    kept_after_prefill = [k for k in runner._graphs if k[0] in ("deltanet", "attention")]
    logits, built = [], []
    for step in range(7):
        if step == 4:  # a sequence leaves, a new one joins: new state memory, a new key
            states[1] = _prefill(model, bank, [41, 19, 180])
        toks = [(7 * step + 31 * i + 3) % 256 for i in range(len(states))]
        logits.append(_step(model, bank, [(st, st.n_past, 1) for st in states], toks))
        built.append(runner.graph_stats["built"])
    model.bank_stats = bank.runner.graph_stats  # the replica's graphs (routed experts)
    return model, runner, logits, [b for st in states for b in _state_bits(model, st)], built, kept_after_prefill


def test_decode_steps_reuse_their_graphs_and_give_the_bits_of_fresh_ones(models_dir):
    model, on, logits_on, states_on, built_on, kept_prefill = _run(models_dir, cache=True)
    _, off, logits_off, states_off, _, _ = _run(models_dir, cache=False)
    assert kept_prefill == [], "a prefill's layer graphs (several rows per sequence) were kept"
    assert off.graph_stats["kept"] == 0 and off.graph_stats["reused"] == 0
    # per decode step: every layer's one-graph layer, the router, the shared expert, the lm head
    assert on.graph_stats["reused"] >= 4 * model.n_layer, on.graph_stats
    # a decode step's layer graphs are kept on their first build (they recur), and the other
    # graphs are kept by step 1 too: steps 2 to 4 (same sequences) build nothing;
    # step 5 (a new sequence) does, then step 7 nothing
    assert built_on[3] == built_on[2] == built_on[1] == built_on[0], built_on
    assert built_on[4] > built_on[3], built_on
    assert built_on[6] == built_on[5], built_on
    assert 0 < on._graph_bytes <= on.graph_cache_bytes
    assert model.bank_stats["reused"] > 0, model.bank_stats  # the routed experts' mul_mat_id graphs too
    for a, b in zip(logits_on, logits_off):
        assert a.tobytes() == b.tobytes()
    assert states_on == states_off


@pytest.mark.slow
def test_attention_span_boundary_gets_one_new_graph_and_the_same_bits(models_dir):
    pad = ggml_attention.KV_PAD
    prompt = [(13 * i + 7) % 256 for i in range(pad - 3)]
    results = []
    for cache in (True, False):
        model, bank, runner = _open(models_dir, cache)
        st = _prefill(model, bank, prompt)
        builds, logits = [], []
        for step in range(7):  # positions pad-3 .. pad+3: the span grows from pad to 2 pad at step 3
            logits.append(_step(model, bank, [(st, st.n_past, 1)], [(5 * step + 1) % 256]))
            builds.append(runner.graph_stats["built"])
        results.append((logits, _state_bits(model, st)))
        if cache:
            new = np.diff(builds)
            n_attn = sum(not r for r in model.recurrent)
            # built (and kept: a decode layer graph recurs) at the boundary, then reused
            assert list(new[1:2]) == [0] and list(new[3:]) == [0, 0, 0], builds
            assert new[2] == n_attn, f"the span boundary built {new[2]} graphs, expected {n_attn}: {builds}"
    (la, sa), (lb, sb) = results
    assert all(a.tobytes() == b.tobytes() for a, b in zip(la, lb))
    assert sa == sb


def _tiny_graph(runner, key, n: int, value: float):
    lib = runner.lib

    def build(g):  # y = 2 x: a 1x1 weight of 2.0 times n one-value rows (ops every libggml has)
        two = lib.new_tensor_2d(g.ctx, GGML_TYPE_F32, 1, 1)
        f32_view(lib, two, (1,))[...] = 2.0
        x = lib.new_tensor_2d(g.ctx, GGML_TYPE_F32, 1, n)
        y = lib.mul_mat(g.ctx, two, x)
        lib.build_forward_expand(g.graph, y)
        return f32_view(lib, x, (n,)), f32_view(lib, y, (n,))

    out = runner.run_one(key, 8 * n + 64, 4, build, np.full(n, value, np.float32), 0)
    return out, key in runner._graphs  # kept, or built for this call only


def test_a_graph_in_use_keeps_its_room_and_a_stale_one_gives_it_up():
    lib = load_libggml()
    runner = GgmlRunner(lib, 1, graph_cache_bytes=0)
    n = 1 << 16  # 256 KiB of floats per tensor
    probe = runner._context_bytes(8 * n + 64, 4)
    runner.graph_cache_bytes = 2 * probe  # room for two
    runner.STALE_CALLS = 5
    try:
        for i, key in enumerate(("a", "b")):
            out, kept = _tiny_graph(runner, key, n, float(i))
            assert not kept and out[0] == 2.0 * i  # a key's first build is not kept
            out, kept = _tiny_graph(runner, key, n, float(i))
            assert kept and out[0] == 2.0 * i
        _tiny_graph(runner, "c", n, 3.0)
        out, kept = _tiny_graph(runner, "c", n, 3.0)  # full, a and b just used: c is built per call
        assert not kept and out[0] == 6.0
        assert set(runner._graphs) == {"a", "b"}
        for _ in range(6):  # b stays in use, a goes stale
            assert _tiny_graph(runner, "b", n, 1.0)[1]
        out, kept = _tiny_graph(runner, "c", n, 4.0)
        assert kept and out[0] == 8.0
        assert set(runner._graphs) == {"b", "c"} and runner.graph_stats["dropped"] == 1
        assert runner._graph_bytes <= runner.graph_cache_bytes
        out, _ = _tiny_graph(runner, "b", n, 5.0)  # a kept graph runs on new input data
        assert out[0] == 10.0 and runner.graph_stats["reused"] >= 7
    finally:
        runner.close()
    assert runner._graphs == {} and runner._graph_bytes == 0


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def test_a_large_calls_scratch_is_kept_for_the_next_call_and_freed_when_idle():
    lib = load_libggml()
    n = 12 << 20  # 48 MiB of floats in, 48 out: a ~96 MiB scratch context, above KEEP_BYTES
    keeping = GgmlRunner(lib, 1, keep_bytes=256 << 20)
    keeping.IDLE_RELEASE_S = 0.5
    plain, over = GgmlRunner(lib, 1), GgmlRunner(lib, 1, keep_bytes=80 << 20)
    try:
        f0 = _faults()
        out, _ = _tiny_graph(keeping, None, n, 1.0)
        f1 = _faults()
        assert out[-1] == 2.0 and keeping._ctx_bytes > GgmlRunner.KEEP_BYTES
        for value in (3.0, 4.0):  # calls within the idle period keep it (and re-arm the release)
            time.sleep(0.3)
            out, _ = _tiny_graph(keeping, None, n, value)
            assert out[0] == 2.0 * value and keeping._ctx is not None
        f2 = _faults()
        # the first call paged ~24,000 pages in (its scratch, and numpy's input and output arrays);
        # the kept scratch pages nothing in again (numpy's arrays still do)
        assert f2 - f1 < 0.75 * 2 * (f1 - f0), (f1 - f0, f2 - f1)
        deadline = time.monotonic() + 10
        while keeping._ctx is not None:
            assert time.monotonic() < deadline, "the idle scratch was never released"
            time.sleep(0.05)
        assert keeping._ctx_bytes == 0
        assert _tiny_graph(keeping, None, 16, 5.0)[0][0] == 10.0  # and it runs again after
        for runner in (plain, over):
            out, _ = _tiny_graph(runner, None, n, 6.0)
            assert out[0] == 12.0 and runner._ctx is None  # freed at once
    finally:
        for runner in (keeping, plain, over):
            runner.close()


def test_a_worker_keeps_its_request_graphs_and_answers_the_same_bits(tiny_q8, tmp_path, monkeypatch):
    """A worker keeps the graphs of request shapes that recur (a decode step's few rows) within
    P2PSWARM_WORKER_GRAPH_CACHE_MB, and answers the bits of a worker that keeps none (0)."""
    from p2pswarm.backbone.sessions.local import ensure_shards
    from p2pswarm.model.manifest import model_fingerprint
    from p2pswarm.worker.expert_worker import ExpertWorker

    layout = ModelLayout.open(tiny_q8)
    shard = ensure_shards(layout, model_fingerprint(layout), 2, tmp_path / "shards")[0]
    keeping = ExpertWorker(shard, kernel="ggml")
    monkeypatch.setenv("P2PSWARM_WORKER_GRAPH_CACHE_MB", "0")
    building = ExpertWorker(shard, kernel="ggml")
    assert keeping.bank.runner.graph_cache_bytes == 16 << 20 and building.bank.runner.graph_cache_bytes == 0
    rng = np.random.default_rng(5)
    info = keeping.info
    for step in range(6):  # a decode step's shape (3 rows, 2 experts) again and again, then others
        n = 3 if step < 4 else 5 + step
        rows = rng.standard_normal((n, info.n_embd)).astype(np.float32)
        groups = [(info.expert_begin, np.arange(n, dtype=np.int32)),
                  (info.expert_begin + 1, np.arange(0, n, 2, dtype=np.int32))]
        for layer in (info.layer_begin, info.layer_end - 1):
            got, want = keeping.compute(layer, rows, groups), building.compute(layer, rows, groups)
            assert all(np.array_equal(a, b) for a, b in zip(got, want)), (step, layer)
    stats = keeping.bank.runner.graph_stats
    assert stats["reused"] >= 4 and stats["kept"] == 2, stats  # (layer, 3+2 rows) x 2 layers, kept on the 2nd build
    assert building.bank.runner.graph_stats["reused"] == 0
