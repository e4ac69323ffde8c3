"""The ggml expert kernel: zero-copy on the GGUF bytes, exact split == monolithic, close to llama.cpp.

- split == monolithic bit for bit with the ggml kernel (F32, Q8_0, Q4_K_M; in-process and sockets);
- the bits do not depend on thread count or on which other groups share a request;
- qwen3moe Q8_0 / Q4_K_M made by llama.cpp's quantiser: logits close to llama.cpp's, and the experts
  our router picks are the ones llama.cpp's picks at every layer and position (read from llama.cpp
  with an eval callback);
- qwen35moe too (its quantised dense tensors on ggml as well): exact split, llama.cpp's logits;
- a worker holding a 340 MB geometry-122b Q4_K shard stays near 340 MB resident;
- a numpy backbone and a ggml worker refuse each other, with the reason;
- without ggml, "auto" falls back to numpy with one log line and everything still works.
"""
from __future__ import annotations

import logging
import os

import numpy as np
import pytest

from p2pswarm.backbone.dispatch.dispatcher import Dispatcher
from p2pswarm.backbone.serving.runner import Backbone, combine, expert_groups
from p2pswarm.backbone.sessions.local import WorkerProcess, ensure_shards, open_backbone
from p2pswarm.backbone.owners.socket_owner import SocketOwner
from p2pswarm.engine.ggml import lib as gk
from p2pswarm.engine.ggml import dense as ggml_dense, runner as ggml_runner
from p2pswarm.engine import kernels, ops
from p2pswarm.engine.arch import load_dense
from p2pswarm.engine.experts.numpy_bank import ExpertBank
from p2pswarm.errors import UserError, WorkerError
from p2pswarm.model.layout import ModelLayout
from p2pswarm.model.manifest import model_fingerprint
from p2pswarm.model.slicer import slice_experts
from p2pswarm.model.synth import make_model
from p2pswarm.worker.expert_worker import ExpertWorker

from conftest import llama_logits, needs_llama, run_cli
from helpers.llama_ref import llama_routing
from helpers.ggml import needs_ggml
from p2pswarm.backbone.serving.generate import sequence_logits


TOKENS = [17, 3, 250, 99, 4, 4, 301, 12, 77, 5, 160, 42, 8, 200, 31, 64, 9, 120, 2, 88, 270, 15, 6, 190]
MODELS = {"f32": "tiny_f32", "q8_0": "tiny_q8", "q4_k_m": "tiny_q4km"}


@pytest.fixture(autouse=True)
def _one_thread_per_node(monkeypatch):
    """Many worker processes share 2 CPUs in these tests; ggml's spinning barriers would fight."""
    monkeypatch.setenv("P2PSWARM_THREADS", "1")


# ---- the kernel itself ---------------------------------------------------------------------------
@needs_ggml
def test_interface_and_kernel_names(tiny_q8):
    layout = ModelLayout.open(tiny_q8)
    nb, gb = kernels.make_bank(layout, "numpy"), kernels.make_bank(layout, "ggml")
    assert nb.kernel == "numpy" and isinstance(nb, ExpertBank)
    assert gb.kernel.startswith("ggml-") and gb.kernel == kernels.kernel_id("ggml") == kernels.kernel_id("auto")
    lib = gk.load_libggml()
    assert gb.kernel.startswith(f"ggml-{lib.ggml_version}-{lib.ggml_commit.removesuffix('-dirty')}/")
    assert gb.cache is None  # nothing dequantised, nothing cached
    for bank in (nb, gb):
        assert bank.holds(0, 0) and bank.holds(3, 15) and not bank.holds(0, 16) and not bank.holds(9, 0)
        x = np.random.default_rng(0).standard_normal((5, 256)).astype(np.float32)
        one = bank.forward(1, 7, x)
        assert one.shape == (5, 256) and one.dtype == np.float32
        outs = bank.forward_groups(1, x, [(7, np.arange(5)), (2, np.array([1, 3]))])
        assert np.array_equal(outs[0], one) and outs[1].shape == (2, 256)
    with pytest.raises(UserError, match="not held"):
        gb.forward(0, 99, x)
    with pytest.raises(UserError, match="unknown kernel"):
        kernels.make_bank(layout, "cuda")


@needs_ggml
@pytest.mark.parametrize("qtype", ["f32", "q8_0", "q4_k_m"])
def test_ggml_is_close_to_numpy_and_reads_the_mapped_bytes(request, qtype):
    """F32 experts: float rounding only. Quantised: activations rounded to 8 bits (see docs/kernels.md)."""
    layout = ModelLayout.open(request.getfixturevalue(MODELS[qtype]))
    nb, gb = kernels.make_bank(layout, "numpy"), kernels.make_bank(layout, "ggml")
    x = np.random.default_rng(1).standard_normal((12, 256)).astype(np.float32)
    ref, got = nb.forward(2, 5, x), gb.forward(2, 5, x)
    rel = float(np.abs(got - ref).max() / np.abs(ref).max())
    print(f"{qtype}: ggml vs numpy expert output, max relative difference {rel:.2e}")
    assert rel < {"f32": 1e-5, "q8_0": 3e-2, "q4_k_m": 6e-2}[qtype]
    # zero-copy: each weight tensor's data pointer is the expert's slab inside the memory map
    lib = gb.lib
    gate, up, down, ff, _ = gb._tensors(2, 5)
    base = layout.reader.data.ctypes.data
    t = layout.expert_tensors[2]
    assert lib.get_data(gate) == base + t["gate"].slab(5)[0]
    assert lib.get_data(up) == base + t["up"].slab(5)[0]
    assert lib.get_data(down) == base + t["down"].slab(5)[0]


@needs_ggml
@pytest.mark.parametrize("qtype", ["f32", "q8_0", "q4_k_m"])
def test_bits_do_not_depend_on_threads_or_neighbours(request, qtype, monkeypatch):
    """What lets a 2-thread backbone and an 8-thread worker agree bit for bit."""
    monkeypatch.setattr(ggml_runner, "MIN_MACS_PER_THREAD", 1)  # really use every thread, even on tiny experts
    monkeypatch.setenv("P2PSWARM_ADAPT_THREADS", "off")  # ... and more threads than free CPUs (cpu_share)
    layout = ModelLayout.open(request.getfixturevalue(MODELS[qtype]))
    banks = [kernels.make_bank(layout, "ggml", threads=n) for n in (1, 2, 3)]
    x = np.random.default_rng(2).standard_normal((100, 256)).astype(np.float32)
    for n in (1, 7, 8, 9, 33, 100):
        outs = [b.forward(1, 4, x[:n]) for b in banks]
        assert all(np.array_equal(outs[0], o) for o in outs[1:]), f"{n} rows: threads change the bits"
    alone = banks[0].forward(1, 4, x[:40])
    together = banks[2].forward_groups(1, x, [(9, np.arange(100)), (4, np.arange(40)), (0, np.arange(3))])
    assert np.array_equal(together[1], alone)


# ---- split == monolithic -----------------------------------------------------------------------
_mono: dict = {}


async def _logits(model, workers=0, transport="inproc", kernel="ggml"):
    async with open_backbone(model, workers=workers, transport=transport, kernel=kernel) as swarm:
        assert swarm.backbone.dispatcher.local.bank.kernel.startswith("ggml-")
        prefill = await sequence_logits(swarm.backbone, TOKENS)
        decode = await sequence_logits(swarm.backbone, TOKENS, decode=True)
        stats = swarm.backbone.dispatcher.stats
    return prefill, decode, stats


@needs_ggml
@pytest.mark.parametrize("qtype", [pytest.param("f32", marks=pytest.mark.slow), pytest.param("q8_0", marks=pytest.mark.slow),
                                   "q4_k_m"])
@pytest.mark.parametrize("transport", ["inproc", pytest.param("socket", marks=pytest.mark.slow)])  # processes: slow
async def test_split_equals_monolithic_with_ggml(request, qtype, transport):
    model = request.getfixturevalue(MODELS[qtype])
    if model not in _mono:
        _mono[model] = await _logits(model)
    mono_prefill, mono_decode, mono_stats = _mono[model]
    assert mono_stats.requests == 0 and np.isfinite(mono_prefill).all()
    # Prefill and decode take different float paths before each 8-bit rounding of activations, so
    # with quantised weights they agree to a quantisation step, not to float rounding.
    scale = max(1.0, float(np.abs(mono_prefill).max()))
    assert np.max(np.abs(mono_prefill - mono_decode)) < (1e-3 if qtype == "f32" else 2e-2) * scale
    for workers in ((1, 2, 3, 7) if transport == "inproc" else (2, 3)):
        prefill, decode, stats = await _logits(model, workers, transport)
        assert stats.requests > 0 and stats.local_groups == 0 and stats.fallbacks == 0
        assert np.array_equal(prefill, mono_prefill), f"{workers} workers prefill differs"
        assert np.array_equal(decode, mono_decode), f"{workers} workers decode differs"


# ---- the handshake -------------------------------------------------------------------------------
@pytest.mark.slow
@needs_ggml
async def test_numpy_backbone_and_ggml_worker_refuse_each_other(tiny_f32, tmp_path, caplog):
    layout = ModelLayout.open(tiny_f32)
    fp = model_fingerprint(layout)
    shard = ensure_shards(layout, fp, 2, tmp_path)[0]
    info = ExpertWorker.describe_shard(shard, "numpy")
    ggml_id = kernels.kernel_id("ggml")

    def owner(wp, kernel):
        return SocketOwner("w", wp.host, wp.port, model_fingerprint=fp, kernel=kernel,
                           layers=(info.layer_begin, info.layer_end), experts=(info.expert_begin, info.expert_end))

    rows = np.ones((2, 256), np.float32)
    for worker_kernel, backbone_kernel in (("ggml", "numpy"), ("numpy", ggml_id)):
        wp = WorkerProcess.start(shard, kernel=worker_kernel)
        try:
            o = owner(wp, backbone_kernel)
            with pytest.raises(WorkerError, match="kernel mismatch") as err:
                await o.compute(0, rows, [(0, np.arange(2))])
            worker_id = ggml_id if worker_kernel == "ggml" else "numpy"
            msg = str(err.value)
            assert repr(backbone_kernel) in msg and repr(worker_id) in msg, msg
            await o.aclose()
        finally:
            wp.stop()
    # A numpy backbone with a ggml worker: refused, so without fallback the run fails with the
    # reason; with fallback the backbone's own replica computes, and the logits are numpy's.
    mono = await sequence_logits(Backbone(load_dense(layout), Dispatcher(ExpertBank(layout))), TOKENS)
    wp = WorkerProcess.start(shard, kernel="ggml")
    try:
        strict = Backbone(load_dense(layout), Dispatcher(ExpertBank(layout), [owner(wp, "numpy")], fallback=False))
        with pytest.raises(WorkerError, match="kernel mismatch"):
            await sequence_logits(strict, TOKENS)
        with caplog.at_level(logging.WARNING, logger="p2pswarm.backbone"):
            lenient = Backbone(load_dense(layout), Dispatcher(ExpertBank(layout), [owner(wp, "numpy")]))
            assert np.array_equal(await sequence_logits(lenient, TOKENS), mono)
        assert lenient.dispatcher.stats.fallbacks > 0
        assert any("kernel mismatch" in r.getMessage() for r in caplog.records)
    finally:
        wp.stop()


# ---- ggml missing ----------------------------------------------------------------------------------
@pytest.mark.slow
async def test_without_ggml_numpy_is_used_with_one_log_line(tiny_f32, monkeypatch, caplog, tmp_path):
    monkeypatch.setenv(gk.ENV_DISABLE, "off")
    monkeypatch.setattr(kernels, "_warned_fallback", False)
    with caplog.at_level(logging.WARNING, logger="p2pswarm.engine"):
        assert kernels.resolve_kernel("auto") == "numpy"
        assert kernels.resolve_kernel(None) == "numpy"
        bank = kernels.make_bank(ModelLayout.open(tiny_f32), "auto")
    lines = [r.getMessage() for r in caplog.records if "ggml kernel unavailable" in r.getMessage()]
    assert lines == [f"ggml kernel unavailable (disabled by {gk.ENV_DISABLE}=off); using numpy"]
    assert isinstance(bank, ExpertBank) and bank.kernel == "numpy"
    with pytest.raises(UserError, match=r"ggml kernel unavailable \(disabled by"):
        kernels.make_bank(ModelLayout.open(tiny_f32), "ggml")
    # everything still works: split == monolithic, worker processes included
    async with open_backbone(tiny_f32, workers=0) as mono:
        ref = await sequence_logits(mono.backbone, TOKENS)
        assert mono.backbone.dispatcher.local.bank.kernel == "numpy"
    async with open_backbone(tiny_f32, workers=2, transport="socket") as swarm:
        assert np.array_equal(await sequence_logits(swarm.backbone, TOKENS), ref)
        assert swarm.backbone.dispatcher.stats.fallbacks == 0
    # the CLI says it once, on stderr, and works
    out = tmp_path / "l.npy"
    proc = run_cli("logits", str(tiny_f32), "--tokens", "1,2,3,4,5", "--out", str(out), "--workers", "2",
                   env={gk.ENV_DISABLE: "off"}, check=True)
    assert proc.stderr.count("ggml kernel unavailable (disabled by P2PSWARM_GGML=off); using numpy") == 1
    assert np.load(out).shape == (5, 540)
    proc = run_cli("logits", str(tiny_f32), "--tokens", "1,2,3", "--out", str(out), "--kernel", "ggml",
                   env={gk.ENV_DISABLE: "off"})
    assert proc.returncode != 0 and "ggml kernel unavailable" in proc.stderr and "Traceback" not in proc.stderr


# ---- the dense path on quantised weights -----------------------------------------------------------
@needs_ggml
def test_dense_path_keeps_quantised_tensors_mapped(tiny_q8):
    layout = ModelLayout.open(tiny_q8)
    ref_model, model = load_dense(layout), load_dense(layout, "ggml")
    n = model.backend.tensors
    quantised = [t.name for t in layout.reader.tensors
                 if int(t.tensor_type) in gk.QUANTISED_TYPES and len(t.shape) == 2]
    assert n == len(quantised) > 0 and "blk.0.attn_q.weight" in quantised
    w = model.w["blk.0.attn_q.weight"]
    assert isinstance(w, ggml_dense.QuantisedMatrix)
    x = np.random.default_rng(3).standard_normal((6, 256)).astype(np.float32)
    ref = ops.matmul(x, ref_model.w["blk.0.attn_q.weight"])
    got = ops.matmul(x, w)
    assert got.shape == ref.shape and float(np.abs(got - ref).max() / np.abs(ref).max()) < 3e-2
    # numpy code that wants a plain array still gets one (dequantised on demand)
    assert np.array_equal(np.asarray(w), ref_model.w["blk.0.attn_q.weight"])
    assert w.reshape(-1).shape == (w.shape[0] * w.shape[1],)
    emb = model.embed(np.array([1, 5, 9]))
    assert np.array_equal(emb, ref_model.embed(np.array([1, 5, 9])))  # Q8_0 rows dequantise exactly
    numpy = load_dense(layout, "numpy").backend
    assert numpy.ggml is None and numpy.tensors == 0


# ---- llama.cpp, end to end ------------------------------------------------------------------------------
LLAMA_TOKENS = [5, 211, 37, 90, 14, 14, 14, 302, 8, 66, 129, 3, 250, 77, 41, 19, 180, 222, 6, 51, 97, 140, 12,
                260, 33, 71, 2, 118, 199, 45, 88, 301]


def _llama_quantised(models_dir, name: str, seed: int):
    import llama_cpp

    f32 = models_dir / f"llamaq-{seed}-f32.gguf"
    if not f32.exists():
        make_model(f32, preset="tiny", qtype="f32", seed=seed)
    out = models_dir / f"llamaq-{seed}-{name}.gguf"
    if not out.exists():
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = {"q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0, "q4_k_m": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M}[name]
        tmp = out.with_suffix(".tmp")
        assert llama_cpp.llama_model_quantize(str(f32).encode(), str(tmp).encode(), llama_cpp.byref(params)) == 0
        tmp.rename(out)
    return out


def _our_trace(path, kernel: str):
    """Monolithic prefill with ``kernel`` (experts and dense path); routing and router margins."""
    layout = ModelLayout.open(path)
    model = load_dense(layout, kernel)
    bank = kernels.make_bank(layout, kernel)
    state = model.new_state()
    h = model.embed(np.asarray(LLAMA_TOKENS))
    routing, margins = [], []
    for il in range(model.n_layer):
        h = model.pre_moe(il, h, state, 0)
        cur = model.ffn_input(il, h)
        ids, w = model.route(il, cur)
        router = np.sort(ops.matmul(cur, model.w[f"blk.{il}.ffn_gate_inp.weight"]), axis=-1)[:, ::-1]
        margins.append(router[:, model.n_expert_used - 1] - router[:, model.n_expert_used])
        groups = expert_groups(ids)
        partials = dict(zip([e for e, _ in groups], bank.forward_groups(il, cur, groups)))
        h = model.post_moe(il, h, cur, combine(ids, w, groups, partials))
        routing.append(ids)
    return model.output(h), routing, np.array(margins)


@needs_ggml
@needs_llama
@pytest.mark.slow
@pytest.mark.parametrize("qtype", ["q8_0", "q4_k_m"])
@pytest.mark.parametrize("seed", [21, 22])
def test_quantised_logits_and_routing_match_llama_cpp(models_dir, qtype, seed):
    path = _llama_quantised(models_dir, qtype, seed)
    ref = llama_logits(path, LLAMA_TOKENS)
    theirs = llama_routing(path, LLAMA_TOKENS)
    ours, routing, margins = _our_trace(path, "ggml")
    np_logits, np_routing, _ = _our_trace(path, "numpy")
    diff, np_diff = float(np.abs(ours - ref).max()), float(np.abs(np_logits - ref).max())
    np_flips = sum(int((np.sort(a, 1) != np.sort(theirs[il], 1)).any(1).sum()) for il, a in enumerate(np_routing))
    print(f"{qtype} seed {seed}: max |logit - llama.cpp| ggml kernel {diff:.3g}, numpy kernel {np_diff:.3g} "
          f"(max |logit| {np.abs(ref).max():.3g}); smallest router margin {margins.min():.2g}; "
          f"numpy kernel routes {np_flips} (layer, position)s differently")
    assert sorted(theirs) == list(range(len(routing)))
    reordered = 0
    for il, ids in enumerate(routing):
        # the same experts chosen at every position of every layer
        same = (np.sort(ids, 1) == np.sort(theirs[il], 1)).all(1)
        assert same.all(), f"layer {il}: different experts at positions {np.nonzero(~same)[0].tolist()} " \
            f"(k-th vs (k+1)-th router margins {margins[il].round(4).tolist()})"
        reordered += int((ids != theirs[il]).any(1).sum())
    print(f"  routing identical at all {len(routing)} x {len(LLAMA_TOKENS)} (layer, position)s; "
          f"{reordered} list two near-equal experts in the other order")
    assert diff <= 0.03 * float(np.abs(ref).max())
    assert (np.argmax(ours, 1) == np.argmax(ref, 1)).mean() >= 0.9


# ---- memory -----------------------------------------------------------------------------------------------
def _status_mb(pid: int) -> dict[str, float]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(rest.split()[0]) / 1024
    return out


@needs_ggml
@pytest.mark.slow
async def test_worker_with_340mb_shard_stays_near_shard_size(tmp_path):
    """64 geometry-122b experts (Q4_K, 5.3 MB each) of one layer: a 340 MB shard. Every expert is
    computed once; the worker's peak resident set must stay under shard + 250 MB (generous: the
    overhead measured here is ~100 MB of Python, numpy, trio and libggml; see docs/kernels.md)."""
    d = tmp_path
    model = make_model(d / "g122.gguf", preset="geometry-122b", layers=1, n_expert=64, qtype="q8_0")
    shard = d / "shard.gguf"
    slice_experts(model, shard, None, (0, 64))
    model.unlink()
    shard_mb = shard.stat().st_size / 2**20
    assert shard_mb > 320  # 64 x 5,308,416 bytes = 340 MB = 324 MiB
    wp = WorkerProcess.start(shard, kernel="ggml")
    try:
        info = ExpertWorker.describe_shard(shard, "ggml")
        idle = _status_mb(wp.proc.pid)
        owner = SocketOwner("w", wp.host, wp.port, model_fingerprint=info.model_fingerprint, kernel=info.kernel,
                            layers=(info.layer_begin, info.layer_end), experts=(info.expert_begin, info.expert_end),
                            timeout_s=300)
        rows = np.random.default_rng(0).standard_normal((4, info.n_embd)).astype(np.float32)
        outs = await owner.compute(0, rows, [(e, np.arange(4)) for e in range(64)])
        assert len(outs) == 64 and all(np.isfinite(o).all() for o in outs)
        await owner.aclose()
        after = _status_mb(wp.proc.pid)
    finally:
        wp.stop()
    overhead = after["VmHWM"] - shard_mb
    print(f"shard {shard_mb:.0f} MiB; worker idle {idle['VmRSS']:.0f} MB; after touching all 64 experts: "
          f"VmRSS {after['VmRSS']:.0f} MB (anon {after['RssAnon']:.0f}, file {after['RssFile']:.0f}), "
          f"VmHWM {after['VmHWM']:.0f} MB = shard + {overhead:.0f} MB")
    assert after["VmHWM"] <= shard_mb + 250
    assert after["RssAnon"] < 250  # the weights are file pages of the map, not private copies


@pytest.mark.slow
@needs_ggml
def test_cli_worker_kernel_flag(tiny_f32, tmp_path):
    layout = ModelLayout.open(tiny_f32)
    shard = ensure_shards(layout, model_fingerprint(layout), 2, tmp_path)[0]
    proc = run_cli("worker", "--shard", str(shard), "--kernel", "cuda", timeout=60)
    assert proc.returncode != 0 and "invalid choice" in proc.stderr
    proc = run_cli("worker", "--shard", str(shard), "--threads", "0", timeout=60)
    assert proc.returncode != 0 and "positive integer" in proc.stderr


@needs_ggml
@needs_llama
@pytest.mark.slow
@pytest.mark.parametrize("qtype", ["q8_0", "q4_k_m"])
async def test_qwen35moe_with_ggml_matches_llama_cpp_and_splits_exactly(models_dir, qtype):
    """The other architecture (DeltaNet layers, shared expert): its quantised dense tensors go to
    ggml as well, split == monolithic holds, and the logits are llama.cpp's."""
    path = models_dir / f"q35-ggml-{qtype}.gguf"
    if not path.exists():
        make_model(path, preset="tiny", qtype=qtype, seed=5, arch="qwen35moe")
    tokens = list(range(3, 27))
    ref = llama_logits(path, tokens)
    async with open_backbone(path, workers=0, kernel="ggml") as mono:
        taken = sum(isinstance(v, ggml_dense.QuantisedMatrix) for v in mono.backbone.model.w.loaded().values())
        ours = await sequence_logits(mono.backbone, tokens)
    async with open_backbone(path, workers=2, transport="inproc", kernel="ggml") as split:
        assert np.array_equal(await sequence_logits(split.backbone, tokens), ours)
    diff = float(np.abs(ours - ref).max())
    print(f"qwen35moe {qtype}: {taken} dense tensors on ggml; max |logit - llama.cpp| {diff:.3g} "
          f"(max |logit| {np.abs(ref).max():.3g})")
    assert taken > 0
    assert diff <= 0.03 * float(np.abs(ref).max())


@needs_ggml
def test_the_f32_router_on_ggml_gives_a_row_alone_its_bits_in_a_batch(tiny_q8):
    """The ggml kernel multiplies the F32 router (``ffn_gate_inp``) by ggml, whose F32 mat-mul of
    one row takes another kernel than of two or more: the matrix pads a lone row to two, so a
    sequence's logits alone are the bits it gets among others (what lets the batch-invariant mode
    route all sequences' rows in one call), and still numpy's to float rounding."""
    from p2pswarm.engine.ggml.dense import QuantisedMatrix

    model = load_dense(ModelLayout.open(tiny_q8), "ggml")
    w = model.w["blk.0.ffn_gate_inp.weight"]
    assert isinstance(w, QuantisedMatrix) and w.min_rows == 2
    x = np.random.default_rng(5).standard_normal((40, model.n_embd)).astype(np.float32)
    batched = ops.matmul(x, w)
    for a, b in ((0, 1), (7, 8), (3, 5), (10, 27)):
        assert np.array_equal(ops.matmul(x[a:b], w), batched[a:b]), (a, b)
    assert np.allclose(batched, x @ np.asarray(w).T, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_numpy_nodes_multiply_on_one_blas_thread(tiny_f32):
    """numpy's OpenBLAS gives a row different bits on 1 and 2 threads (5+ rows, measured), so
    every process that builds a numpy expert bank runs BLAS on one thread: a numpy backbone and
    numpy worker processes agree whatever their core counts, and whatever the process did
    before (this file's ggml tests used to leave it on one thread, and the numpy split run after
    them differed from the monolithic by 5.7e-6)."""
    import subprocess
    import sys

    code = ("import sys; from threadpoolctl import threadpool_info; from p2pswarm.engine.experts.numpy_bank import ExpertBank; "
            "from p2pswarm.model.layout import ModelLayout; ExpertBank(ModelLayout.open(sys.argv[1])); "
            "print(sorted({i['num_threads'] for i in threadpool_info() if i['user_api'] == 'blas'}))")
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", code, str(tiny_f32)], capture_output=True, text=True, env=env,
                         timeout=120, check=True).stdout
    assert out.strip() == "[1]", out


def test_every_bound_function_is_declared_on_the_class():
    """GgmlLib's class body declares each C function __init__ binds (for mypy): the two lists
    must agree, or a new function in _SIG would be invisible to the type checker (or a declared
    one would be missing at run time)."""
    from p2pswarm.engine.ggml import lib as ggml_kernel

    bound = {n.removeprefix("ggml_") for n in (*ggml_kernel._SIG, *ggml_kernel._OPTIONAL_SIG)}
    declared = set(ggml_kernel.GgmlLib.__annotations__)
    assert bound == declared, (sorted(bound - declared), sorted(declared - bound))
