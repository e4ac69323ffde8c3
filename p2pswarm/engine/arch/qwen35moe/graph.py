"""qwen35moe's gated attention layer as ONE ggml graph (the ggml kernel), built from the shared
pieces of :mod:`p2pswarm.engine.ggml.attention` (the cache attention, the layer runner, the experts'
input): see that module for why one graph, and the memory and batch-invariance rules."""
from __future__ import annotations

import ctypes
import math

import numpy as np

from p2pswarm.engine.ggml.attention import (cache_attention, decode_key, ffn_input_nodes, layer_tensors,
                                            moe_input_floats, reserve_spans, run_layer)
from p2pswarm.engine.experts.ggml_bank import rows_node
from p2pswarm.engine.ggml.dense import mul_mat_rows, split_cost
from p2pswarm.engine.ggml.lib import GGML_TYPE_I32
from p2pswarm.engine.ggml.runner import GgmlRunner, _i32_view, f32_view

GGML_ROPE_TYPE_IMROPE = 40  # ggml.h: interleaved multi-axis RoPE (Qwen3-VL / Qwen3.5), NEOX pairing


def gated_attention(model, runner: GgmlRunner, il: int, h: np.ndarray, segs, *,
                    with_ffn_input: bool = False, front=None):
    """``h + gated_attention(attn_norm(h))`` of layer ``il`` for every segment's rows, one graph.

    ``segs``: ``(kv, pos0, n)`` per sequence, in the order of ``h``'s rows (kv: its KVCache of this
    layer, updated: its ``n`` grows by the segment's rows). Returns the new h (T, E) float32, and
    with ``with_ffn_input`` also ``post_attention_norm(h)`` and what that feeds besides the routed
    experts (:func:`~p2pswarm.engine.ggml.attention.moe_inputs`: ``{"logits", "shared"}``).

    A decode step's graph (one row per sequence) is kept and reused while the step's shape
    repeats: its key is the rows, each cache's memory and capacity and its :func:`~p2pswarm.engine.ggml.attention.kv_span`. The
    step's new keys and values go in by ``ggml_set_rows`` at positions that are input data (as
    llama.cpp writes its cache), not by copies onto views whose offsets would be part of the graph.

    ``front``: layer ``il - 1``'s experts and residual computed in front of the layer, in the same
    graph (:class:`~p2pswarm.engine.experts.ggml_bank.ExpertsInFront`; ``h`` is then ``front.h``)."""
    lib = runner.lib
    lt = layer_tensors(model, il)
    T, E = h.shape
    H, Hkv, hd = model.n_head, model.n_head_kv, model.head_dim
    q_w = H * hd
    kv_w = Hkv * hd
    spans = reserve_spans(segs)
    n_seq = len(segs)
    # activations of the graph (every non-view tensor), in floats, with slack per tensor
    acts = (T * (8 * E + 9 * q_w + 5 * kv_w + 5)
            + sum(b * n * (1 + 2 * H) + 2 * n * q_w + n * kv_w + n for b, (_, _, n) in zip(spans, segs)))
    n_tensors = 40 + 28 * n_seq
    macs = T * E * (3 * q_w + 2 * kv_w) + sum(2 * b * n * q_w for b, (_, _, n) in zip(spans, segs))
    split_tensors = 0
    for out_n in (2 * q_w, kv_w, kv_w, E):  # the q | gate, k, v and output projections (mul_mat_rows)
        more_floats, more_tensors = split_cost(out_n, T)
        acts, split_tensors = acts + more_floats, split_tensors + more_tensors
    n_tensors += split_tensors
    if front is not None:
        more_bytes, more_tensors, more_macs = front.cost()
        acts, n_tensors, macs = acts + more_bytes // 4, n_tensors + more_tensors, macs + more_macs
    key = decode_key(("attention", il, T, with_ffn_input, front.key if front is not None else None, split_tensors),
                     segs, spans)  # split_tensors: a kept graph split or not (mul_mat_rows)

    def build(g):
        ctx = g.ctx
        f = 4
        ht, h_in, fills = rows_node(lib, ctx, T, E, front)
        pos = lib.new_tensor_1d(ctx, GGML_TYPE_I32, 4 * T)
        x = lib.mul(ctx, lib.rms_norm(ctx, ht, model.eps), lt.t["attn_norm.weight"])
        qg = mul_mat_rows(lib, ctx, lt.t["attn_q.weight"], x, E, T)  # [2 hd, H, T] head by head: q | gate
        kc = mul_mat_rows(lib, ctx, lt.t["attn_k.weight"], x, E, T)
        vc = mul_mat_rows(lib, ctx, lt.t["attn_v.weight"], x, E, T)
        q = lib.view_3d(ctx, qg, hd, H, T, f * 2 * hd, f * 2 * q_w, 0)
        gate = lib.cont_2d(ctx, lib.view_3d(ctx, qg, hd, H, T, f * 2 * hd, f * 2 * q_w, f * hd), q_w, T)
        q = lib.mul(ctx, lib.rms_norm(ctx, q, model.eps), lt.t["attn_q_norm.weight"])
        k = lib.mul(ctx, lib.rms_norm(ctx, lib.reshape_3d(ctx, kc, hd, Hkv, T), model.eps), lt.t["attn_k_norm.weight"])
        v = lib.reshape_3d(ctx, vc, hd, Hkv, T)
        sections = (ctypes.c_int * 4)(*model.rope_sections)
        rope_args = (model.n_rot, sections, GGML_ROPE_TYPE_IMROPE, int(model.n_ctx_train), model.rope_base,
                     1.0, 0.0, 1.0, 32.0, 1.0)  # freq_scale, ext_factor, attn_factor, beta_fast/slow
        q = lib.rope_multi(ctx, q, pos, None, *rope_args)  # [hd, H, T]
        k = lib.rope_multi(ctx, k, pos, None, *rope_args)  # [hd, Hkv, T]
        att, per_seq = cache_attention(g, q, k, v, segs, spans, H, Hkv, hd, 1.0 / math.sqrt(hd))
        gated = lib.mul(ctx, att, lib.sigmoid(ctx, gate))
        res = lib.add(ctx, mul_mat_rows(lib, ctx, lt.t["attn_output.weight"], gated, q_w, T), ht)
        lib.build_forward_expand(g.graph, res)
        cur, extras = ffn_input_nodes(model, il, runner, g, res, lt, T) if with_ffn_input else (None, {})
        return h_in, _i32_view(lib, pos, 4 * T), per_seq, f32_view(lib, res, (T, E)), cur, extras, fills

    def positions(pos_in, p):  # IMROPE's four position streams (t, h, w, e), each T long: text is (p, p, p, 0)
        pos_in[:3 * T] = np.tile(p, 3)
        pos_in[3 * T:] = 0

    if with_ffn_input:
        acts += moe_input_floats(model, il, T)
        n_tensors += 24
    h_out, cur_out, more = run_layer(runner, key, 4 * acts + 64 * n_tensors, n_tensors, build, h, segs, spans,
                                      positions, macs, front=front)
    return (h_out, cur_out, more) if with_ffn_input else h_out
