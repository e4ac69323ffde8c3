"""A qwen35moe gated-attention layer's whole ``pre_moe`` as ONE ggml graph, for the ggml kernel.

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
(``ggml_backend_cpu_buffer_from_ptr``): the graph writes the step's k/v rows into it (``ggml_cpy``
onto a view, ordered before the attention that reads them, as llama.cpp's KV writes are) and reads
keys and values^T from it, with no copy. A decode row's attention result is placed straight into
its row of the layer's attention tensor, so a decode sequence costs 5 nodes (k copy, v copy,
``mul_mat``, ``soft_max_ext``, ``mul_mat``), each ending in a barrier of ggml's threads: what a
step of many sequences pays per sequence. The quantised projections are the memory map's tensors
(:class:`~p2pswarm.engine.ggml_dense.QuantisedMatrix`), and so are float ones and the norm
weights (wrapped once per layer, :meth:`~p2pswarm.engine.ggml_dense.GgmlDense.mapped`).

Batch invariance: the row-wise ops (norms, RoPE, gate, residual) give a row the same bits whatever
rows share the graph, and each sequence's attention is its own ops on its own cache with the shape
it has alone; only the projections see all rows (the backbone's probe decides whether those may be
batched, :func:`p2pswarm.backbone.runner.probe_dense_invariance`).
"""
from __future__ import annotations

import ctypes
import math

import numpy as np

from p2pswarm.engine.ggml_deltanet import _place
from p2pswarm.engine.ggml_dense import QuantisedMatrix
from p2pswarm.engine.ggml_kernel import GGML_TYPE_F32, GGML_TYPE_I32, GgmlRunner, _InitParams, _i32_view, f32_view
from p2pswarm.engine.state import aligned_zeros

F32 = np.float32
GGML_ROPE_TYPE_IMROPE = 40  # ggml.h: interleaved multi-axis RoPE (Qwen3-VL / Qwen3.5), NEOX pairing
_OPS = ("rms_norm", "mul", "add", "sigmoid", "rope_multi", "soft_max_ext", "permute", "transpose", "cont_2d", "cpy",
        "reshape_3d", "view_2d")
_PROJ = ("attn_q", "attn_k", "attn_v", "attn_output")
_NORMS = ("attn_norm", "attn_q_norm", "attn_k_norm", "post_attention_norm")


def available(runner: GgmlRunner | None) -> bool:
    """Whether ``runner``'s libggml has every op the layer graph uses (else the per-piece path)."""
    return runner is not None and all(getattr(runner.lib, n, None) is not None for n in _OPS)


class _LayerTensors:
    """One layer's weights as ggml tensors, made once and kept: the projections and norm weights
    are the file's own bytes on the memory map (quantised ones are the dense path's
    :class:`~p2pswarm.engine.ggml_dense.QuantisedMatrix` tensors; F32/F16/BF16 ones are wrapped the
    same way, so an F32 model is not held twice, and they are multiplied as llama.cpp multiplies
    them). Only a norm stored other than F32 (ggml_mul wants F32) is copied, into a small context
    of its own."""

    def __init__(self, runner: GgmlRunner, w, il: int):
        lib = runner.lib
        dense = w.ggml_dense
        p = f"blk.{il}."
        self.lib = lib
        self.ctx = None
        self.t: dict[str, int] = {}
        copies: dict[str, np.ndarray] = {}
        for n in _PROJ:
            m = w[p + n + ".weight"]
            if isinstance(m, QuantisedMatrix) and m.runner is runner:
                self.t[n] = m.tensor
            else:
                self.t[n] = dense.mapped(p + n + ".weight")
                if self.t[n] is None:  # pragma: no cover - every GGUF weight type is ggml's
                    copies[n] = np.ascontiguousarray(np.asarray(m, dtype=F32))
        for n in _NORMS:
            self.t[n] = dense.mapped(p + n + ".weight", types=(GGML_TYPE_F32,))
            if self.t[n] is None:
                copies[n] = np.ascontiguousarray(np.asarray(w[p + n + ".weight"], dtype=F32).reshape(1, -1))
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


def layer_tensors(model, il: int, runner: GgmlRunner) -> _LayerTensors:
    """The layer's kept ggml weights (made on first use, cached on the model)."""
    cache = model.__dict__.setdefault("_ggml_attention_tensors", {})
    got = cache.get(il)
    if got is None:
        got = cache[il] = _LayerTensors(runner, model.w, il)
    return got


def gated_attention(model, runner: GgmlRunner, il: int, h: np.ndarray, segs, *,
                    with_ffn_input: bool = False):
    """``h + gated_attention(attn_norm(h))`` of layer ``il`` for every segment's rows, one graph.

    ``segs``: ``(kv, pos0, n)`` per sequence, in the order of ``h``'s rows (kv: its KVCache of this
    layer, updated: its ``n`` grows by the segment's rows). Returns the new h (T, E) float32, and
    with ``with_ffn_input`` also ``post_attention_norm(h)``."""
    lib = runner.lib
    lt = layer_tensors(model, il, runner)
    T, E = h.shape
    H, Hkv, hd = model.n_head, model.n_head_kv, model.head_dim
    q_w = H * hd
    kv_w = Hkv * hd
    for kv, _, n in segs:  # room first: the graph writes into the caches' memory as it is now
        kv.reserve(n)
    S = [kv.n + n for kv, _, n in segs]
    n_seq = len(segs)
    # activations of the graph (every non-view tensor), in floats, with slack per tensor
    acts = (T * (8 * E + 9 * q_w + 5 * kv_w + 4)
            + sum(s * n * (1 + 2 * H) + 2 * n * q_w for s, (_, _, n) in zip(S, segs)))
    n_tensors = 40 + 24 * n_seq
    macs = T * E * (3 * q_w + 2 * kv_w) + sum(2 * s * n * q_w for s, (_, _, n) in zip(S, segs))
    with runner.lock:
        ctx = runner.context(4 * acts + 64 * n_tensors, n_tensors)
        # the caches' tensors: metadata only, placed on the caches' own memory with tensor_alloc
        meta = lib.init(_InitParams((3 * n_seq + 2) * (lib.tensor_overhead_bytes + 16) + 1024, None, True))
        if not meta:
            raise MemoryError("ggml_init failed")
        buffers = []
        try:
            graph = lib.new_graph_custom(ctx, runner.graph_size(n_tensors), False)
            ht = lib.new_tensor_2d(ctx, GGML_TYPE_F32, E, T)
            f32_view(lib, ht, (T, E))[...] = h
            pos = lib.new_tensor_1d(ctx, GGML_TYPE_I32, 4 * T)
            p = np.concatenate([np.arange(p0, p0 + n) for _, p0, n in segs]).astype(np.int32)
            # IMROPE's four position streams (t, h, w, e), each T long: text is (p, p, p, 0)
            _i32_view(lib, pos, 4 * T)[...] = np.concatenate([p, p, p, np.zeros_like(p)])

            x = lib.mul(ctx, lib.rms_norm(ctx, ht, model.eps), lt.t["attn_norm"])
            qg = lib.mul_mat(ctx, lt.t["attn_q"], x)  # [2 hd, H, T] head by head: q | gate
            kc = lib.mul_mat(ctx, lt.t["attn_k"], x)
            vc = lib.mul_mat(ctx, lt.t["attn_v"], x)
            f = 4
            q = lib.view_3d(ctx, qg, hd, H, T, f * 2 * hd, f * 2 * q_w, 0)
            gate = lib.cont_2d(ctx, lib.view_3d(ctx, qg, hd, H, T, f * 2 * hd, f * 2 * q_w, f * hd), q_w, T)
            q = lib.mul(ctx, lib.rms_norm(ctx, q, model.eps), lt.t["attn_q_norm"])
            k = lib.mul(ctx, lib.rms_norm(ctx, lib.reshape_3d(ctx, kc, hd, Hkv, T), model.eps), lt.t["attn_k_norm"])
            v = lib.reshape_3d(ctx, vc, hd, Hkv, T)
            sections = (ctypes.c_int * 4)(*model.rope_sections)
            rope_args = (model.n_rot, sections, GGML_ROPE_TYPE_IMROPE, int(model.n_ctx_train), model.rope_base,
                         1.0, 0.0, 1.0, 32.0, 1.0)  # freq_scale, ext_factor, attn_factor, beta_fast/slow
            q = lib.rope_multi(ctx, q, pos, None, *rope_args)  # [hd, H, T]
            k = lib.rope_multi(ctx, k, pos, None, *rope_args)  # [hd, Hkv, T]
            # every sequence's attention, in row order, on memory of our own (``scratch``): a decode
            # row's result is placed straight into its row, so it needs no copy node
            scratch = aligned_zeros((T, q_w))
            buf_att = lib.backend_cpu_buffer_from_ptr(scratch.ctypes.data, scratch.nbytes)
            if not buf_att:
                raise MemoryError("ggml could not wrap the attention rows")
            buffers.append(buf_att)
            att = lib.new_tensor_2d(meta, GGML_TYPE_F32, q_w, T)
            _place(lib, buf_att, att, scratch.ctypes.data)
            scale = 1.0 / math.sqrt(hd)
            masks, at = [], 0
            for (kv, p0, n), s_len in zip(segs, S):
                cap = kv.k.shape[0]
                buf_k = lib.backend_cpu_buffer_from_ptr(kv.k.ctypes.data, kv.k.nbytes)
                buf_v = lib.backend_cpu_buffer_from_ptr(kv.vt.ctypes.data, kv.vt.nbytes)
                for b in (buf_k, buf_v):
                    if not b:
                        raise MemoryError("ggml could not wrap a KV cache")
                    buffers.append(b)
                ck = lib.new_tensor_3d(meta, GGML_TYPE_F32, hd, Hkv, cap)  # k (cap, Hkv, hd)
                cvt = lib.new_tensor_2d(meta, GGML_TYPE_F32, cap, kv_w)  # vt (Hkv, hd, cap)
                _place(lib, buf_k, ck, kv.k.ctypes.data)
                _place(lib, buf_v, cvt, kv.vt.ctypes.data)
                row = f * kv_w  # bytes per cached key position
                # 1. this sequence's new keys and values into its cache, before anything reads it
                #    (values transposed: one strided copy, as llama.cpp writes its V^T cache)
                new_k = lib.view_3d(ctx, k, hd, Hkv, n, f * hd, row, at * row)
                lib.build_forward_expand(graph, lib.cpy(ctx, new_k, lib.view_3d(ctx, ck, hd, Hkv, n, f * hd, row,
                                                                                   kv.n * row)))
                new_v = lib.transpose(ctx, lib.view_2d(ctx, v, kv_w, n, row, at * row))  # [n, kv_w]
                lib.build_forward_expand(graph, lib.cpy(ctx, new_v, lib.view_2d(ctx, cvt, n, kv_w, f * cap, f * kv.n)))
                # 2. attention over positions 0..s_len-1, keys [hd, S, Hkv] and values^T [S, hd, Hkv]
                #    as views of the cache
                keys = lib.view_3d(ctx, ck, hd, s_len, Hkv, row, f * hd, 0)
                vals_t = lib.view_3d(ctx, cvt, s_len, hd, Hkv, f * cap, f * cap * hd, 0)
                qs = lib.permute(ctx, lib.view_3d(ctx, q, hd, H, n, f * hd, f * q_w, at * f * q_w), 0, 2, 1, 3)
                mask = None
                if p0 + n < s_len or n > 1:  # else (a decode row at the cache's end) it sees every key
                    mask = lib.new_tensor_2d(ctx, GGML_TYPE_F32, s_len, n)
                    masks.append((mask, p0, n, s_len))
                kq = lib.soft_max_ext(ctx, lib.mul_mat(ctx, keys, qs), mask, scale, 0.0)  # [S, n, H]
                if n == 1:  # [hd, 1, H] is row ``at``'s layout: computed in place
                    kqv = lib.mul_mat(meta, vals_t, kq)
                    _place(lib, buf_att, kqv, scratch.ctypes.data + at * f * q_w)
                    lib.build_forward_expand(graph, kqv)
                else:  # [hd, n, H] -> rows [hd, H, n]
                    kqv = lib.mul_mat(ctx, vals_t, kq)
                    out = lib.view_3d(ctx, att, hd, H, n, f * hd, f * q_w, at * f * q_w)
                    lib.build_forward_expand(graph, lib.cpy(ctx, lib.permute(ctx, kqv, 0, 2, 1, 3), out))
                at += n
            gated = lib.mul(ctx, att, lib.sigmoid(ctx, gate))
            res = lib.add(ctx, lib.mul_mat(ctx, lt.t["attn_output"], gated), ht)
            lib.build_forward_expand(graph, res)
            cur = None
            if with_ffn_input:
                cur = lib.mul(ctx, lib.rms_norm(ctx, res, model.eps), lt.t["post_attention_norm"])
                lib.build_forward_expand(graph, cur)
            for mask, p0, n, s_len in masks:  # causal: key j is visible to query row i iff j <= p0 + i
                m = f32_view(lib, mask, (n, s_len))
                m[...] = np.where(np.arange(s_len)[None, :] > (p0 + np.arange(n))[:, None], F32(-np.inf), F32(0))
            runner.compute(graph, macs)
            for kv, _, n in segs:
                kv.n += n
            h_out = f32_view(lib, res, (T, E)).copy()
            cur_out = f32_view(lib, cur, (T, E)).copy() if cur is not None else None
            runner.done()
        finally:
            lib.free(meta)
            for b in buffers:
                lib.backend_buffer_free(b)
    return (h_out, cur_out) if with_ffn_input else h_out



def post_attention_norm(model, runner: GgmlRunner, il: int, h: np.ndarray) -> np.ndarray:
    """``post_attention_norm(h)`` of layer ``il`` by ggml (the ops the layer graph ends with, so the
    same bits per row), for an ``h`` that did not just come out of :func:`gated_attention`."""
    lib = runner.lib
    lt = layer_tensors(model, il, runner)
    T, E = h.shape
    with runner.lock:
        ctx = runner.context(4 * 4 * T * E, 8)
        graph = lib.new_graph_custom(ctx, runner.graph_size(8), False)
        ht = lib.new_tensor_2d(ctx, GGML_TYPE_F32, E, T)
        f32_view(lib, ht, (T, E))[...] = h
        cur = lib.mul(ctx, lib.rms_norm(ctx, ht, model.eps), lt.t["post_attention_norm"])
        lib.build_forward_expand(graph, cur)
        runner.compute(graph, 0)
        out = f32_view(lib, cur, (T, E)).copy()
        runner.done()
    return out
