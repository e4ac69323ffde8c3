"""An attention layer's whole ``pre_moe`` as ONE ggml graph, for the ggml kernel: qwen35moe's gated
attention (:func:`~p2pswarm.engine.arch.qwen35moe.graph.gated_attention`) and gpt-oss's attention with sinks and a sliding window
(:func:`p2pswarm.engine.arch.gptoss.graph.sink_attention`, in gpt-oss's package); both write and
read their KV caches in place (:func:`cache_attention`), and both are built from the pieces here.

Why one graph: the per-piece path (:meth:`~p2pswarm.engine.arch.qwen35moe.Qwen35MoE._full_attention_rows`)
runs the q/k/v projections as one ggml graph, then the attn_norm, the per-head q/k RMSNorms, IMROPE,
each sequence's attention (softmax included), the sigmoid gate and the residual in numpy on one
core while ggml's other threads wait, then attn_output as another graph. Here all of it is one
``runner.compute``: attn_norm RMSNorm, q(+gate)/k/v projections, the q/k norms, IMROPE
(``ggml_rope_multi``, mode 40), per sequence its new k/v written into its KV cache and attention
over that cache (``mul_mat`` + ``soft_max_ext`` with the causal mask of its rows + ``mul_mat``,
GQA by ``mul_mat``'s broadcast over heads), the sigmoid gate, attn_output and the residual add;
with ``with_ffn_input`` also the layer's post_attention_norm (the experts' input). These are the
ops llama.cpp builds for this layer (src/models/qwen35moe.cpp, build_layer_attn; graph.cpp,
build_attn_mha), so the numerics are llama.cpp's. numpy only fills the graph's inputs (the rows,
IMROPE's positions, the causal masks); no arithmetic of the layer is left to it.

Memory: the KV cache (:class:`~p2pswarm.engine.state.KVCache`: aligned, values transposed as
llama.cpp keeps them without flash attention) is wrapped in place
(``ggml_backend_cpu_buffer_from_ptr``): the graph writes the step's k/v rows into it
(``ggml_set_rows`` at positions that are input data, ordered before the attention that reads them,
as llama.cpp's KV writes are) and reads keys and values^T from it over the sequence's
:func:`kv_span`, with no copy. A decode row's attention result is placed straight into its row of
the layer's attention tensor, so a decode sequence costs 5 nodes (k write, v write, ``mul_mat``,
``soft_max_ext``, ``mul_mat``), each ending in a barrier of ggml's threads: what a step of many
sequences pays per sequence. The quantised projections are the memory map's tensors
(:class:`~p2pswarm.engine.ggml.dense.QuantisedMatrix`), and so are float ones and the norm
weights (wrapped once per layer, :meth:`~p2pswarm.engine.ggml.dense.GgmlDense.mapped`).

Batch invariance: the row-wise ops (norms, RoPE, gate, residual) give a row the same bits whatever
rows share the graph, and each sequence's attention is its own ops on its own cache with the shape
it has alone; only the projections see all rows (the backbone's probe decides whether those may be
batched, :func:`p2pswarm.backbone.serving.runner.probe_dense_invariance`).
"""
from __future__ import annotations


import numpy as np

from p2pswarm.engine.ggml.dense import GgmlDense, QuantisedMatrix
from p2pswarm.engine.ggml.lib import GGML_TYPE_F32, GGML_TYPE_I32, GgmlUnavailable, _InitParams
from p2pswarm.engine.ggml.runner import GgmlRunner, _i32_view, f32_view
from p2pswarm.engine.state import aligned_zeros

F32 = np.float32
#: cache positions attended over come in multiples of this (llama.cpp pads its KV view to 256): see kv_span
KV_PAD = 256
_OPS = ("rms_norm", "mul", "add", "sigmoid", "rope_multi", "soft_max_ext", "permute", "transpose", "cont_2d", "cpy",
        "reshape_2d", "reshape_3d", "view_2d", "set_rows")
#: what gpt-oss's layer graph needs besides (:func:`p2pswarm.engine.arch.gptoss.graph.sink_attention`)
_SINK_OPS = ("rope_ext", "soft_max_add_sinks")
#: a gated-attention layer's weights (file names after ``blk.N.``): projections, then F32 vectors
PROJ = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight")
_NORMS = ("attn_norm.weight", "attn_q_norm.weight", "attn_k_norm.weight", "post_attention_norm.weight")


def graph_runner(model, sinks: bool = False) -> GgmlRunner | None:
    """The ggml runner that computes ``model``'s attention layers as one graph, or None (the numpy /
    portable kernels, a libggml without the ops, or the model's ``attention_graph`` off): the
    per-piece path then. ``sinks``: gpt-oss's graph (:func:`p2pswarm.engine.arch.gptoss.graph.sink_attention`)."""
    runner = model.backend.runner
    return runner if model.attention_graph and available(runner, sinks) else None


def available(runner: GgmlRunner | None, sinks: bool = False) -> bool:
    """Whether ``runner``'s libggml has every op the layer graph uses (``sinks``: gpt-oss's, see
    :func:`p2pswarm.engine.arch.gptoss.graph.sink_attention`), else the per-piece path."""
    ops = _OPS + _SINK_OPS if sinks else _OPS
    return runner is not None and runner.lib.has(*ops)


class _LayerTensors:
    """One layer's weights as ggml tensors, made once and kept: the projections and the vectors
    (norm weights; gpt-oss's biases and sinks) are the file's own bytes on the memory map (quantised ones are the dense path's
    :class:`~p2pswarm.engine.ggml.dense.QuantisedMatrix` tensors; F32/F16/BF16 ones are wrapped the
    same way, so an F32 model is not held twice, and they are multiplied as llama.cpp multiplies
    them). Only a vector stored other than F32 (ggml_mul wants F32) is copied, into a small context
    of its own. ``proj`` and ``vectors`` name them (after ``blk.N.``); a name the file does not
    have (an optional bias) is left out of ``t``."""

    def __init__(self, dense: GgmlDense, w, il: int, proj=PROJ, vectors=_NORMS):
        runner = dense.runner
        lib = runner.lib
        p = f"blk.{il}."
        self.lib = lib
        self.ctx = None
        self.t: dict[str, int | None] = {}  # (None: not mapped; copied below)
        copies: dict[str, np.ndarray] = {}
        for n in proj:
            m = w[p + n]
            if isinstance(m, QuantisedMatrix) and m.runner is runner:
                self.t[n] = m.tensor
            else:
                self.t[n] = dense.mapped(p + n)
                if self.t[n] is None:  # pragma: no cover - every GGUF weight type is ggml's
                    copies[n] = np.ascontiguousarray(np.asarray(m, dtype=F32))
        for n in vectors:
            if not w.has(p + n):
                continue
            self.t[n] = dense.mapped(p + n, types=(GGML_TYPE_F32,))
            if self.t[n] is None:
                copies[n] = np.ascontiguousarray(np.asarray(w[p + n], dtype=F32).reshape(1, -1))
        if copies:
            n_bytes = sum(a.nbytes for a in copies.values())
            self.ctx = lib.init(_InitParams(n_bytes + len(copies) * (lib.tensor_overhead_bytes + 64) + 1024,
                                            None, False))
            if not self.ctx:
                raise MemoryError("ggml_init failed for an attention layer's weights")
            for n, a in copies.items():
                t = lib.new_tensor_2d(self.ctx, GGML_TYPE_F32, a.shape[1], a.shape[0])
                f32_view(lib, t, a.shape)[...] = a
                self.t[n] = t

    def close(self) -> None:
        if self.ctx:
            self.lib.free(self.ctx)
            self.ctx = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass


def layer_tensors(model, il: int, proj=PROJ, vectors=_NORMS) -> _LayerTensors:
    """The layer's kept ggml weights (made on first use, kept by the model's ggml engine)."""
    cache = model.backend.ggml.attention_layers
    got = cache.get(il)
    if got is None:
        got = cache[il] = _LayerTensors(model.backend.ggml, model.w, il, proj, vectors)
    return got


class KVAhead:
    """A KV cache seen ``off`` positions ahead of its rows: what a one-token decode step would see
    after ``off`` more positions. A speculative verification's chunk passes its ``n`` positions to
    :func:`~p2pswarm.engine.arch.qwen35moe.graph.gated_attention` as ``n`` one-row segments on ``KVAhead(kv, 0 .. n-1)``: each row's
    key/value write, :func:`kv_span`, mask and attention nodes are then the ones a decode step at
    that position builds (the rows' writes come before any row's read of a later position only
    where that position is masked). The caller advances ``kv.n`` by ``n`` afterwards; ``n`` here
    is this view's own."""

    def __init__(self, kv, off: int):
        self.kv, self.off = kv, off
        self.n = kv.n + off

    @property
    def k(self) -> np.ndarray:
        return self.kv.k

    @property
    def vt(self) -> np.ndarray:
        return self.kv.vt

    def reserve(self, t: int) -> None:
        self.kv.reserve(self.off + t)


def kv_span(s_len: int) -> int:
    """How many cache positions a sequence of ``s_len`` attends over: ``s_len`` rounded up to
    ``KV_PAD``, the positions past it masked to -inf (as llama.cpp pads its KV view). Why: the
    attention graph's shapes then change once per ``KV_PAD`` steps, not every step, so a decode
    step's graph is kept and run again (:meth:`~p2pswarm.engine.ggml.runner.GgmlRunner.graph`). A
    masked position's softmax weight is exactly 0, and the cache is zero (or an older, finite
    value) there, so it adds exact zeros to the values' dot products; the span depends only on
    the sequence's own length, so a sequence gets the same bits alone or in any batch."""
    return -(-s_len // KV_PAD) * KV_PAD


def reserve_spans(segs) -> list[int]:
    """Each sequence's :func:`kv_span` after this call's rows, its cache given room for it first
    (the graph reads and writes the caches' memory as it is then)."""
    spans = [kv_span(kv.n + n) for kv, _, n in segs]
    for (kv, _, n), b in zip(segs, spans):
        kv.reserve(b - kv.n)
    return spans


def decode_key(head: tuple, segs, spans):
    """A decode step's graph key (one row per sequence): ``head`` and each cache's memory, capacity
    and span; None for any other step (never kept: see :meth:`GgmlRunner.graph`)."""
    if not all(n == 1 for _, _, n in segs):
        return None
    return (*head, tuple((kv.k.ctypes.data, kv.vt.ctypes.data, kv.k.shape[0], b) for (kv, _, _), b in zip(segs, spans)))


def ffn_input_nodes(model, il: int, runner: GgmlRunner, g, res, lt: _LayerTensors, T: int, nodes: dict | None = None):
    """post_attention_norm(res) and what it feeds besides the routed experts, added to the layer's
    graph: ``(numpy view of the norm, {"logits" | "shared": numpy view})``; with ``nodes``, the
    nodes too (``"cur"``, and ``"logits"`` where :func:`moe_inputs` added them)."""
    lib = runner.lib
    mul, rms_norm = lib.mul, lib.rms_norm
    if mul is None or rms_norm is None:  # (callers ask available() first)
        raise GgmlUnavailable("this libggml lacks ggml_mul or ggml_rms_norm")
    cur = mul(g.ctx, rms_norm(g.ctx, res, model.eps), lt.t["post_attention_norm.weight"])
    lib.build_forward_expand(g.graph, cur)
    if nodes is not None:
        nodes["cur"] = cur
    extras = moe_inputs(model, il, runner, g.ctx, g.graph, cur, T, nodes)
    return f32_view(lib, cur, (T, model.n_embd)), extras


def run_layer(runner: GgmlRunner, key, nbytes: int, n_tensors: int, build, h: np.ndarray, segs, spans,
               positions, macs: int, window: int | None = None, front=None):
    """Build (or take the kept) layer graph, fill its inputs (the rows, ``positions(pos_in, p)``
    for the rows' positions ``p``, the caches' indices and masks; with ``front``, an
    :class:`~p2pswarm.engine.experts.ggml_bank.ExpertsInFront` whose nodes ``build`` put in front
    of the layer, its inputs instead of the rows), compute it, advance the caches; returns copies
    of ``(h, cur or None, extras)``."""
    with runner.lock:
        g = runner.graph(key, nbytes, n_tensors, build, meta_tensors=3 * len(segs) + 2, recurs=True)
        try:
            h_in, pos_in, per_seq, h_res, h_cur, extras = g.t[:6]
            if front is None:
                h_in[...] = h
            else:  # (build made the rows with ggml_bank.rows_node: h_in is None)
                front.fill(g.t[6])
            if key is not None:  # a decode step: one position per sequence
                p = np.array([p0 for _, p0, _ in segs], dtype=np.int32)
            else:
                p = np.concatenate([np.arange(p0, p0 + n) for _, p0, n in segs]).astype(np.int32)
            positions(pos_in, p)
            fill_cache_inputs(segs, spans, per_seq, window)
            runner.compute(g.graph, macs)
            for kv, _, n in segs:
                kv.n += n
            h_out = h_res.copy()
            cur_out = h_cur.copy() if h_cur is not None else None
            more = {k: v.copy() for k, v in extras.items()}
        finally:
            runner.release(g)
    return h_out, cur_out, more


def cache_attention(g, q, k, v, segs, spans, H: int, Hkv: int, hd: int, scale: float, sinks=None):
    """Nodes of every sequence's attention over its own KV cache, in row order (llama.cpp's
    ``build_attn_mha`` without flash attention): its new keys and values written into its cache,
    then ``mul_mat`` + ``soft_max_ext`` (masked, scaled; with ``sinks``, an F32 tensor of ``H``
    logits, ``ggml_soft_max_add_sinks``) + ``mul_mat`` over its :func:`kv_span`, GQA by
    ``mul_mat``'s broadcast over heads.

    ``q`` [hd, H, T], ``k``/``v`` [hd, Hkv, T]: the step's rows after RoPE. ``segs``: ``(kv, pos0,
    n)`` per sequence (caches with room for their spans already); ``spans``: their spans. Returns
    ``(att, per_seq)``: ``att`` the [H * hd, T] result, on memory of its own (a decode row's result
    is placed straight into its row, so it needs no copy node), and per sequence the inputs
    :func:`fill_cache_inputs` fills (mask, key and value indices)."""
    lib, ctx, f = g.lib, g.ctx, 4
    T = sum(n for _, _, n in segs)
    q_w, kv_w = H * hd, Hkv * hd
    scratch = aligned_zeros((T, q_w))
    g.keep.append(scratch)
    buf_att = g.wrap(scratch)
    att = lib.new_tensor_2d(g.meta, GGML_TYPE_F32, q_w, T)
    g.place(buf_att, att, scratch.ctypes.data)
    per_seq, at = [], 0
    for (kv, _, n), b in zip(segs, spans):
        cap = kv.k.shape[0]
        ck = lib.new_tensor_3d(g.meta, GGML_TYPE_F32, hd, Hkv, cap)  # k (cap, Hkv, hd)
        cvt = lib.new_tensor_2d(g.meta, GGML_TYPE_F32, cap, kv_w)  # vt (Hkv, hd, cap)
        g.place(g.wrap(kv.k), ck, kv.k.ctypes.data)
        g.place(g.wrap(kv.vt), cvt, kv.vt.ctypes.data)
        row = f * kv_w  # bytes per cached key position
        # 1. this sequence's new keys and values into its cache, before anything reads it: rows
        #    of k at its positions; values transposed, one element per index (llama.cpp's cpy_v)
        k_idx = lib.new_tensor_1d(ctx, GGML_TYPE_I32, n)
        v_idx = lib.new_tensor_1d(ctx, GGML_TYPE_I32, n * kv_w)
        new_k = lib.view_2d(ctx, k, kv_w, n, row, at * row)
        lib.build_forward_expand(g.graph, lib.set_rows(ctx, lib.reshape_2d(ctx, ck, kv_w, cap), new_k, k_idx))
        new_v = lib.reshape_2d(ctx, lib.view_2d(ctx, v, kv_w, n, row, at * row), 1, n * kv_w)
        lib.build_forward_expand(g.graph, lib.set_rows(ctx, lib.reshape_2d(ctx, cvt, 1, cap * kv_w), new_v, v_idx))
        # 2. attention over its span, keys [hd, b, Hkv] and values^T [b, hd, Hkv] as views of
        #    the cache; what a row may not see masked (fill_cache_inputs)
        keys = lib.view_3d(ctx, ck, hd, b, Hkv, row, f * hd, 0)
        vals_t = lib.view_3d(ctx, cvt, b, hd, Hkv, f * cap, f * cap * hd, 0)
        qs = lib.permute(ctx, lib.view_3d(ctx, q, hd, H, n, f * hd, f * q_w, at * f * q_w), 0, 2, 1, 3)
        mask = lib.new_tensor_2d(ctx, GGML_TYPE_F32, b, n)
        kq = lib.soft_max_ext(ctx, lib.mul_mat(ctx, keys, qs), mask, scale, 0.0)  # [b, n, H]
        if sinks is not None:
            lib.soft_max_add_sinks(kq, sinks)
        if n == 1:  # [hd, 1, H] is row ``at``'s layout: computed in place
            kqv = lib.mul_mat(g.meta, vals_t, kq)
            g.place(buf_att, kqv, scratch.ctypes.data + at * f * q_w)
            lib.build_forward_expand(g.graph, kqv)
        else:  # [hd, n, H] -> rows [hd, H, n]
            kqv = lib.mul_mat(ctx, vals_t, kq)
            out = lib.view_3d(ctx, att, hd, H, n, f * hd, f * q_w, at * f * q_w)
            lib.build_forward_expand(g.graph, lib.cpy(ctx, lib.permute(ctx, kqv, 0, 2, 1, 3), out))
        per_seq.append((f32_view(lib, mask, (n, b)), _i32_view(lib, k_idx, n),
                        _i32_view(lib, v_idx, n * kv_w).reshape(n, kv_w),
                        np.arange(kv_w, dtype=np.int32) * np.int32(cap)))  # v's index of position 0
        at += n
    return att, per_seq


def fill_cache_inputs(segs, spans, per_seq, window: int | None = None) -> None:
    """The inputs of :func:`cache_attention`'s nodes for this call: where each sequence's new keys
    and values go (its cache's next rows), and its mask. A query at position ``p`` sees the cached
    key at position ``j`` iff ``j <= p`` and, with ``window``, ``p - j < window`` (llama.cpp's
    causal and standard sliding-window masks); cache row ``r`` holds position ``first + r``
    (``first`` is 0 unless the cache dropped its oldest rows, see
    :class:`~p2pswarm.engine.arch.gptoss.model.WindowKVCache`); nothing past the rows written is seen."""
    for (kv, p0, n), b, (mask, k_idx, v_idx, v_base) in zip(segs, spans, per_seq):
        first = getattr(kv, "first", 0)
        if n == 1:
            k_idx[0] = kv.n
            np.add(v_base, kv.n, out=v_idx[0])
            seen = min(p0 + 1 - first, kv.n + 1)
            lo = 0 if window is None else max(0, p0 - window + 1 - first)
            mask[0, :lo] = -np.inf
            mask[0, lo:seen] = 0
            mask[0, seen:] = -np.inf
            continue
        new = kv.n + np.arange(n, dtype=np.int32)
        k_idx[...] = new
        v_idx[...] = v_base[None, :] + new[:, None]
        r = np.arange(b)[None, :]
        kpos, qpos = first + r, (p0 + np.arange(n))[:, None]
        masked = (kpos > qpos) | (r >= kv.n + n)
        if window is not None:
            masked |= qpos - kpos >= window
        mask[...] = np.where(masked, F32(-np.inf), F32(0))


def post_attention_norm(model, runner: GgmlRunner, il: int, h: np.ndarray) -> np.ndarray | None:
    """``post_attention_norm(h)`` of layer ``il`` by ggml (the ops both layer graphs end with, so the
    same bits per row), for an ``h`` that did not just come out of a layer graph; None where the
    norm's weight is not an F32 tensor ggml can take from the file (numpy's then)."""
    return rms_norm_rows(model, runner, f"blk.{il}.post_attention_norm.weight", h)


def rms_norm_rows(model, runner: GgmlRunner, name: str, h: np.ndarray) -> np.ndarray | None:
    """``rms_norm(h) * w`` by ggml (llama.cpp's ``build_norm``), ``w`` the file's F32 tensor ``name``
    on the memory map; None where ``w`` is not F32."""
    lib = runner.lib
    w = model.backend.ggml.f32_vector(name)
    if w is None:
        return None
    T, E = h.shape

    def build(g):
        ht = lib.new_tensor_2d(g.ctx, GGML_TYPE_F32, E, T)
        cur = lib.mul(g.ctx, lib.rms_norm(g.ctx, ht, model.eps), w)
        lib.build_forward_expand(g.graph, cur)
        return f32_view(lib, ht, (T, E)), f32_view(lib, cur, (T, E))

    return runner.run_one(("rms_norm", name, T), 4 * 4 * T * E, 8, build, h, 0)


def moe_inputs(model, il: int, runner, ctx, graph, cur, T: int, nodes: dict | None = None) -> dict:
    """Nodes for what the layer's ``cur`` (post_attention_norm) feeds besides the routed experts:
    the router's logits and the shared expert (gated), added to the layer's graph, so a decode
    step runs one graph per layer instead of three. Returns ``{"logits" | "shared": numpy view}``
    for those it could add: the router where it is ggml's F32 mat-mul (a quantised model), the
    shared expert where its three matrices are quantised and its gate F32 on the file.

    The same ops on the same rows as the stand-alone graphs (:meth:`QuantisedMatrix.rmatmul_t`,
    :func:`~p2pswarm.engine.ggml.dense.fused_swiglu`), so the same bits: a lone row is multiplied
    by the F32 router padded to two rows (the single-row kernel is 1 ulp off), as there."""
    lib = runner.lib
    w = model.w
    p = f"blk.{il}."
    out = {}
    router = w[p + "ffn_gate_inp.weight"]
    if isinstance(router, QuantisedMatrix) and router.runner is runner:
        x = cur
        for _ in range(router.min_rows - T):  # the stand-alone path's pad: copies of the last row
            x = lib.concat(ctx, x, lib.view_2d(ctx, cur, router.shape[1], 1, 4 * router.shape[1], 4 * router.shape[1] * (T - 1)), 1)
        logits = lib.mul_mat(ctx, router.tensor, x)
        lib.build_forward_expand(graph, logits)
        out["logits"] = f32_view(lib, logits, (T, router.shape[0]))
        if nodes is not None:
            nodes["logits"] = logits
    if _has_shared(model, il):
        mats = [w[p + n + ".weight"] for n in ("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")]
        gate_inp = model.backend.ggml.f32_vector(p + "ffn_gate_inp_shexp.weight")
        if gate_inp is not None and all(isinstance(m, QuantisedMatrix) and m.runner is runner for m in mats):
            g, u, d = (m.tensor for m in mats)
            s = lib.mul_mat(ctx, d, lib.swiglu_split(ctx, lib.mul_mat(ctx, g, cur), lib.mul_mat(ctx, u, cur)))
            s = lib.mul(ctx, s, lib.sigmoid(ctx, lib.mul_mat(ctx, gate_inp, cur)))
            lib.build_forward_expand(graph, s)
            out["shared"] = f32_view(lib, s, (T, mats[2].shape[0]))
    return out


def moe_input_floats(model, il: int, T: int) -> int:
    """Room (floats) the nodes of :func:`moe_inputs` take in a graph of ``T`` rows, generously."""
    E = model.n_embd
    ff = model.w[f"blk.{il}.ffn_gate_shexp.weight"].shape[0] if _has_shared(model, il) else 0
    return max(T, 2) * (3 * E + 2 * model.n_expert + 4 * ff + 8)


def _has_shared(model, il: int) -> bool:
    """Whether layer ``il`` has a shared expert."""
    return bool(model.shared_expert[il])
