"""gpt-oss's attention layer as ONE ggml graph (the ggml kernel), built from the shared pieces of
:mod:`p2pswarm.engine.ggml.attention` (the cache attention, the layer runner, the experts' input):
see that module for the memory and batch-invariance rules both layer graphs keep. And a
one-sequence decode step with every expert on the backbone as ONE graph (:func:`decode_step`)."""
from __future__ import annotations

import math

import numpy as np

from p2pswarm.engine.ggml.attention import (PROJ, cache_attention, decode_key, ffn_input_nodes, fill_cache_inputs,
                                            layer_tensors, moe_input_floats, reserve_spans, run_layer)
from p2pswarm.engine.experts.ggml_bank import combine_nodes, expert_bytes, rows_node
from p2pswarm.engine.ggml.dense import QuantisedMatrix, mul_mat_rows
from p2pswarm.engine.ggml.lib import GGML_TYPE_F32, GGML_TYPE_I32
from p2pswarm.engine.ggml.runner import GgmlRunner, _i32_view, f32_view

GGML_ROPE_TYPE_NEOX = 2  # ggml.h: NEOX pairing (gpt-oss)
F32 = np.float32
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
    T, E = h.shape
    spans = reserve_spans(segs)
    nbytes, n_tensors, macs = _layer_cost(model, il, T, segs, spans)
    if front is not None:
        more_bytes, more_tensors, more_macs = front.cost()
        nbytes, n_tensors, macs = nbytes + more_bytes + 64 * more_tensors, n_tensors + more_tensors, macs + more_macs
    key = decode_key(("sink-attention", il, T, front.key if front is not None else None), segs, spans)

    def build(g):
        ht, h_in, fills = rows_node(runner.lib, g.ctx, T, E, front)
        pos, per_seq, res, cur, extras, _ = _layer_nodes(model, runner, g, il, ht, segs, spans, rope_base)
        return h_in, pos, per_seq, res, cur, extras, fills

    def positions(pos_in, p):
        pos_in[...] = p

    return run_layer(runner, key, nbytes, n_tensors, build, h, segs, spans, positions, macs, window, front)


def _layer_cost(model, il: int, T: int, segs, spans) -> tuple[int, int, int]:
    """(bytes, tensors, multiply-adds) of one layer's nodes (:func:`_layer_nodes`), generously."""
    E, H, Hkv, hd = model.n_embd, model.n_head, model.n_head_kv, model.head_dim
    q_w, kv_w = H * hd, Hkv * hd
    acts = (T * (8 * E + 9 * q_w + 5 * kv_w + 5) + moe_input_floats(model, il, T)
            + sum(b * n * (1 + 2 * H) + 2 * n * q_w + n * kv_w + n for b, (_, _, n) in zip(spans, segs)))
    n_tensors = 64 + 28 * len(segs)
    macs = T * E * (2 * q_w + 2 * kv_w) + sum(2 * b * n * q_w for b, (_, _, n) in zip(spans, segs))
    return 4 * acts + 64 * n_tensors, n_tensors, macs


def _layer_nodes(model, runner: GgmlRunner, g, il: int, ht, segs, spans, rope_base: float):
    """One layer's nodes on the rows ``ht`` (E, T): ``(positions view, per-sequence cache inputs,
    view of h after the attention, view of post_attention_norm(h), {"logits": view} where the
    router is ggml's, {"res" | "cur" | "logits": their nodes})``."""
    lib = runner.lib
    lt = layer_tensors(model, il, PROJ, _SINK_VECTORS)
    T, E = sum(n for _, _, n in segs), model.n_embd
    H, Hkv, hd = model.n_head, model.n_head_kv, model.head_dim
    rope_args = (model.n_rot, GGML_ROPE_TYPE_NEOX, int(model.n_ctx_orig), rope_base, model.freq_scale,
                 model.ext_factor, model.attn_factor, model.beta_fast, model.beta_slow)
    ctx, t = g.ctx, lt.t
    assert lib.mul and lib.add and lib.rms_norm and lib.reshape_3d and lib.rope_ext  # (available() was asked)
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
    nodes = {"res": res}
    cur, extras = ffn_input_nodes(model, il, runner, g, res, lt, T, nodes)
    return _i32_view(lib, pos, T), per_seq, f32_view(lib, res, (T, E)), cur, extras, nodes


def decode_step(model, runner: GgmlRunner, bank, token: int, state, counted) -> np.ndarray | None:
    """A one-sequence decode step, every layer's experts on ``bank`` (the backbone holds them), as
    ONE graph: the token's embedding row (``get_rows``), per layer its attention graph's nodes
    (:func:`_layer_nodes`), the router's choice and the layer's experts, combine and residual
    (:func:`~p2pswarm.engine.experts.ggml_bank.combine_nodes`), then the final norm and the lm head.
    Returns the logits (1, n_vocab), or None where it cannot run (the caller then runs the layers:
    a head or a router not on ggml's graph, experts not all on ``bank``, no ``ggml_custom_4d``).

    The router's top-k and softmax stay numpy's (:meth:`GptOss.route_biased`, the same function
    on the same values: the same bits), called from the graph by a Python node
    (:meth:`~p2pswarm.engine.ggml.runner.Graph.python_node`) on the router's logits plus its bias
    (``ggml_add``: numpy's float32 add): the node's value is the slots' local expert ids (I32), and
    it writes their weights (F32) into an input tensor only later nodes read. The k pairs of the
    experts' ``mul_mat_id`` are the slots in top-k order (the per-layer path sorts them by expert:
    each expert once, so each pair's output is the same dot products either way, see
    :meth:`~p2pswarm.engine.experts.ggml_bank.GgmlExpertBank.forward_groups`), so the combine takes
    slot j from pair j. Every other node is the node the per-layer graphs compute, on the same
    shapes: the same bits. ``counted(il, ids)`` gets each layer's choice after the compute (the
    dispatcher's statistics). Why: a step was four graphs with Python, the event loop's thread hop
    and an OpenMP team start between them (~1.5 ms of a 15 ms step at one thread,
    docs/benchmarks.md). The Python node takes the GIL in ggml's first thread (the event loop
    waits in ``trio.to_thread``); it runs cache-cold, ~0.13-0.2 ms a layer against ~0.02 warm.
    A prefill, several sequences, or a model whose experts are not all here keep the per-layer
    graphs."""
    lib = runner.lib
    L, E, k = model.n_layer, model.n_embd, model.n_expert_used
    memo = model.backend.ggml.decode_steps  # whether it runs with this bank, and the sizes by the caches' spans
    if memo.get("bank", (None,))[0] is not bank:
        memo.clear()
        memo["bank"] = (bank, _runs_here(model, runner, bank))
    if not memo["bank"][1] or not 0 <= token < model.n_vocab:
        return None
    W = model.w[model.output_name]
    embd = model.w["token_embd.weight"]
    norm = model.backend.ggml.f32_vector("output_norm.weight")
    embd_node = isinstance(embd, QuantisedMatrix) and embd.runner is runner
    pos0 = state.n_past
    segs = [[(state.kv[il], pos0, 1)] for il in range(L)]
    spans = [reserve_spans(s) for s in segs]
    T, P = 1, k
    out_n, in_n = W.shape
    n_head = max(T, W.min_rows)
    key = ("decode-step", id(bank), embd_node,
           tuple(decode_key(("layer", il), segs[il], spans[il]) for il in range(L)))
    cost = memo.get(("cost", *(b for b, in spans)))
    if cost is None:
        nbytes = 4 * (E + 64) + 4 * n_head * (4 * in_n + out_n) + 256
        n_tensors, macs = 16 + n_head, n_head * in_n * out_n
        for il in range(L):
            b, n, m = _layer_cost(model, il, T, segs[il], spans[il])
            _, _, _, ff, biases = bank.layer_parts(il)
            front_bytes = expert_bytes(P, E, ff, biases is not None) + 4 * (3 * k * T * E + 4 * T * E + 2 * k * T)
            nbytes += b + front_bytes + 64 * (32 + k) + 4 * (2 * P + 2 * k * T) + 1024
            n_tensors += n + 32 + k
            macs += m + P * 3 * ff * E
        cost = memo[("cost", *(b for b, in spans))] = (nbytes, n_tensors, macs)
    nbytes, n_tensors, macs = cost

    def build(g):
        ctx = g.ctx
        # this step's Python nodes' outputs (ids by layer) and errors: filled per compute of the kept graph
        step: dict = {"errors": [], "outs": [], "ids": [None] * L}
        if embd_node:
            tok = lib.new_tensor_1d(ctx, GGML_TYPE_I32, T)
            h = lib.get_rows(ctx, embd.tensor, tok)
            h_in = _i32_view(lib, tok, T)
        else:
            h = lib.new_tensor_2d(ctx, GGML_TYPE_F32, E, T)
            h_in = f32_view(lib, h, (T, E))
        # the pairs are the row's k slots in top-k order (P = k): each row 0, each slot its own
        rows = lib.new_tensor_1d(ctx, GGML_TYPE_I32, P)
        sel = lib.new_tensor_1d(ctx, GGML_TYPE_I32, k * T)
        _i32_view(lib, rows, P)[...] = 0
        _i32_view(lib, sel, k * T)[...] = np.arange(k * T)
        positions = []
        for il in range(L):
            rope_base = model.rope_base_swa if model.swa[il] else model.rope_base
            pos, per_seq, _, _, _, nodes = _layer_nodes(model, runner, g, il, h, segs[il], spans[il], rope_base)
            # the router's bias by ggml_add: numpy's float32 add, element by element
            biased = lib.add(ctx, nodes["logits"], model.backend.ggml.f32_vector(f"blk.{il}.ffn_gate_inp.bias"))

            def route(il=il, logits=f32_view(lib, biased, (T, model.n_expert))):
                """The router's top-k and softmax (numpy's) on the graph's biased logits."""
                local, weights = step["outs"][il]
                try:
                    ids, w = model.route_biased(logits)
                    local[...] = ids.reshape(-1) - bank.expert_begin
                    weights[...] = w.reshape(1, -1)
                    step["ids"][il] = ids
                except BaseException:
                    local[...], weights[...] = 0, 0  # ids the later nodes can read: the error is raised after
                    raise

            # the slots' local expert ids (I32) a Python node computes; the weights (F32) it writes
            # into an input tensor that only nodes after it read (they read its ids)
            ids = g.python_node(GGML_TYPE_I32, (1, P), [biased], route, step["errors"])
            weights = lib.new_tensor_2d(ctx, GGML_TYPE_F32, 1, k * T)
            step["outs"].append((_i32_view(lib, ids, P), f32_view(lib, weights, (1, k * T))))
            x = lib.reshape_3d(ctx, lib.get_rows(ctx, nodes["cur"], rows), E, 1, P)
            h = combine_nodes(lib, ctx, bank.layer_parts(il), nodes["res"], x, ids, sel, weights, E, T, k, P)
            positions.append((pos, per_seq))
        xt = h
        last = lib.view_2d(ctx, h, in_n, 1, 4 * in_n, 4 * in_n * (T - 1))
        for _ in range(n_head - T):  # a lone row padded with copies of itself, as QuantisedMatrix's head
            xt = lib.concat(ctx, xt, last, 1)
        out = mul_mat_rows(lib, ctx, W.tensor, lib.mul(ctx, lib.rms_norm(ctx, xt, float(model.eps)), norm),
                           in_n, n_head)
        lib.build_forward_expand(g.graph, out)
        return h_in, positions, f32_view(lib, out, (n_head, out_n)), step

    with runner.lock:
        # kept however deep the model (its layers' graphs would be kept one by one): up to half the cache
        g = runner.graph(key, nbytes, n_tensors, build, meta_tensors=L * 5 + 2, recurs=True,
                         entry_bytes=max(runner.GRAPH_ENTRY_BYTES, runner.graph_cache_bytes // 2))
        h_in, positions, logits, step = g.t
        try:
            if embd_node:
                h_in[0] = token
            else:
                h_in[...] = model.embed(np.array([token]))
            for il, (pos, per_seq) in enumerate(positions):
                pos[0] = pos0
                fill_cache_inputs(segs[il], spans[il], per_seq, model.n_swa if model.swa[il] else None)
            runner.compute(g.graph, macs)
            if step["errors"]:
                raise step["errors"][0]
            for kv in (state.kv[il] for il in range(L)):
                kv.n += 1
            for il, ids in enumerate(step["ids"]):
                counted(il, ids)
            return logits[:T].copy()
        finally:
            step["errors"].clear()
            runner.release(g)


def _runs_here(model, runner: GgmlRunner, bank) -> bool:
    """Whether :func:`decode_step` can build ``model``'s step on ``runner`` with ``bank``'s experts:
    the lm head and every router ggml's (on this runner), every expert of every layer on ``bank``
    (same libggml), no shared expert, and the ops it needs."""
    L = model.n_layer
    mats = [model.w[model.output_name], *(model.w[f"blk.{il}.ffn_gate_inp.weight"] for il in range(L))]
    return (runner.lib.has("custom_4d", "view_1d", "concat") and bank.lib is runner.lib
            and all(model.backend.ggml.f32_vector(n) is not None
                    for n in ("output_norm.weight", *(f"blk.{il}.ffn_gate_inp.bias" for il in range(L))))
            and all(isinstance(m, QuantisedMatrix) and m.runner is runner for m in mats)
            and all(bank.holds(il, e) for il in range(L) for e in (0, model.n_expert - 1))
            and not any(model.shared_expert))
