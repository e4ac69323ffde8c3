"""The backbone's ggml graphs: experts in one mul_mat_id per projection, fused dense projections.

- the expert bank's ``ggml_mul_mat_id`` path gives, for Q8_0 and Q4_K experts, the very bits the
  per-expert ``ggml_mul_mat`` path gave (below and above the tiled GEMM's 8-row threshold); F32
  experts differ by float rounding only (``mul_mat`` takes llamafile's F32 sgemm, ``mul_mat_id``
  ggml's vec_dot), which split == monolithic does not see: both sides run ``mul_mat_id``;
- a fused ``ffn_gate_up_exps`` tensor (two strided views) gives the bits of separate gate and up;
- several dense projections of one input in one graph give the bits of one graph each;
- loading libggml makes its OpenMP threads wait passively unless the user set a policy.
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from p2pswarm.engine.ggml import lib as gk
from p2pswarm.engine.ggml import dense as ggml_dense
from p2pswarm.engine.ggml import runner as ggml_runner
from p2pswarm.engine import ops
from p2pswarm.engine.arch import load_dense
from p2pswarm.engine.kernels import make_bank
from p2pswarm.model.layout import ModelLayout
from p2pswarm.model.synth import make_model
from helpers.ggml import needs_ggml

pytestmark = needs_ggml
MODELS = {"f32": "tiny_f32", "q8_0": "tiny_q8", "q4_k_m": "tiny_q4km"}


def _per_expert_mul_mat(bank, layer, expert, x):
    """The bank's previous path: one expert as three 2-D ggml_mul_mat of its slabs."""
    lib, r = bank.lib, bank.runner
    gate, up, down, ff, _ = bank._tensors(layer, expert)
    n, E = x.shape
    with r.lock:
        ctx = r.context(4 * n * (2 * E + 3 * ff) + 1024, 8)
        graph = lib.new_graph_custom(ctx, r.graph_size(8), False)
        xt = lib.new_tensor_2d(ctx, gk.GGML_TYPE_F32, E, n)
        ggml_runner.f32_view(lib, xt, (n, E))[...] = x
        out = lib.mul_mat(ctx, down, lib.swiglu_split(ctx, lib.mul_mat(ctx, gate, xt), lib.mul_mat(ctx, up, xt)))
        lib.build_forward_expand(graph, out)
        r.compute(graph, 1)
        got = ggml_runner.f32_view(lib, out, (n, E)).copy()
        r.done()
    return got


@pytest.mark.parametrize("qtype", ["f32", "q8_0", "q4_k_m"])
def test_mul_mat_id_gives_the_per_expert_bits(request, qtype):
    layout = ModelLayout.open(request.getfixturevalue(MODELS[qtype]))
    bank = make_bank(layout, "ggml", threads=1)
    x = np.random.default_rng(4).standard_normal((40, 256)).astype(np.float32)
    for n in (1, 7, 8, 9, 40):
        old, new = _per_expert_mul_mat(bank, 2, 6, x[:n]), bank.forward(2, 6, x[:n])
        if qtype == "f32":
            assert np.abs(new - old).max() <= 1e-5 * np.abs(old).max(), n
        else:
            assert np.array_equal(new, old), f"{qtype}, {n} rows: mul_mat_id rounds differently"
    # many groups in one request, an empty one and a repeated expert among them: each group's bits
    # are those it gets alone
    groups = [(6, np.arange(40)), (3, np.array([], np.int64)), (0, np.array([5, 1, 30])), (6, np.arange(9))]
    outs = bank.forward_groups(2, x, groups)
    assert outs[1].shape == (0, 256)
    for (e, idx), out in zip(groups, outs):
        assert np.array_equal(out, bank.forward(2, e, x[idx]))
    # one expert's groups of 4 rows each (one per sequence, as the batch-invariant scheduler sends
    # them) would add up to 8 rows -- the tiled GEMM for K-quants -- in one call: each stays alone
    groups = [(6, np.arange(4)), (0, np.arange(3)), (6, np.arange(4, 8)), (6, np.arange(8, 12))]
    for (e, idx), out in zip(groups, bank.forward_groups(2, x, groups)):
        assert np.array_equal(out, bank.forward(2, e, x[idx])), (e, idx)


@pytest.mark.slow
def test_fused_gate_up_views_give_the_separate_bits(models_dir):
    """Same weights stored as one ffn_gate_up_exps tensor or as gate + up: the same bits."""
    paths = {}
    for fused in (False, True):
        paths[fused] = models_dir / f"q35-graphs-{'fused' if fused else 'separate'}.gguf"
        if not paths[fused].exists():
            make_model(paths[fused], arch="qwen35moe", preset="tiny", qtype="q8_0", seed=21, fused_experts=fused)
    sep, fus = (make_bank(ModelLayout.open(paths[f]), "ggml", threads=1) for f in (False, True))
    assert "gate_up" in fus.layout.expert_tensors[0] and "gate_up" not in sep.layout.expert_tensors[0]
    x = np.random.default_rng(5).standard_normal((12, sep.n_embd)).astype(np.float32)
    groups = [(1, np.arange(12)), (5, np.array([0, 3, 7])), (2, np.array([11]))]
    for a, b in zip(sep.forward_groups(1, x, groups), fus.forward_groups(1, x, groups)):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("rows", [1, 9])
def test_fused_dense_projections_give_one_by_one_bits(tiny_q8, rows):
    model = load_dense(ModelLayout.open(tiny_q8), "ggml", threads=2)
    assert model.backend.tensors > 0
    w = [model.w[f"blk.1.attn_{n}.weight"] for n in ("q", "k", "v")]
    assert all(isinstance(m, ggml_dense.QuantisedMatrix) for m in w)
    x = np.random.default_rng(6).standard_normal((rows, model.n_embd)).astype(np.float32)
    together = ops.matmuls(x, w + [np.asarray(w[0])])  # a float32 array among them: multiplied by numpy
    for got, m in zip(together, w):
        assert np.array_equal(got, ops.matmul(x, m))
    assert np.array_equal(together[3], x @ np.asarray(w[0]).T)


def test_dense_swiglu_is_one_graph_close_to_numpy(tiny_q8):
    model = load_dense(ModelLayout.open(tiny_q8), "ggml", threads=1)
    g, u, d = (model.w[f"blk.0.attn_{n}.weight"] for n in ("q", "q", "output"))  # the shapes of an FFN
    x = np.random.default_rng(7).standard_normal((5, model.n_embd)).astype(np.float32)
    graphs = []
    real = ggml_runner.GgmlRunner.compute
    ggml_runner.GgmlRunner.compute = lambda self, graph, macs: (graphs.append(1), real(self, graph, macs))[1]
    try:
        got = ops.swiglu_expert(x, g, u, d)
    finally:
        ggml_runner.GgmlRunner.compute = real
    ref = ops.matmul(ops.silu(ops.matmul(x, g)) * ops.matmul(x, u), d)
    assert len(graphs) == 1
    assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()


@pytest.mark.parametrize("preset", [None, ("OMP_WAIT_POLICY", "ACTIVE"), ("OMP_WAIT_POLICY", "PASSIVE"),
                                    ("GOMP_SPINCOUNT", "0")])
@pytest.mark.slow
def test_omp_threads_spin_briefly_then_sleep_unless_told(preset):
    """Unset, loading libggml sets a short libgomp spin (GOMP_SPINCOUNT); a policy the user set is
    kept as it is, and none is added to it."""
    from p2pswarm.engine.ggml.lib import SPIN_BEFORE_SLEEP

    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    if preset:
        env[preset[0]] = preset[1]
    code = ("import os; from p2pswarm.engine.ggml.lib import load_libggml; load_libggml(); "
            "print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    want = {None: f"None {SPIN_BEFORE_SLEEP}", ("OMP_WAIT_POLICY", "ACTIVE"): "ACTIVE None",
            ("OMP_WAIT_POLICY", "PASSIVE"): "PASSIVE None", ("GOMP_SPINCOUNT", "0"): "None 0"}[preset]
    assert out.stdout.strip() == want


def test_decode_delta_rule_in_place_is_the_recurrent_rule():
    """numpy's float32 in-place DeltaNet step (state in llama.cpp's transposed layout): the float64
    token-by-token rule's output and state, to float32 rounding over 12 tokens."""
    from p2pswarm.engine.arch.qwen35moe import deltanet as dn

    rng = np.random.default_rng(8)
    H, dk, dv = 6, 16, 16
    st = dn.DeltaNetState(4, 4, H, dk, dv)
    S_ref = rng.standard_normal((H, dk, dv)) * 0.3
    st.set_state(S_ref)
    for _ in range(12):
        q, k = (dn.l2_norm(rng.standard_normal((1, H, dk)).astype(np.float32), 1e-6) for _ in range(2))
        v = rng.standard_normal((1, H, dv)).astype(np.float32)
        g = -np.abs(rng.standard_normal((1, H))).astype(np.float32)
        beta = rng.random((1, H)).astype(np.float32)
        o_ref, S_ref = dn.delta_rule_recurrent(q, k, v, g, beta, S_ref)
        o = dn.delta_rule_step_inplace(q, k, v, g, beta, st.S)
        assert np.abs(st.state() - S_ref).max() <= 1e-5 * np.abs(S_ref).max()
        assert np.abs(o - o_ref).max() <= 1e-5 * np.abs(o_ref).max()
    with pytest.raises(ValueError, match="float32"):
        dn.delta_rule_step_inplace(q, k, v, g, beta, st.S.astype(np.float64))


@pytest.mark.parametrize("T", [1, 5])
def test_ggml_gated_delta_net_is_the_recurrent_rule(T):
    """llama.cpp's op through ggml_deltanet, for two sequences in one graph (Hv = 2 Hk, as the
    122B's 16 k-heads / 32 v-heads): each within float32 rounding of the float64 rule, its state
    updated in place, and each sequence's bits the same as when it runs alone."""
    from p2pswarm.engine.arch.qwen35moe import deltanet as dn
    from p2pswarm.engine.arch.qwen35moe import ggml_deltanet
    from p2pswarm.engine.ggml.lib import load_libggml
    from p2pswarm.engine.ggml.runner import GgmlRunner

    runner = GgmlRunner(load_libggml(), 2)
    assert ggml_deltanet.available(runner)
    rng = np.random.default_rng(9)
    Hk, Hv, d = 2, 4, 16

    def seq():
        q, k = (dn.l2_norm(rng.standard_normal((T, Hk, d)).astype(np.float32), 1e-6) for _ in range(2))
        v = rng.standard_normal((T, Hv, d)).astype(np.float32)
        g = -np.abs(rng.standard_normal((T, Hv))).astype(np.float32)
        beta = rng.random((T, Hv)).astype(np.float32)
        S0 = rng.standard_normal((Hv, d, d)) * 0.3
        return q, k, v, g, beta, S0

    seqs = [seq(), seq()]
    states, alone = [], []
    for q, k, v, g, beta, S0 in seqs:
        st, solo = dn.DeltaNetState(4, 4, Hv, d, d), dn.DeltaNetState(4, 4, Hv, d, d)
        st.set_state(S0)
        solo.set_state(S0)
        states.append(st)
        alone.append((ggml_deltanet.gated_delta_net(runner, [(q, k, v, g, beta, solo)])[0], solo.S.copy()))
    outs = ggml_deltanet.gated_delta_net(runner, [(*s[:5], st) for s, st in zip(seqs, states)])
    for (q, k, v, g, beta, S0), st, o, (o_alone, S_alone) in zip(seqs, states, outs, alone):
        reps = Hv // Hk
        o_ref, S_ref = dn.delta_rule_recurrent(np.tile(q, (1, reps, 1)), np.tile(k, (1, reps, 1)), v, g, beta, S0)
        assert o.shape == (T, Hv, d)
        assert np.abs(o - o_ref).max() <= 1e-5 * np.abs(o_ref).max()
        assert np.abs(st.state() - S_ref).max() <= 1e-5 * np.abs(S_ref).max()
        assert np.array_equal(o, o_alone) and np.array_equal(st.S, S_alone)
    runner.close()


@pytest.mark.parametrize("preset", [None, "2"])
@pytest.mark.slow
def test_ggml_dense_path_runs_numpy_blas_on_one_thread(tiny_q8, preset):
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")}
    if preset:
        env["OPENBLAS_NUM_THREADS"] = preset
    code = ("from threadpoolctl import threadpool_info as i; from p2pswarm.engine.arch import load_dense; "
            "from p2pswarm.model.layout import ModelLayout; "
            f"m = load_dense(ModelLayout.open({str(tiny_q8)!r}), 'ggml'); assert m.backend.tensors > 0; "
            "print(min(p['num_threads'] for p in i() if p['user_api'] == 'blas'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == (preset or "1")


def test_populate_maps_the_whole_file(tmp_path):
    """The backbone maps every page of the model at start-up (llama.cpp's MAP_POPULATE)."""
    path = tmp_path / "blob.bin"
    path.write_bytes(os.urandom(1 << 20) * 64)  # 64 MiB

    def rss_file_mb() -> float:
        with open("/proc/self/status") as f:
            return next(int(ln.split()[1]) for ln in f if ln.startswith("RssFile:")) / 1024

    m = np.memmap(path, dtype=np.uint8, mode="r")
    before = rss_file_mb()
    if not ggml_runner.populate(m):
        pytest.skip("this kernel has no MADV_POPULATE_READ (Linux < 5.14): only read-ahead is asked")
    assert rss_file_mb() - before >= 60


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen35moe"])
def test_pre_moe_batch_serves_many_sequences(models_dir, arch):
    """Several sequences' rows through one pre_moe_batch: each sequence gets what it gets alone
    (within the rounding of a batched mat-mul), and its state moves on exactly as alone."""
    path = models_dir / f"graphs-batch-{arch}.gguf"
    if not path.exists():
        make_model(path, arch=arch, preset="tiny", qtype="q8_0", seed=9)
    model = load_dense(ModelLayout.open(path), "ggml", threads=1)
    rng = np.random.default_rng(10)
    lens = [3, 1, 5]
    alone, batched = [model.new_state() for _ in lens], [model.new_state() for _ in lens]
    for step in range(3):  # a prompt each, then two single-token steps
        n = lens if step == 0 else [1] * len(lens)
        hs = [rng.standard_normal((k, model.n_embd)).astype(np.float32) for k in n]
        pos = [0 if step == 0 else lens[i] + step - 1 for i in range(len(lens))]
        for il in range(model.n_layer):
            ref = [model.pre_moe(il, h, st, p0) for h, st, p0 in zip(hs, alone, pos)]
            got = model.pre_moe_batch(il, np.concatenate(hs), list(zip(batched, pos, n)))
            want = np.concatenate(ref)
            assert np.abs(got - want).max() <= 1e-3 * np.abs(want).max(), (step, il)
    with pytest.raises(ValueError, match="segments cover"):
        model.pre_moe_batch(0, np.zeros((2, model.n_embd), np.float32), [(model.new_state(), 0, 3)])
