"""MLA's per-head products (``attn_k_b``, ``attn_v_b``) on their quantised bytes, by ggml.

Why: in a quantised deepseek2 GGUF these two 3-D tensors are quantised too (Q5_0 / Q8_0 / K-quants
by llama.cpp's quantiser), and llama.cpp multiplies them with ``ggml_mul_mat`` on a 3-D weight
(one matrix per head), which rounds the activations to the weight's dot-product type first. A
float32 product with the dequantised weight moves a layer's output by ~0.5% -- enough to flip
routing choices. This runs the same op on the same bytes, so the backbone's MLA rounds as llama.cpp
does (tests/test_deepseek2.py, the Q4_K_M routing test). On the ggml kernel the whole MLA layer is
one graph of llama.cpp's ops (:func:`mla_layer`); :class:`HeadMatrices` also serves the numpy MLA.
The router's gate (:func:`gate_probs`) is here too: the same reason, ggml's bits."""
from __future__ import annotations

import numpy as np

from p2pswarm.engine.ggml.dense import GgmlDense, QuantisedMatrix
from p2pswarm.engine.ggml.lib import GGML_TYPE_F32, GGML_TYPE_I32, QUANTISED_TYPES
from p2pswarm.engine.ggml.runner import _i32_view, f32_view
from p2pswarm.engine.arch.deepseek2.mla import YARN_BETA_FAST, YARN_BETA_SLOW


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


def head_matrices(dense: GgmlDense | None, name: str) -> "HeadMatrices | None":
    """``name`` as :class:`HeadMatrices` where the ggml kernel holds the dense path (``dense``, the
    model's backend's engine) and the tensor is quantised; None otherwise (the caller multiplies float32)."""
    if dense is None:
        return None
    t = dense._tensors_by_name().get(name)
    return HeadMatrices(dense, t) if t is not None and HeadMatrices.eligible(t) else None


def per_head_matmul(W, x: np.ndarray) -> np.ndarray:
    """``x[h] @ W[h].T`` for (H, T, in) x: by ggml for :class:`HeadMatrices`, numpy for arrays."""
    if isinstance(W, HeadMatrices):
        return W.matmul(x)
    return np.matmul(x, W.transpose(0, 2, 1))


# ---- a whole MLA layer as ONE graph, as llama.cpp builds it ----------------------------------------
# Why llama.cpp's ops: with quantised attn_k_b / attn_v_b, llama.cpp rounds the activations they
# multiply to 8 bits; a last-bit difference upstream (numpy's RoPE, softmax or QK^T against ggml's)
# flips some of those roundings and moves a layer's output by ~1e-4 relative, which over a few layers
# changes routing choices and logits by ~0.1. Why one graph: the same ops as separate graphs (attn_norm,
# the q_a/kv_a projections, q_a_norm, q_b, RoPE + absorption, attention, attn_output) cost a thread-team
# wake-up, numpy copies of every intermediate and, for a prefill, a freshly allocated scratch context
# each; llama.cpp runs the layer as one graph. The graph is llama.cpp's ops in llama.cpp's order
# (src/models/deepseek2.cpp, llama-graph.cpp build_attn + build_attn_mha without flash attention), so
# the backbone computes llama.cpp's bits (tests/test_deepseek2.py: teacher-forced layers equal).
_OPS = ("rope_ext", "rms_norm", "mul", "add", "permute", "concat", "view_2d", "view_3d", "reshape_2d", "reshape_3d",
        "soft_max_ext", "cont", "transpose", "cont_2d", "cpy", "set_rows")
_NORMS = ("attn_norm", "attn_q_a_norm", "attn_kv_a_norm")


def _projections(model) -> tuple[str, ...]:
    q = ("attn_q_a", "attn_q_b") if model.q_lora_rank > 0 else ("attn_q",)
    return (*q, "attn_kv_a_mqa", "attn_output")


def core_available(model) -> bool:
    """Whether the one-graph MLA layer runs for ``model``: the ggml kernel holds the dense path, the
    projections are its quantised matrices, the split MLA tensors are quantised
    (:class:`HeadMatrices`), the norms are F32 and libggml has the ops. Otherwise the caller keeps
    its numpy path (an F32 model: float32 math within llama.cpp's tolerance, not its bits)."""
    dense = model.backend.ggml
    if dense is None or not model.split_kv_b or not dense.lib.has(*_OPS):
        return False
    for il in range(model.n_layer):
        k_b, v_b = model._kv_b_halves(il)
        mats = [model.w[f"blk.{il}.{n}.weight"] for n in _projections(model)]
        norms = [n for n in _NORMS if n != "attn_q_a_norm" or model.q_lora_rank > 0]
        if not (isinstance(k_b, HeadMatrices) and isinstance(v_b, HeadMatrices)
                and all(isinstance(m, QuantisedMatrix) and m.runner is dense.runner and m.min_rows == 1 for m in mats)
                and all(dense.f32_vector(f"blk.{il}.{n}.weight") is not None for n in norms)):
            return False
    return True


def ffn_fusable(model, il: int) -> bool:
    """Whether layer ``il``'s FFN side can join its MLA graph (:func:`mla_layer` with ``ffn``):
    ``ffn_norm`` F32 on the file, and the dense FFN (a leading layer) or the router (a ggml F32
    matrix, gated by ggml's sigmoid / softmax as :func:`gate_probs`) and the shared expert held as
    ggml matrices of the layer's runner. Otherwise the pieces run it (numpy between graphs)."""
    dense = model.backend.ggml
    runner, p = dense.runner, f"blk.{il}."
    if dense.f32_vector(p + "ffn_norm.weight") is None or not dense.lib.has("swiglu_split", "sigmoid"):
        return False
    names = [n + ".weight" for n in _ffn_matrices(model, il)]
    if not model.is_dense_layer(il):
        names.append("ffn_gate_inp.weight")
    return all(isinstance(m, QuantisedMatrix) and m.runner is runner for m in (model.w[p + n] for n in names))


def _ffn_matrices(model, il: int) -> tuple[str, ...]:
    """The SwiGLU FFN computed with the layer: the dense FFN, else the shared expert (or none)."""
    if model.is_dense_layer(il):
        return ("ffn_gate", "ffn_up", "ffn_down")
    return ("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp") if model.n_expert_shared else ()


def _ffn_size(model, il: int, T: int) -> tuple[int, int]:
    """(room in floats, generously; multiply-adds) of the FFN nodes of :func:`_ffn_nodes`."""
    names = _ffn_matrices(model, il)
    ff = model.w[f"blk.{il}.{names[0]}.weight"].shape[0] if names else 0
    E, n_router = model.n_embd, 0 if model.is_dense_layer(il) else model.n_expert
    return max(T, 2) * (4 * E + 3 * n_router + 3 * ff + 8), T * 3 * E * ff + max(T, 2) * E * n_router


def _ffn_nodes(model, il: int, runner, ctx, graph, res, T: int) -> dict:
    """The layer's FFN side on ``res`` (h after attention), added to its graph, llama.cpp's ops in
    its order (src/models/deepseek2.cpp): ``cur = rms_norm(res) * ffn_norm``; a leading dense layer
    then ``out = res + down(swiglu(gate cur, up cur))``, the whole layer; a MoE layer the router's
    ``logits`` and its gating's ``probs`` (a lone row padded to two, as :func:`gate_probs` pads it:
    the F32 router's one-row kernel differs) and the shared expert's output ``shared``. The same
    ops on the same rows as the stand-alone graphs (:func:`~p2pswarm.engine.ggml.attention.rms_norm_rows`,
    :func:`gate_probs`, :func:`~p2pswarm.engine.ggml.dense.fused_swiglu`), so the same bits.
    Returns ``{name: numpy view}``; the group selection and top-k stay in numpy
    (:func:`~p2pswarm.engine.routing.route`): the ids go back to Python for dispatch anyway."""
    lib, w, p, E = runner.lib, model.w, f"blk.{il}.", model.n_embd
    cur = lib.mul(ctx, lib.rms_norm(ctx, res, model.eps), model.backend.ggml.f32_vector(p + "ffn_norm.weight"))
    lib.build_forward_expand(graph, cur)
    out = {"cur": f32_view(lib, cur, (T, E))}
    names = _ffn_matrices(model, il)
    if names:
        g, u, d = (w[p + n + ".weight"].tensor for n in names)
        ffn = lib.mul_mat(ctx, d, lib.swiglu_split(ctx, lib.mul_mat(ctx, g, cur), lib.mul_mat(ctx, u, cur)))
        if model.is_dense_layer(il):
            ffn = lib.add(ctx, res, ffn)
        lib.build_forward_expand(graph, ffn)
        out["out" if model.is_dense_layer(il) else "shared"] = f32_view(lib, ffn, (T, E))
    if not model.is_dense_layer(il):
        router = w[p + "ffn_gate_inp.weight"]
        x = cur
        for _ in range(router.min_rows - T):  # gate_probs' pad: copies of the last row
            x = lib.concat(ctx, x, lib.view_2d(ctx, cur, E, 1, 4 * E, 4 * E * (T - 1)), 1)
        logits = lib.mul_mat(ctx, router.tensor, x)
        probs = (lib.sigmoid(ctx, logits) if model.router.gating == "sigmoid"
                 else lib.soft_max_ext(ctx, logits, None, 1.0, 0.0))
        lib.build_forward_expand(graph, probs)
        out["logits"] = f32_view(lib, logits, (T, model.n_expert))
        out["probs"] = f32_view(lib, probs, (T, model.n_expert))
    return out


def mla_layer(model, il: int, h: np.ndarray, segs, ffn: bool = False):
    """``h + MLA(attn_norm(h))`` of layer ``il`` for every segment's rows, as one graph and one
    ``compute``; with ``ffn`` (where :func:`ffn_fusable`) ``(that h, {FFN side})``, the FFN side
    of the layer in the same graph (:func:`_ffn_nodes`). ``segs``: ``(cache, pos0, n)`` per sequence in the order of ``h``'s rows (cache: its
    :class:`~p2pswarm.engine.arch.deepseek2.mla.LatentCache` of this layer; its ``n`` grows by the segment's rows).

    The graph (shapes in ggml's order, T rows in all, W = Rkv + rope)::

        x     = rms_norm(h) * attn_norm                                         [E, T]
        q     = q_b(rms_norm(q_a x) * q_a_norm)  or  q x                        [nope + rope, H, T]
        kv    = kv_a_mqa x                                                      [W, T]
        Qcur  = [k_b^T q_nope, rope(q_pe)]   Kcur = [rms_norm(kv_c) * kv_a_norm, rope(kv_pe)]
        per sequence: Kcur rows -> its cache (set_rows at positions that are input data), then
            softmax(kq_scale * K Qcur + mask) over the cache's kv_span, times the latent part
            of the cache, times attn_v_b per head -> its rows of att              [v H, n]
        out   = h + attn_output att                                             [E, T]

    The cache (aligned memory, reserved to the span first) is wrapped in place, as the qwen35moe
    attention layer wraps its KV cache (:func:`~p2pswarm.engine.arch.qwen35moe.graph.gated_attention`):
    a decode step copies nothing of it, and its graph (one row per sequence) is kept and run again
    while the caches' memory and spans repeat. Positions past a sequence's end are masked to -inf:
    a softmax weight of exactly 0 times a finite (zero or stale) cache value adds exact zeros."""
    from p2pswarm.engine.ggml.attention import kv_span  # one padding rule for both

    dense = model.backend.ggml
    runner = dense.runner
    lib = runner.lib
    w, p = model.w, f"blk.{il}."
    mats = {n: w[p + n + ".weight"].tensor for n in _projections(model)}
    norm = {n: dense.f32_vector(p + n + ".weight") for n in _NORMS if n != "attn_q_a_norm" or model.q_lora_rank > 0}
    k_b, v_b = model._kv_b_halves(il)
    T, E = h.shape
    H, Rq, Rkv, rope, nope, hv = (model.n_head, model.q_lora_rank, model.kv_lora_rank, model.n_rot, model.n_nope,
                                  model.head_v)
    qk, W, f, y, eps = nope + rope, Rkv + rope, 4, model.yarn, model.eps
    rope_args = (rope, 0, int(y.n_ctx_orig), y.base, y.freq_scale, y.ext_factor, y.attn_factor, YARN_BETA_FAST,
                 YARN_BETA_SLOW)
    spans = [kv_span(c.n + n) for c, _, n in segs]
    for (c, _, n), b in zip(segs, spans):  # room first: the graph reads and writes the caches' memory as it is now
        c.reserve(b - c.n)
    caps = [c.rows.shape[0] for c, _, _ in segs]
    n_seq = len(segs)
    # every tensor that owns memory, in floats, generously
    acts = (T * (5 * E + 3 * Rq + H * (qk + 2 * Rkv + 2 * rope + 3 * W + 3 * hv) + 4 * W)
            + sum(b * (Rkv + n * (2 * H + 1)) + n * H * (Rkv + 2 * hv) for b, (_, _, n) in zip(spans, segs)))
    n_tensors = 48 + 20 * n_seq + (24 if ffn else 0)
    macs = T * (E * (Rq + W) + Rq * H * qk + H * hv * E + H * nope * Rkv) + sum(
        b * n * H * (W + Rkv) + n * H * Rkv * hv for b, (_, _, n) in zip(spans, segs))
    if ffn:
        ffn_acts, ffn_macs = _ffn_size(model, il, T)
        acts, macs = acts + ffn_acts, macs + ffn_macs
    key = (("mla_layer", il, T, ffn, tuple((c.rows.ctypes.data, cap, b) for (c, _, _), cap, b in zip(segs, caps, spans)))
           if all(n == 1 for _, _, n in segs) else None)

    def build(g):
        ctx = g.ctx

        def expand(node):
            lib.build_forward_expand(g.graph, node)

        ht = lib.new_tensor_2d(ctx, GGML_TYPE_F32, E, T)
        pt = lib.new_tensor_1d(ctx, GGML_TYPE_I32, T)
        x = lib.mul(ctx, lib.rms_norm(ctx, ht, eps), norm["attn_norm"])
        if Rq > 0:
            qa = lib.mul(ctx, lib.rms_norm(ctx, lib.mul_mat(ctx, mats["attn_q_a"], x), eps), norm["attn_q_a_norm"])
            q = lib.mul_mat(ctx, mats["attn_q_b"], qa)
        else:
            q = lib.mul_mat(ctx, mats["attn_q"], x)
        kv = lib.mul_mat(ctx, mats["attn_kv_a_mqa"], x)  # [W, T]
        q_nope = lib.view_3d(ctx, q, nope, H, T, f * qk, f * qk * H, 0)
        q_pe = lib.rope_ext(ctx, lib.view_3d(ctx, q, rope, H, T, f * qk, f * qk * H, f * nope), pt, None, *rope_args)
        q_abs = lib.permute(ctx, lib.mul_mat(ctx, k_b.tensor, lib.permute(ctx, q_nope, 0, 2, 1, 3)), 0, 2, 1, 3)
        qcur = lib.concat(ctx, q_abs, q_pe, 0)  # [W, H, T]
        c = lib.mul(ctx, lib.rms_norm(ctx, lib.view_2d(ctx, kv, Rkv, T, f * W, 0), eps), norm["attn_kv_a_norm"])
        k_pe = lib.rope_ext(ctx, lib.view_3d(ctx, kv, rope, 1, T, f * W, f * W, f * Rkv), pt, None, *rope_args)
        kcur = lib.reshape_2d(ctx, lib.concat(ctx, lib.reshape_3d(ctx, c, Rkv, 1, T), k_pe, 0), W, T)  # [W, T]
        att = lib.new_tensor_2d(ctx, GGML_TYPE_F32, hv * H, T) if n_seq > 1 else None
        per_seq, at, out = [], 0, None
        for (cache, _, n), b, cap in zip(segs, spans, caps):
            ck = lib.new_tensor_2d(g.meta, GGML_TYPE_F32, W, cap)  # the cache's rows (cap, W)
            g.place(g.wrap(cache.rows), ck, cache.rows.ctypes.data)
            idx = lib.new_tensor_1d(ctx, GGML_TYPE_I32, n)
            # 1. this sequence's new rows into its cache, before anything reads it
            expand(lib.set_rows(ctx, ck, lib.view_2d(ctx, kcur, W, n, f * W, at * f * W), idx))
            # 2. attention over its span: keys [W, b, 1], values^T [b, Rkv] from the cache
            k = lib.view_3d(ctx, ck, W, b, 1, f * W, f * W * b, 0)
            qs = lib.permute(ctx, lib.view_3d(ctx, qcur, W, H, n, f * W, f * W * H, at * f * W * H), 0, 2, 1, 3)
            mask = lib.new_tensor_2d(ctx, GGML_TYPE_F32, b, n)
            kq = lib.soft_max_ext(ctx, lib.mul_mat(ctx, k, qs), mask, model.kq_scale, 0.0)  # [b, n, H]
            v = lib.cont(ctx, lib.transpose(ctx, lib.view_2d(ctx, ck, Rkv, b, f * W, 0)))  # [b, Rkv]
            kqv = lib.mul_mat(ctx, v_b.tensor, lib.mul_mat(ctx, v, kq))  # [hv, n, H]
            if att is None:
                out = lib.cont_2d(ctx, lib.permute(ctx, kqv, 0, 2, 1, 3), hv * H, n)
            else:
                dst = lib.view_3d(ctx, att, hv, H, n, f * hv, f * hv * H, at * f * hv * H)
                expand(lib.cpy(ctx, lib.permute(ctx, kqv, 0, 2, 1, 3), dst))
            per_seq.append((f32_view(lib, mask, (n, b)), _i32_view(lib, idx, n)))
            at += n
        res = lib.add(ctx, lib.mul_mat(ctx, mats["attn_output"], att if att is not None else out), ht)
        expand(res)
        more = _ffn_nodes(model, il, runner, ctx, g.graph, res, T) if ffn else None
        return f32_view(lib, ht, (T, E)), _i32_view(lib, pt, T), per_seq, f32_view(lib, res, (T, E)), more

    with runner.lock:
        g = runner.graph(key, 4 * acts + 64 * n_tensors, n_tensors, build, meta_tensors=n_seq + 2, recurs=True)
        try:
            h_in, pos_in, per_seq, h_res, more = g.t
            h_in[...] = h
            pos_in[...] = np.concatenate([np.arange(p0, p0 + n) for _, p0, n in segs])
            for (cache, p0, n), b, (mask, idx) in zip(segs, spans, per_seq):
                idx[...] = cache.n + np.arange(n, dtype=np.int32)
                j = np.arange(b)[None, :]  # causal: key j is visible to row i iff j <= p0 + i, within the cache
                mask[...] = np.where((j > (p0 + np.arange(n))[:, None]) | (j >= cache.n + n), np.float32(-np.inf),
                                     np.float32(0))
            runner.compute(g.graph, macs)
            for cache, _, n in segs:
                cache.n += n
            if more is None:
                return h_res.copy()
            return h_res.copy(), {k: v.copy() for k, v in more.items()}
        finally:
            runner.release(g)


def gate_probs(W, cur: np.ndarray, gating: str) -> tuple[np.ndarray, np.ndarray] | None:
    """The router's logits and its gating function's output, ``(logits, probs)`` (n, n_expert), by
    ggml as llama.cpp's build_moe_ffn computes them (``mul_mat`` then ``sigmoid`` or ``soft_max``);
    None unless ``W`` is a ggml matrix (the ggml kernel's router) and libggml has the ops. Why:
    ggml's sigmoid is the C library's ``expf`` (vectorised), 1 ulp from numpy's ``exp`` in ~1 value
    of 6, and a weight 1 ulp off changes every routed output's last bits."""
    if not isinstance(W, QuantisedMatrix) or not W.runner.lib.has("sigmoid", "soft_max_ext"):
        return None
    runner, lib = W.runner, W.runner.lib
    cur = np.ascontiguousarray(cur, dtype=np.float32)
    n, n_in = cur.shape
    n_out = W.shape[0]
    if n == 0:
        return None
    rows = max(n, W.min_rows)  # the router's one-row kernel differs: pad as QuantisedMatrix does
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
