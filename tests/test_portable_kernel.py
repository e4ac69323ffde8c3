"""The portable expert kernel (the same bits on every ISA) and kernel families in the handshake.

Here (x86-64):
- the C and numpy implementations agree bit for bit (Q4_K, Q6_K, Q8_0, F32, F16; zero blocks);
- its results are close to the float32 product of the dequantised weights and to ggml's;
- the bits do not depend on the thread count, nor on which groups share a request;
- kernel families: portable ids of any ISA match, ggml ids only themselves, at the handshake too;
- split == monolithic with the portable kernel (worker processes on sockets).

Across ISAs (an aarch64 Debian root under qemu-user, tests/helpers/arm64_root.py; slow): see
tests/test_arm64_worker.py.
"""
from __future__ import annotations

import numpy as np
import pytest

from p2pswarm.backbone.sessions.local import open_backbone
from p2pswarm.engine import kernels
from p2pswarm.engine.experts import portable_kernel as pk
from p2pswarm.engine.experts.numpy_bank import ExpertBank
from p2pswarm.errors import UserError
from p2pswarm.model.layout import ModelLayout
from p2pswarm.worker.expert_worker import ExpertWorker
from p2pswarm.worker.server import check_hello

from conftest import assert_one_line_error, needs_llama, run_cli
from p2pswarm.backbone.serving.generate import sequence_logits

try:
    pk.load_native()
    HAVE_C = True
except OSError:  # pragma: no cover - no C compiler here
    HAVE_C = False

needs_c = pytest.mark.skipif(not HAVE_C, reason="no C compiler to build the portable kernel")
MODELS = {"f32": "tiny_f32", "q8_0": "tiny_q8", "q4_k_m": "tiny_q4km"}


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch):
    monkeypatch.setenv("P2PSWARM_THREADS", "1")


def _weights(wtype: int, rows: int, k: int, rng) -> bytes:
    W = rng.standard_normal((rows, k)).astype(np.float32)
    if wtype == pk.F32:
        return W.view(np.uint8).reshape(-1)
    if wtype == pk.F16:
        return W.astype(np.float16).view(np.uint8).reshape(-1)
    from p2pswarm.engine.ggml.lib import quantize  # llama.cpp's quantiser writes K-quants

    return quantize(wtype, W)


@needs_c
@needs_llama
@pytest.mark.parametrize("wtype", [pk.Q4_K, pk.Q6_K, pk.Q8_0, pk.F32, pk.F16])
def test_c_and_numpy_implementations_agree_bit_for_bit(wtype):
    from gguf import GGMLQuantizationType, quants

    rng = np.random.default_rng(wtype)
    R, K = 40, 512
    wb = _weights(wtype, R, K, rng)
    nat, ref = pk.load_native(), pk.NumpyOps()
    for n in (1, 3, 9):
        x = (rng.standard_normal((n, K)) * rng.uniform(0.01, 30)).astype(np.float32)
        if n > 1:
            x[1, :256] = 0  # an all-zero activation block
        a_c = nat.quantize(x, pk.ACT_BLOCK[wtype]) if wtype in pk.ACT_BLOCK else x
        a_n = ref.quantize(x, pk.ACT_BLOCK[wtype]) if wtype in pk.ACT_BLOCK else x
        out = np.empty((n, R), np.float32)
        nat.matmul(wtype, wb.ctypes.data, 0, R, K, a_c, n, out)
        assert np.array_equal(out.view(np.int32), ref.matmul(wtype, wb, R, K, a_n, n).view(np.int32))
        # and it is the product it claims to be (activations rounded to 8 bits for quantised types)
        if wtype in (pk.F32, pk.F16):
            deq = wb.view(np.float32 if wtype == pk.F32 else np.float16).reshape(R, K).astype(np.float32)
        else:
            deq = quants.dequantize(wb.reshape(R, -1), GGMLQuantizationType(wtype)).reshape(R, K)
        exact = x @ deq.T
        tol = 1e-6 if wtype in (pk.F32, pk.F16) else 2e-2
        assert np.abs(out - exact).max() <= tol * np.abs(exact).max()
    # a range of rows [r0, r1) writes exactly those outputs (how threads split a matrix)
    part = np.full((1, R), np.nan, np.float32)
    a1 = nat.quantize(x[:1], pk.ACT_BLOCK[wtype]) if wtype in pk.ACT_BLOCK else np.ascontiguousarray(x[:1])
    nat.matmul(wtype, wb.ctypes.data, 5, 17, K, a1, 1, part)
    assert np.isnan(part[0, :5]).all() and np.isnan(part[0, 17:]).all()
    assert np.array_equal(part[0, 5:17], out[0, 5:17])


@needs_c
@needs_llama
def test_vectorised_and_scalar_builds_give_the_same_bits():
    """The row path (<= 8 rows: decode) runs AVX2 intrinsics here, compiler-vectorised C without
    AVX2 (NEON on aarch64), plain C under -DPK_SCALAR; the batched path (> 8 rows) its own loops.
    Integer sums are exact in any order, so all of them must give the same bits."""
    default = pk.load_native()
    x86 = __import__("platform").machine() == "x86_64"
    flag_sets = (("-DPK_SCALAR",), ("-mno-avx2", "-mno-f16c")) if x86 else (("-DPK_SCALAR",),)
    variants = [pk.NativeOps(pk.build_native(flags)) for flags in flag_sets]
    if x86:  # -march=native picks the AVX2 code where the CPU has it
        avx2 = " avx2 " in __import__("pathlib").Path("/proc/cpuinfo").read_text().replace("\n", " ")
        assert default.simd == ("avx2" if avx2 else "c") and [v.simd for v in variants] == ["scalar", "c"]
    rng = np.random.default_rng(17)
    R, K = 24, 1024
    for wtype in (pk.Q4_K, pk.Q6_K, pk.Q8_0):
        wb = _weights(wtype, R, K, rng)
        if wtype == pk.Q8_0:  # -128, a value ggml's quantiser never writes (AVX2's sign trick)
            wb.reshape(R, -1, 34)[0, 0, 2:] = 0x80
        x = (rng.standard_normal((12, K)) * 40).astype(np.float32)
        x[2, :256] = 0
        x[3, :] = 1e-3
        x[3, 7] = -5e4  # an activation block at -127 / +127
        rows = []
        for n in (1, 2, 8, 12):
            outs = []
            for ops in (default, *variants):
                a = ops.quantize(x[:n], pk.ACT_BLOCK[wtype])
                out = np.empty((n, R), np.float32)
                ops.matmul(wtype, wb.ctypes.data, 0, R, K, a, n, out)
                outs.append(out)
            for o in outs[1:]:
                assert np.array_equal(o.view(np.int32), outs[0].view(np.int32)), (wtype, n)
            rows.append(outs[0])
        # row path (n <= 8) and batched path (n = 12) agree row for row
        for out in rows[:-1]:
            assert np.array_equal(out.view(np.int32), rows[-1][: len(out)].view(np.int32)), wtype


@needs_c
def test_swiglu_agrees_and_is_silu():
    rng = np.random.default_rng(5)
    g = np.concatenate([rng.standard_normal(4000) * 8, [0.0, -0.0, 200.0, -200.0, 88.5, -104.5, 1e-30]])
    g = g.astype(np.float32)
    u = rng.standard_normal(g.size).astype(np.float32)
    h_c, h_n = pk.load_native().swiglu(g, u), pk.NumpyOps.swiglu(g, u)
    assert np.array_equal(h_c.view(np.int32), h_n.view(np.int32))
    ref = (g.astype(np.float64) / (1 + np.exp(-g.astype(np.float64)))) * u
    assert np.abs(h_c - ref).max() <= 1e-6 * max(1.0, np.abs(ref).max())


@pytest.mark.parametrize("qtype", ["f32", "q8_0", "q4_k_m"])
def test_bank_close_to_numpy_kernel_and_independent_of_threads(request, qtype):
    layout = ModelLayout.open(request.getfixturevalue(MODELS[qtype]))
    numpy_bank = ExpertBank(layout)
    banks = [pk.PortableExpertBank(layout, threads=1, implementation="numpy")]
    if HAVE_C:
        banks += [pk.PortableExpertBank(layout, threads=t, implementation="c") for t in (1, 3)]
        banks[-1].min_macs_parallel = 0  # split every matrix between the 3 threads, however small
    assert banks[0].kernel == f"portable-1/{__import__('platform').machine()}" == kernels.kernel_id("portable")
    assert all(b.cache is None for b in banks)  # weights read in place, nothing dequantised
    rng = np.random.default_rng(7)
    x = rng.standard_normal((6, 256)).astype(np.float32)
    for layer, e in ((0, 0), (1, 9), (3, 15)):
        ref = numpy_bank.forward(layer, e, x)
        outs = [b.forward(layer, e, x) for b in banks]
        for o in outs[1:]:
            assert np.array_equal(o, outs[0]), "implementation or thread count changed the bits"
        rel = np.abs(outs[0] - ref).max() / np.abs(ref).max()
        assert rel < (1e-5 if qtype == "f32" else 5e-2), rel
        # a group's result does not depend on the other groups of the request
        groups = banks[-1].forward_groups(layer, x, [(e, np.array([4, 1])), ((e + 1) % 16, np.arange(6))])
        assert np.array_equal(groups[0], banks[-1].forward(layer, e, x[[4, 1]]))
    with pytest.raises(UserError, match="not held"):
        banks[0].forward(0, 99, x)
    with pytest.raises(UserError, match="expected"):
        banks[0].forward(0, 0, x[:, :100])


@pytest.mark.skipif(not HAVE_C, reason="needs the C build")
@needs_llama
def test_bank_close_to_ggml(tiny_q4km):
    from p2pswarm.engine.experts.ggml_bank import GgmlExpertBank

    layout = ModelLayout.open(tiny_q4km)
    p, g = pk.PortableExpertBank(layout, threads=1), GgmlExpertBank(layout, threads=1)
    x = np.random.default_rng(3).standard_normal((1, 256)).astype(np.float32)
    for layer, e in ((0, 3), (2, 11)):
        a, b = p.forward(layer, e, x), g.forward(layer, e, x)
        # the same 8-bit activations and integer block sums: only float order and exp differ
        assert np.abs(a - b).max() <= 1e-3 * np.abs(b).max()


def test_kernel_families():
    assert kernels.family("portable-1/aarch64") == "portable-1" == kernels.family("portable-1/x86_64")
    assert kernels.compatible("portable-1/aarch64", "portable-1/x86_64")
    assert not kernels.compatible("portable-1/aarch64", "portable-2/aarch64")
    g_x86, g_arm = "ggml-0.3.36/x86_64+avx+avx2", "ggml-0.3.36/aarch64+neon+dotprod"
    assert kernels.compatible(g_x86, g_x86) and not kernels.compatible(g_x86, g_arm)
    assert not kernels.compatible("numpy", "portable-1/x86_64") and kernels.compatible("numpy", "numpy")
    assert not kernels.compatible(None, "numpy") and not kernels.compatible(3, 3)
    with pytest.raises(UserError, match="unknown kernel"):
        kernels.resolve_kernel("neon")


def test_handshake_accepts_portable_of_another_isa_and_refuses_ggml(tiny_f32, tmp_path):
    from p2pswarm.model.manifest import model_fingerprint
    from p2pswarm.net.wire import expert_protocol as proto

    from p2pswarm.model.slicer import slice_experts

    shard = tmp_path / "shard.gguf"
    slice_experts(tiny_f32, shard, None, (0, 8))
    worker = ExpertWorker(shard, kernel="portable")
    assert worker.info.kernel == pk.kernel_id()
    hello = {"protocol": proto.PROTOCOL_VERSION, "model": model_fingerprint(ModelLayout.open(tiny_f32))}
    assert check_hello({**hello, "kernel": "portable-1/aarch64"}, worker) is None
    assert check_hello({**hello, "kernel": "portable-1/riscv64"}, worker) is None
    why = check_hello({**hello, "kernel": "ggml-0.3.36/aarch64+neon"}, worker)
    assert why.startswith("kernel mismatch") and "ggml-0.3.36/aarch64+neon" in why


@pytest.mark.slow
@pytest.mark.parametrize("qtype", ["q8_0", "q4_k_m"])
async def test_split_equals_monolithic_with_portable(request, qtype, monkeypatch):
    model = request.getfixturevalue(MODELS[qtype])
    tokens = [17, 3, 250, 99, 4, 4, 301, 12]
    outs = []
    for workers in (0, 2):
        async with open_backbone(model, workers=workers, kernel="portable") as swarm:
            bb = swarm.backbone
            assert bb.dispatcher.local.bank.kernel == pk.kernel_id()
            outs.append((await sequence_logits(bb, tokens), await sequence_logits(bb, tokens, decode=True)))
            stats = bb.dispatcher.stats
            assert (stats.requests > 0) == (workers > 0) and stats.fallbacks == 0
            assert stats.local_groups == 0 or not workers
    assert np.array_equal(outs[0][0], outs[1][0]) and np.array_equal(outs[0][1], outs[1][1])


@pytest.mark.slow
def test_unsupported_weight_type_is_one_line_error(tmp_path):
    from p2pswarm.model.synth import make_model

    model = make_model(tmp_path / "bf16.gguf", preset="tiny", qtype="bf16", seed=4)
    proc = run_cli("logits", str(model), "--tokens", "1,2,3", "--out", str(tmp_path / "l.npy"), "--kernel", "portable")
    assert proc.returncode != 0
    assert_one_line_error(proc, "weight type BF16 is not supported by the portable kernel")
