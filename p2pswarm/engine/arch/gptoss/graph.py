"""gpt-oss's attention layer as ONE ggml graph (the ggml kernel), built from the shared pieces of
:mod:`p2pswarm.engine.ggml.attention` (the cache attention, the layer runner, the experts' input):
see that module for the memory and batch-invariance rules both layer graphs keep."""
from __future__ import annotations

import math

import numpy as np

from p2pswarm.engine.ggml.attention import (PROJ, cache_attention, decode_key, ffn_input_nodes, layer_tensors,
                                            moe_input_floats, reserve_spans, run_layer)
from p2pswarm.engine.experts.ggml_bank import rows_node
from p2pswarm.engine.ggml.lib import GGML_TYPE_I32
from p2pswarm.engine.ggml.runner import GgmlRunner, _i32_view, f32_view

GGML_ROPE_TYPE_NEOX = 2  # ggml.h: NEOX pairing (gpt-oss)
#: gpt-oss's attention layer (after ``blk.N.``): projections, then the F32 vectors (q/k/v biases optional)
_SINK_VECTORS = ("attn_norm.weight", "attn_q.bias", "attn_k.bias", "attn_v.bias", "attn_output.bias",
                 "attn_sinks.weight", "post_attention_norm.weight")


def sink_attention(model, runner: GgmlRunner, il: int, h: np.ndarray, segs, *, window: int | None,
                   rope_base: float, front=None):
    """A gpt-oss attention layer for every segment's rows, one graph, and what its output feeds:
    ``(h + attn_output(attention(attn_norm(h))) + bias, post_attention_norm(of that), extras)``.

    llama.cpp's ops for the layer (``src/models/openai-moe.cpp``; ``build_attn_mha``):
    attn_norm, q/k/v projections plus their biases, NEOX RoPE with YaRN (``ggml_rope_ext``,
    ``rope_base`` the layer's base), per sequence its k/v written into its cache and attention over
    it (``mul_mat`` + ``soft_max_ext`` with the causal mask, and with ``window`` the sliding-window
    mask, + the head's sink logit, ``ggml_soft_max_add_sinks``, + ``mul_mat``), attn_output plus
    its bias, the residual, post_attention_norm, and the router's logits (before its bias:
    :func:`~p2pswarm.engine.ggml.attention.moe_inputs`). ``segs`` as :func:`~p2pswarm.engine.ggml.attention.cache_attention`'s; a
    sliding layer's cache may start after position 0 (``first``), which the mask accounts for.
    Why one graph: the per-piece path is ~10 graphs and numpy between them per decode step, and
    numpy's attention grows with the context on one core (see gptoss.py).

    ``front`` (an :class:`~p2pswarm.engine.experts.ggml_bank.ExpertsInFront` of layer ``il - 1``):
    the layer's input rows are not given but computed first in the same graph, the previous
    layer's routed experts, their combine and its residual (``h`` is then ``front.h``)."""
    lib = runner.lib
    lt = layer_tensors(model, il, PROJ, _SINK_VECTORS)
    T, E = h.shape
    H, Hkv, hd = model.n_head, model.n_head_kv, model.head_dim
    q_w, kv_w = H * hd, Hkv * hd
    spans = reserve_spans(segs)
    n_seq = len(segs)
    acts = (T * (8 * E + 9 * q_w + 5 * kv_w + 5) + moe_input_floats(model, il, T)
            + sum(b * n * (1 + 2 * H) + 2 * n * q_w + n * kv_w + n for b, (_, _, n) in zip(spans, segs)))
    n_tensors = 64 + 28 * n_seq
    macs = T * E * (2 * q_w + 2 * kv_w) + sum(2 * b * n * q_w for b, (_, _, n) in zip(spans, segs))
    if front is not None:
        more_bytes, more_tensors, more_macs = front.cost()
        acts, n_tensors, macs = acts + more_bytes // 4, n_tensors + more_tensors, macs + more_macs
    key = decode_key(("sink-attention", il, T, front.key if front is not None else None), segs, spans)
    rope_args = (model.n_rot, GGML_ROPE_TYPE_NEOX, int(model.n_ctx_orig), rope_base, model.freq_scale,
                 model.ext_factor, model.attn_factor, model.beta_fast, model.beta_slow)

    def build(g):
        ctx, t = g.ctx, lt.t
        ht, h_in, fills = rows_node(lib, ctx, T, E, front)
        pos = lib.new_tensor_1d(ctx, GGML_TYPE_I32, T)
        x = lib.mul(ctx, lib.rms_norm(ctx, ht, model.eps), t["attn_norm.weight"])
        qkv = []
        for n, heads in (("attn_q", H), ("attn_k", Hkv), ("attn_v", Hkv)):
            y = lib.mul_mat(ctx, t[n + ".weight"], x)
            if n + ".bias" in t:
                y = lib.add(ctx, y, t[n + ".bias"])
            qkv.append(lib.reshape_3d(ctx, y, hd, heads, T))
        q, k, v = qkv
        q = lib.rope_ext(ctx, q, pos, None, *rope_args)  # [hd, H, T]
        k = lib.rope_ext(ctx, k, pos, None, *rope_args)  # [hd, Hkv, T]
        att, per_seq = cache_attention(g, q, k, v, segs, spans, H, Hkv, hd, 1.0 / math.sqrt(model.n_rot),
                                       sinks=t["attn_sinks.weight"])
        out = lib.add(ctx, lib.mul_mat(ctx, t["attn_output.weight"], att), t["attn_output.bias"])
        res = lib.add(ctx, out, ht)
        lib.build_forward_expand(g.graph, res)
        cur, extras = ffn_input_nodes(model, il, runner, g, res, lt, T)
        return h_in, _i32_view(lib, pos, T), per_seq, f32_view(lib, res, (T, E)), cur, extras, fills

    def positions(pos_in, p):
        pos_in[...] = p

    return run_layer(runner, key, 4 * acts + 64 * n_tensors, n_tensors, build, h, segs, spans, positions, macs,
                      window, front)
