"""MLA's per-head products (``attn_k_b``, ``attn_v_b``) on their quantised bytes, by ggml.

Why: in a quantised deepseek2 GGUF these two 3-D tensors are quantised too (Q5_0 / Q8_0 / K-quants
by llama.cpp's quantiser), and llama.cpp multiplies them with ``ggml_mul_mat`` on a 3-D weight
(one matrix per head), which rounds the activations to the weight's dot-product type first. A
float32 product with the dequantised weight moves a layer's output by ~0.5% -- enough to flip
routing choices. This runs the same op on the same bytes, so the backbone's MLA rounds as llama.cpp
does (tests/test_deepseek2.py, the Q4_K_M routing test)."""
from __future__ import annotations

import numpy as np

from p2pswarm.engine.ggml_kernel import GGML_TYPE_F32, GGML_TYPE_I32, QUANTISED_TYPES
from p2pswarm.engine.ggml_runner import _i32_view, f32_view
from p2pswarm.engine.mla import YARN_BETA_FAST, YARN_BETA_SLOW


class HeadMatrices:
    """A 3-D weight, numpy (H, out, in), left in the memory map: ``matmul(x)`` is ``x[h] @ W[h].T``
    for every head h, x (H, T, in) float32 -> (H, T, out), as one ggml_mul_mat."""

    def __init__(self, dense, t):
        self.runner = dense.runner
        ne0, ne1, ne2 = (int(d) for d in t.shape)
        self.shape = (ne2, ne1, ne0)
        self.name = t.name
        self.tensor = dense._mapped.tensor(int(t.tensor_type), ne0, ne1, int(t.data_offset), t.name, ne2)

    @staticmethod
    def eligible(t) -> bool:
        return int(t.tensor_type) in QUANTISED_TYPES and len(t.shape) == 3

    def matmul(self, x: np.ndarray) -> np.ndarray:
        H, out_n, in_n = self.shape
        x = np.ascontiguousarray(x, dtype=np.float32)
        if x.ndim != 3 or x.shape[0] != H or x.shape[2] != in_n:
            raise ValueError(f"{self.name}: per-head matmul of {x.shape} with weights {self.shape}")
        T = x.shape[1]
        if T == 0:
            return np.zeros((H, 0, out_n), np.float32)
        lib = self.runner.lib

        def build(g):
            xt = lib.new_tensor_3d(g.ctx, GGML_TYPE_F32, in_n, T, H)
            out = lib.mul_mat(g.ctx, self.tensor, xt)
            lib.build_forward_expand(g.graph, out)
            return f32_view(lib, xt, (H, T, in_n)), f32_view(lib, out, (H, T, out_n))

        return self.runner.run_one(("mla_heads", self.tensor, T), 4 * H * T * (3 * in_n + out_n) + 256, 5, build, x,
                                   H * T * in_n * out_n)


def head_matrices(w, name: str) -> "HeadMatrices | None":
    """``name`` as :class:`HeadMatrices` where the ggml kernel holds the dense path (``w.ggml_dense``)
    and the tensor is quantised; None otherwise (the caller multiplies float32)."""
    dense = getattr(w, "ggml_dense", None)
    if dense is None:
        return None
    t = dense._tensors_by_name().get(name)
    return HeadMatrices(dense, t) if t is not None and HeadMatrices.eligible(t) else None


def per_head_matmul(W, x: np.ndarray) -> np.ndarray:
    """``x[h] @ W[h].T`` for (H, T, in) x: by ggml for :class:`HeadMatrices`, numpy for arrays."""
    if isinstance(W, HeadMatrices):
        return W.matmul(x)
    return np.matmul(x, W.transpose(0, 2, 1))


# ---- the whole MLA core as llama.cpp builds it -------------------------------------------------
# Why: with quantised attn_k_b / attn_v_b, llama.cpp rounds the activations they multiply to 8 bits;
# a last-bit difference upstream (numpy's RoPE, softmax or QK^T against ggml's) flips some of those
# roundings and moves a layer's output by ~1e-4 relative, which over a few layers changes routing
# choices and logits by ~0.1. These two graphs are llama.cpp's ops in llama.cpp's order
# (src/models/deepseek2.cpp, llama-graph.cpp build_attn + build_attn_mha without flash attention),
# so the backbone computes llama.cpp's bits (tests/test_deepseek2.py: teacher-forced layers equal).
_OPS = ("rope_ext", "rms_norm", "mul", "permute", "concat", "view_2d", "view_3d", "reshape_3d", "soft_max_ext",
        "cont", "transpose", "cont_2d")


def core_available(model) -> bool:
    """Whether the ggml MLA core runs for ``model``: the ggml kernel holds the dense path, the split
    MLA tensors are quantised (:class:`HeadMatrices`), the norms are F32 and libggml has the ops."""
    dense = getattr(model.w, "ggml_dense", None)
    if dense is None or not model.split_kv_b or not all(getattr(dense.runner.lib, n, None) for n in _OPS):
        return False
    k_b, v_b = model._kv_b_halves(0)
    return isinstance(k_b, HeadMatrices) and isinstance(v_b, HeadMatrices) and \
        dense.f32_vector("blk.0.attn_kv_a_norm.weight") is not None


def qk_rows(model, il: int, q: np.ndarray, ckv: np.ndarray, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's ``Qcur`` (T, H, Rkv + rope) and ``Kcur`` (T, Rkv + rope) of layer ``il`` from the
    projections ``q`` (T, H, nope + rope) and ``kv_a_mqa x`` (T, Rkv + rope): YaRN RoPE, the
    compressed KV's norm, q_nope absorbed into the latent by attn_k_b."""
    dense = model.w.ggml_dense
    runner, lib = dense.runner, dense.runner.lib
    k_b, _ = model._kv_b_halves(il)
    norm = dense.f32_vector(f"blk.{il}.attn_kv_a_norm.weight")
    T, H, qk = q.shape
    Rkv, rope, nope = model.kv_lora_rank, model.n_rot, model.n_nope
    W, f, y = Rkv + rope, 4, model.yarn
    rope_args = (rope, 0, int(y.n_ctx_orig), y.base, y.freq_scale, y.ext_factor, y.attn_factor, YARN_BETA_FAST,
                 YARN_BETA_SLOW)

    def build(g):
        ctx = g.ctx
        qt = lib.new_tensor_3d(ctx, GGML_TYPE_F32, qk, H, T)
        kv = lib.new_tensor_2d(ctx, GGML_TYPE_F32, W, T)
        pt = lib.new_tensor_1d(ctx, GGML_TYPE_I32, T)
        q_nope = lib.view_3d(ctx, qt, nope, H, T, f * qk, f * qk * H, 0)
        q_pe = lib.rope_ext(ctx, lib.view_3d(ctx, qt, rope, H, T, f * qk, f * qk * H, f * nope), pt, None, *rope_args)
        q_abs = lib.permute(ctx, lib.mul_mat(ctx, k_b.tensor, lib.permute(ctx, q_nope, 0, 2, 1, 3)), 0, 2, 1, 3)
        qcur = lib.concat(ctx, q_abs, q_pe, 0)  # [Rkv + rope, H, T]
        c = lib.mul(ctx, lib.rms_norm(ctx, lib.view_2d(ctx, kv, Rkv, T, f * W, 0), model.eps), norm)
        k_pe = lib.rope_ext(ctx, lib.view_3d(ctx, kv, rope, 1, T, f * W, f * W, f * Rkv), pt, None, *rope_args)
        kcur = lib.concat(ctx, lib.reshape_3d(ctx, c, Rkv, 1, T), k_pe, 0)  # [Rkv + rope, 1, T]
        for t in (qcur, kcur):
            lib.build_forward_expand(g.graph, t)
        return (f32_view(lib, qt, (T, H, qk)), f32_view(lib, kv, (T, W)), _i32_view(lib, pt, T),
                f32_view(lib, qcur, (T, H, W)), f32_view(lib, kcur, (T, W)))

    with runner.lock:
        g = runner.graph(("mla_qk", il, T), 4 * T * (H * (qk + 3 * Rkv + 4 * W) + 6 * W) + 4096, 24, build)
        try:
            q_in, kv_in, p_in, qcur, kcur = g.t
            q_in[...] = q
            kv_in[...] = ckv
            p_in[...] = pos
            runner.compute(g.graph, T * H * nope * Rkv)
            return qcur.copy(), kcur.copy()
        finally:
            runner.release(g)


def attention_rows(model, il: int, qcur: np.ndarray, segs) -> np.ndarray:
    """llama.cpp's attention output rows (T, H * v) before ``attn_output``: per sequence
    ``(cache rows (S, Rkv + rope) incl. this call's, pos0, n)``, softmax(kq_scale * K Q) over the
    cache padded to :func:`~p2pswarm.engine.ggml_attention.kv_span` positions (masked), the values
    the cache's latent part, then each head's attn_v_b."""
    from p2pswarm.engine.ggml_attention import kv_span  # one padding rule for both

    dense = model.w.ggml_dense
    runner, lib = dense.runner, dense.runner.lib
    _, v_b = model._kv_b_halves(il)
    T, H, W = qcur.shape
    Rkv, hv, f = model.kv_lora_rank, model.head_v, 4
    spans = [kv_span(rows.shape[0]) for rows, _, _ in segs]

    def build(g):
        ctx = g.ctx
        qt = lib.new_tensor_3d(ctx, GGML_TYPE_F32, W, H, T)
        ins, outs, at = [], [], 0
        for (_, _, n), b in zip(segs, spans):
            k = lib.new_tensor_3d(ctx, GGML_TYPE_F32, W, 1, b)
            mask = lib.new_tensor_2d(ctx, GGML_TYPE_F32, b, n)
            q = lib.permute(ctx, lib.view_3d(ctx, qt, W, H, n, f * W, f * W * H, at * f * W * H), 0, 2, 1, 3)
            kq = lib.soft_max_ext(ctx, lib.mul_mat(ctx, lib.permute(ctx, k, 0, 2, 1, 3), q), mask,
                                  model.kq_scale, 0.0)  # [b, n, H]
            v = lib.cont(ctx, lib.transpose(ctx, lib.permute(ctx, lib.view_3d(ctx, k, Rkv, 1, b, f * W, f * W, 0),
                                                             0, 2, 1, 3)))  # [b, Rkv]
            kqv = lib.mul_mat(ctx, v_b.tensor, lib.mul_mat(ctx, v, kq))  # [v, n, H]
            out = lib.cont_2d(ctx, lib.permute(ctx, kqv, 0, 2, 1, 3), hv * H, n)
            lib.build_forward_expand(g.graph, out)
            ins.append((f32_view(lib, k, (b, W)), f32_view(lib, mask, (n, b))))
            outs.append(f32_view(lib, out, (n, hv * H)))
            at += n
        return f32_view(lib, qt, (T, H, W)), ins, outs

    acts = T * H * (2 * W + 3 * hv + 2 * Rkv) + sum(b * (2 * W + Rkv + n * (2 + 3 * H)) for b, (_, _, n) in
                                                    zip(spans, segs))
    key = ("mla_att", il, tuple((n, b) for b, (_, _, n) in zip(spans, segs)))
    with runner.lock:
        g = runner.graph(key, 4 * acts + 4096 * len(segs), 4 + 14 * len(segs), build)
        try:
            q_in, ins, outs = g.t
            q_in[...] = qcur
            for (rows, p0, n), b, (k_in, mask) in zip(segs, spans, ins):
                S = rows.shape[0]
                k_in[:S] = rows
                k_in[S:] = 0
                j = np.arange(b)[None, :]
                mask[...] = np.where((j > (p0 + np.arange(n))[:, None]) | (j >= S), np.float32(-np.inf),
                                     np.float32(0))
            runner.compute(g.graph, sum(b * n * H * (W + Rkv) for b, (_, _, n) in zip(spans, segs)))
            return np.concatenate([o.copy() for o in outs]) if len(outs) > 1 else outs[0].copy()
        finally:
            runner.release(g)


def gate_probs(W, cur: np.ndarray, gating: str) -> tuple[np.ndarray, np.ndarray] | None:
    """The router's logits and its gating function's output, ``(logits, probs)`` (n, n_expert), by
    ggml as llama.cpp's build_moe_ffn computes them (``mul_mat`` then ``sigmoid`` or ``soft_max``);
    None unless ``W`` is a ggml matrix (the ggml kernel's router) and libggml has the ops. Why:
    ggml's sigmoid is the C library's ``expf`` (vectorised), 1 ulp from numpy's ``exp`` in ~1 value
    of 6, and a weight 1 ulp off changes every routed output's last bits."""
    runner = getattr(W, "runner", None)
    lib = runner.lib if runner is not None else None
    if lib is None or getattr(lib, "sigmoid", None) is None or getattr(lib, "soft_max_ext", None) is None:
        return None
    cur = np.ascontiguousarray(cur, dtype=np.float32)
    n, n_in = cur.shape
    n_out = W.shape[0]
    if n == 0:
        return None
    rows = max(n, getattr(W, "min_rows", 1))  # the router's one-row kernel differs: pad as QuantisedMatrix does
    x = cur if rows == n else np.concatenate([cur, np.repeat(cur[-1:], rows - n, axis=0)])

    def build(g):
        xt = lib.new_tensor_2d(g.ctx, GGML_TYPE_F32, n_in, rows)
        logits = lib.mul_mat(g.ctx, W.tensor, xt)
        probs = lib.sigmoid(g.ctx, logits) if gating == "sigmoid" else lib.soft_max_ext(g.ctx, logits, None, 1.0, 0.0)
        lib.build_forward_expand(g.graph, probs)
        return f32_view(lib, xt, (rows, n_in)), f32_view(lib, logits, (rows, n_out)), f32_view(lib, probs, (rows, n_out))

    with runner.lock:
        g = runner.graph(("gate_probs", W.tensor, gating, rows), 4 * rows * (n_in + 3 * n_out) + 1024, 8, build)
        try:
            x_in, lg, pr = g.t
            x_in[...] = x
            runner.compute(g.graph, rows * n_in * n_out)
            return lg[:n].copy(), pr[:n].copy()
        finally:
            runner.release(g)
