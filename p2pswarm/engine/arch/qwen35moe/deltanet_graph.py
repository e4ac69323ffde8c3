"""Whole layers of the dense path as ONE ggml graph each, for the ggml kernel.

Why: a qwen35moe Gated DeltaNet layer computed piece by piece was 3 ggml graphs (the fused input
projections, the delta rule, the output projection) with numpy between them (norms, conv, silu,
l2-norm, gates, gated RMSNorm) on one core while ggml's other threads waited, each graph waking
the thread team and ending in barriers. Here the whole ``pre_moe_batch`` of such a layer,
for every sequence of a batch, is one graph and one ``compute``: llama.cpp's own ops in llama.cpp's
order (``src/models/qwen35moe.cpp``), so the numerics are llama.cpp's too.

Per sequence the graph reads and writes that sequence's own state memory in place, nothing copied
through numpy (the technique of :mod:`p2pswarm.engine.arch.qwen35moe.ggml_deltanet`): its conv rows
(``DeltaNetState.conv``) and its recurrent state (``DeltaNetState.buf``) are wrapped as CPU buffers
and tensors are placed on them. Every op that mixes positions (conv, delta rule) runs per
sequence; every other op works row by row, so a sequence's rows get the same bits alone or beside
any others wherever the mat-muls are row-invariant (libggml's Q8_0; the backbone measures it,
:func:`p2pswarm.backbone.serving.runner.probe_dense_invariance`).

The weights are ggml tensors on the memory map of the GGUF, made once per layer and kept: the
quantised matrices are the :class:`~p2pswarm.engine.ggml.dense.QuantisedMatrix` tensors, the rest
(F32 norms, conv kernel, ``ssm_a``, ``ssm_dt``; F32/F16 matrices of an unquantised file) mapped
the same way. Where the library lacks an op (an older libggml) or a tensor cannot be mapped,
:func:`deltanet_layer_weights` says None and the caller keeps its per-piece numpy path.
"""
from __future__ import annotations

import numpy as np

from p2pswarm.engine.ggml.attention import moe_input_floats, moe_inputs
from p2pswarm.engine.ggml.dense import QuantisedMatrix, mul_mat_rows, split_cost
from p2pswarm.engine.experts.ggml_bank import rows_node
from p2pswarm.engine.ggml.lib import GGML_TYPE_F32
from p2pswarm.engine.ggml.runner import f32_view
from p2pswarm.engine.state import aligned_zeros
from p2pswarm.errors import ModelFormatError

F32 = np.float32

#: the ops of the DeltaNet layer graph; all of ggml >= 0.25 (``_OPTIONAL_SIG`` in ggml/lib.py)
DELTANET_OPS = ("rms_norm", "mul", "mul_inplace", "add_inplace", "sigmoid_inplace", "silu_inplace", "softplus_inplace",
                "scale_inplace", "concat", "transpose", "ssm_conv", "cpy", "view_2d", "view_4d", "reshape_2d", "reshape_3d",
                "gated_delta_net")
_MATRICES = ("attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha", "ssm_out")
_VECTORS = ("attn_norm", "ssm_norm", "ssm_a", "ssm_dt", "post_attention_norm")


class DeltaNetLayerWeights:
    """The ggml tensors of one DeltaNet layer (keys: the names in ``_MATRICES``, ``_VECTORS`` and
    ``ssm_conv1d``), all views of the model file's memory map."""

    def __init__(self, tensors: dict):
        self.t = tensors


def _file_name(short: str) -> str:
    return {"ssm_a": "ssm_a", "ssm_dt": "ssm_dt.bias"}.get(short, short + ".weight")


def deltanet_layer_weights(model, il: int) -> DeltaNetLayerWeights | None:
    """Layer ``il``'s tensors as ggml tensors, made on first use and kept on the model's
    :class:`~p2pswarm.engine.ggml.dense.GgmlDense`; None where the one-graph layer cannot run
    (no ggml dense path, an op missing from the library, a tensor type ggml cannot map)."""
    dense = model.backend.ggml
    if dense is None:
        return None
    cache = dense.deltanet_layers
    if il in cache:
        return cache[il]
    lib = dense.lib
    with dense.runner.lock:  # mapping is not thread-safe; layers of pipelined steps may race here
        if il in cache:
            return cache[il]
        got = None
        if lib.has(*DELTANET_OPS):
            try:
                got = _map_layer(model, dense, il, QuantisedMatrix)
            except ModelFormatError:  # e.g. a tensor type the ggml kernel does not take
                got = None
        cache[il] = got
    return got


def _map_layer(model, dense, il: int, quantised_cls) -> DeltaNetLayerWeights:
    p = f"blk.{il}."
    by_name = model.w._by_name
    loaded = model.w.loaded()
    tensors = {}
    for short in (*_MATRICES, *_VECTORS, "ssm_conv1d"):
        name = p + _file_name(short)
        m = loaded.get(name)
        if isinstance(m, quantised_cls) and m.runner is dense.runner:
            tensors[short] = m.tensor
            continue
        t = by_name[name]
        ne = [int(d) for d in t.shape.tolist()]
        gtype = int(t.tensor_type)
        if short in _VECTORS or short == "ssm_conv1d":
            if gtype != GGML_TYPE_F32:  # the norms, conv kernel and gates are F32 in every GGUF seen
                raise ModelFormatError(f"{name}: type {gtype}, the layer graph takes F32")
            if short in _VECTORS:
                ne = [int(np.prod(ne)), 1]
        if len(ne) != 2:
            raise ModelFormatError(f"{name}: {len(ne)} dims")
        tensors[short] = dense._mapped.tensor(gtype, ne[0], ne[1], int(t.data_offset), name)
    return DeltaNetLayerWeights(tensors)


def _runs(segs: list[tuple]) -> list[tuple[int, int, list]]:
    """Consecutive segments of one length, as ``(first row, n, states)``: a run's conv, silu and
    l2-norms are one op each over all its sequences (ggml's ``n_seqs`` axis), not one per sequence."""
    runs: list[tuple[int, int, list]] = []
    at = 0
    for st, n in segs:
        if runs and runs[-1][1] == n:
            runs[-1][2].append(st)
        else:
            runs.append((at, n, [st]))
        at += n
    return runs


def deltanet_pre_moe(model, il: int, lw: DeltaNetLayerWeights, h: np.ndarray,
                     segs: list[tuple], stepped: dict[int, list] | None = None,
                     front=None) -> tuple[np.ndarray, np.ndarray, dict]:
    """``h + DeltaNet(attn_norm(h))`` for the rows of every ``(DeltaNetState, n)`` segment, in one
    graph, each sequence's conv rows and state updated in place; and ``post_attention_norm`` of
    that (the experts' and the router's input), as the attention layer's graph ends too, with
    what it feeds besides the routed experts (:func:`moe_inputs`: router logits, shared expert).

    The graph, as llama.cpp builds it (shapes in ggml's order, T rows in all)::

        x     = rms_norm(h) * attn_norm                                   [E, T]
        m, z  = W_qkv x, W_gate x                                          [C, T], [Hv dv, T]
        beta  = sigmoid(W_beta x);  g = softplus(W_alpha x + dt) * ssm_a   [Hv, T]
        per run of sequences of n rows each (a decode step: one run):
            X  = [conv^T | m_seq^T] per sequence   its K-1 carried inputs, then its n  [K-1+n, C, S]
            conv <- last K-1 columns of its X      written onto DeltaNetState.conv
            c  = silu(ssm_conv(X, conv1d))                                   [C, n, S]
            q, k = l2(c[:Hk d]), l2(c[Hk d:2 Hk d]);  v = c[2 Hk d:]
            per sequence: o_seq, S = gated_delta_net(q, k, v, g_seq, beta_seq, S)   S in place
        y     = rms_norm(o) * ssm_norm * silu(z)          per head           [dv, Hv, T]
        out   = h + W_out y                                                  [E, T]
        cur   = rms_norm(out) * post_attention_norm                          [E, T]

    Why runs: every non-view node of a graph ends in a barrier of all threads (an OpenMP barrier,
    ~10 us passive on an idle core, a timeslice when the other core is busy), so per-sequence
    nodes are kept to the four that must be (gather its conv rows, write them back, its delta
    rule, place its output among the others). The l2-norm is llama.cpp's
    (``build_gdn_l2_norm``: ``rms_norm(x, eps/d) / sqrt(d)``), not ``ggml_l2_norm``: the same
    function to float rounding, and the one llama.cpp computes. In-place ops wherever an
    intermediate has one reader keep the scratch of a 128-token prefill under the runner's
    ``KEEP_BYTES`` (a context above it is reallocated, page faults and all, every call).

    ``stepped``: segment index -> an empty list, for the segments whose ``n`` rows are successive
    one-token *decode* positions of their sequence (a speculative verification's chunk): their
    delta rule runs as ``n`` one-token ``gated_delta_net`` nodes chained through state buffers of
    their own, each exactly the node a one-token decode step runs (the projections, conv, norms
    and gates are row-wise: each position's column is computed alone, as in a decode step). Each
    list gets, per position but the last, the layer's state after it as
    :meth:`~p2pswarm.engine.arch.qwen35moe.deltanet.DeltaNetState.checkpoint` gives it (``(buf, conv)``), so the
    positions after it can be dropped (speculative decoding's rollback).

    ``front``: layer ``il - 1``'s experts and residual computed in front of the layer, in the same
    graph (:class:`~p2pswarm.engine.experts.ggml_bank.ExpertsInFront`; ``h`` is then ``front.h``).
    """
    stepped = stepped or {}
    dense = model.backend.ggml
    r = dense.runner
    lib = r.lib
    t = lw.t
    T, E = h.shape
    C, K = model.conv_channels, model.ssm_kernel
    d, Hk, Hv, dv = model.ssm_d, model.ssm_hk, model.ssm_hv, model.ssm_dv
    eps = float(model.eps)
    S = len(segs)
    runs = _runs(segs)
    n_tensors = 64 + 24 * S + 32 * len(runs)  # generous: running out aborts the process (GGML_ASSERT)
    # data of every tensor that owns memory (views, reshapes and in-place results own none), in floats
    floats = T * (5 * E + C + 4 * Hv * dv + 2 * Hv) + sum(
        len(sts) * ((K - 1 + n) * C + n * C + 2 * n * Hk * d + (n * Hv * dv + Hv * dv * d if n > 1 else 0))
        for _, n, sts in runs)
    macs = T * E * (C + 2 * Hv * dv + 2 * Hv) + 4 * T * Hv * dv * d
    split_tensors = 0
    for out_n in (C, Hv * dv, E):  # the qkv, gate and output projections (mul_mat_rows)
        more_floats, more_tensors = split_cost(out_n, T)
        floats, split_tensors = floats + more_floats, split_tensors + more_tensors
    n_tensors += split_tensors
    # kept for the next step when it is a decode step (one row per sequence: the same shape every
    # step); the key names each sequence's state memory, which the graph's tensors are placed on
    key = (("deltanet", il, T, tuple((st.conv.ctypes.data, st.conv.nbytes, st.buf.ctypes.data, st.buf.nbytes,
                                      st.head) for st, _ in segs), front.key if front is not None else None)
           + (split_tensors,) if all(n == 1 for _, n in segs) else None)  # a kept graph split or not
    if front is not None:
        more_bytes, more_tensors, more_macs = front.cost()
        floats, n_tensors, macs = floats + more_bytes // 4, n_tensors + more_tensors, macs + more_macs
    # a stepped segment's states after each position but the last (fresh memory: never kept)
    snaps = {j: [aligned_zeros(segs[j][0].buf.shape) for _ in range(segs[j][1] - 1)] for j in stepped}
    n_tensors += 12 * sum(segs[j][1] for j in stepped)
    floats += T * Hv * dv if stepped else 0  # o_all
    first_seg = {}
    for j, (at, n, sts) in enumerate(runs):  # segment index of each run's first sequence
        first_seg[j] = sum(len(r[2]) for r in runs[:j])

    def build(g):
        ctx = g.ctx
        graph = g.graph

        def expand(node):
            lib.build_forward_expand(graph, node)

        hin, h_rows, fills = rows_node(lib, ctx, T, E, front)
        x = lib.mul_inplace(ctx, lib.rms_norm(ctx, hin, eps), t["attn_norm"])
        m = mul_mat_rows(lib, ctx, t["attn_qkv"], x, E, T)  # [C, T]
        z = mul_mat_rows(lib, ctx, t["attn_gate"], x, E, T)  # [Hv dv, T]
        beta = lib.sigmoid_inplace(ctx, lib.mul_mat(ctx, t["ssm_beta"], x))  # [Hv, T]
        alpha = lib.add_inplace(ctx, lib.mul_mat(ctx, t["ssm_alpha"], x), t["ssm_dt"])
        gt = lib.mul_inplace(ctx, lib.softplus_inplace(ctx, alpha), t["ssm_a"])  # [Hv, T]; ssm_a = -exp(A_log)
        o_all = lib.new_tensor_3d(ctx, GGML_TYPE_F32, dv, Hv, T) if S > 1 or stepped else None
        o = None
        xs: list = []  # (stepped segment, its run's X, its index in the run, n): its conv rows' checkpoints
        for ri, (at, n, sts) in enumerate(runs):
            ns = len(sts)
            xb1, xb2 = 4 * (K - 1 + n), 4 * (K - 1 + n) * C
            convs = []
            for st in sts:
                conv = lib.new_tensor_2d(g.meta, GGML_TYPE_F32, C, K - 1)  # numpy (K-1, C)
                g.place(g.wrap(st.conv), conv, st.conv.ctypes.data)
                convs.append(conv)
            m_run = lib.view_3d(ctx, m, C, n, ns, 4 * C, 4 * C * n, 4 * C * at)
            if ns == 1:
                X = lib.concat(ctx, lib.transpose(ctx, convs[0]), lib.transpose(ctx, m_run), 0)
            else:  # each sequence's carried rows into its slice of X, then all new rows at once
                X = lib.new_tensor_3d(ctx, GGML_TYPE_F32, K - 1 + n, C, ns)
                for j, conv in enumerate(convs):
                    expand(lib.cpy(ctx, lib.transpose(ctx, conv), lib.view_2d(ctx, X, K - 1, C, xb1, j * xb2)))
                expand(lib.cpy(ctx, lib.transpose(ctx, m_run),
                               lib.view_3d(ctx, X, n, C, ns, xb1, xb2, 4 * (K - 1))))
            for j, conv in enumerate(convs):  # its last K-1 inputs become its conv rows
                rows = lib.view_2d(ctx, X, K - 1, C, xb1, j * xb2 + 4 * n)
                expand(lib.cpy(ctx, lib.transpose(ctx, rows), conv))
            c = lib.silu_inplace(ctx, lib.ssm_conv(ctx, X, t["ssm_conv1d"]))  # [C, n, ns]
            # q and k heads side by side in c: one l2-norm over all 2 Hk of them
            qk = _l2(lib, ctx, lib.view_4d(ctx, c, d, 2 * Hk, n, ns, 4 * d, 4 * C, 4 * C * n, 0), d, eps)
            for j, st in enumerate(sts):
                row = at + j * n
                seg = first_seg[ri] + j
                if seg in stepped:
                    xs.append((seg, X, j, n, len(sts)))
                    _stepped_rule(g, qk, c, gt, beta, st, snaps[seg], o_all, row, j, n, (d, Hk, Hv, dv, C))
                    continue
                q_j = lib.view_3d(ctx, qk, d, Hk, n, 4 * d, 8 * d * Hk, 8 * d * Hk * n * j)
                k_j = lib.view_3d(ctx, qk, d, Hk, n, 4 * d, 8 * d * Hk, 8 * d * Hk * n * j + 4 * d * Hk)
                v_j = lib.view_3d(ctx, c, dv, Hv, n, 4 * dv, 4 * C, 4 * C * n * j + 8 * Hk * d)
                g_j = lib.view_3d(ctx, gt, 1, Hv, n, 4, 4 * Hv, 4 * Hv * row)
                b_j = lib.view_3d(ctx, beta, 1, Hv, n, 4, 4 * Hv, 4 * Hv * row)
                sbuf = g.wrap(st.buf)
                s_in = lib.new_tensor_3d(g.meta, GGML_TYPE_F32, d, dv, Hv)
                g.place(sbuf, s_in, st.buf.ctypes.data + 4 * st.head)
                if n == 1:  # [o | new state] straight onto [head | S]: the state in place
                    res = lib.gated_delta_net(g.meta, q_j, k_j, v_j, g_j, b_j, s_in, 1)
                    g.place(sbuf, res, st.buf.ctypes.data)
                    expand(res)
                else:  # prefill: the result's state part copied onto S inside the graph
                    res = lib.gated_delta_net(ctx, q_j, k_j, v_j, g_j, b_j, s_in, 1)
                    expand(lib.cpy(ctx, lib.view_2d(ctx, res, Hv * dv, dv, 4 * Hv * dv, 4 * n * Hv * dv), s_in))
                o_j = lib.view_3d(ctx, res, dv, Hv, n, 4 * dv, 4 * Hv * dv, 0)
                if o_all is None:
                    o = o_j
                else:  # the rows of all sequences side by side for the row-wise rest
                    dst = lib.view_3d(ctx, o_all, dv, Hv, n, 4 * dv, 4 * Hv * dv, 4 * Hv * dv * row)
                    expand(lib.cpy(ctx, o_j, dst))
        o = o_all if o_all is not None else o
        # silu(z) * (rms_norm(o) * w) as one swiglu node (ggml's silu, and a product either way round)
        y = lib.swiglu_split(ctx, lib.reshape_3d(ctx, z, dv, Hv, T),
                             lib.mul_inplace(ctx, lib.rms_norm(ctx, o, eps), t["ssm_norm"]))
        out = lib.add_inplace(ctx, mul_mat_rows(lib, ctx, t["ssm_out"], lib.reshape_2d(ctx, y, Hv * dv, T), Hv * dv, T), hin)
        expand(out)
        cur = lib.mul(ctx, lib.rms_norm(ctx, out, eps), t["post_attention_norm"])
        expand(cur)
        extras = moe_inputs(model, il, r, ctx, graph, cur, T)
        x_views = [(seg, f32_view(lib, X, (ns, C, K - 1 + n)), j, n) for seg, X, j, n, ns in xs]
        return h_rows, f32_view(lib, out, (T, E)), f32_view(lib, cur, (T, E)), extras, x_views, fills

    floats += moe_input_floats(model, il, T)
    n_tensors += 24
    with r.lock:
        g = r.graph(key, 4 * floats + 64 * n_tensors, n_tensors, build, meta_tensors=4 * S + 2 * sum(segs[j][1] for j in stepped), recurs=True)
        try:
            h_in, h_out, h_cur, extras, x_views, fills = g.t
            if front is None:
                h_in[...] = h
            else:
                front.fill(fills)
            r.compute(g.graph, macs)
            out_h, cur_h = h_out.copy(), h_cur.copy()
            more = {k: v.copy() for k, v in extras.items()}
            for seg, xv, j, n in x_views:  # conv rows after position i: the K-1 inputs ending at it
                x_seq = xv[j]  # (C, K-1+n): the carried rows, then the n new ones
                stepped[seg].extend((snaps[seg][i], np.ascontiguousarray(x_seq[:, i + 1:i + K].T))
                                    for i in range(n - 1))
        finally:
            r.release(g)
    return out_h, cur_h, more


def _stepped_rule(g, qk, c, gt, beta, st, snaps: list, o_all, row: int, j: int, n: int, dims) -> None:
    """The delta rule of a stepped segment (:func:`deltanet_pre_moe`): its ``n`` positions as ``n``
    one-token ``gated_delta_net`` nodes, each the decode step's node: position ``i`` reads the
    state position ``i - 1`` wrote (the sequence's own for ``i = 0``) and writes ``[o | new
    state]`` onto ``snaps[i]`` (onto the sequence's own buffer for the last), its ``o`` copied
    into its row of ``o_all``. Nodes run in the order they are added, so each reads its
    predecessor's state."""
    lib, ctx = g.lib, g.ctx
    d, Hk, Hv, dv, C = dims
    bufs = [*snaps, st.buf]
    wrapped = [g.wrap(b) for b in bufs]
    for i in range(n):
        q_i = lib.view_3d(ctx, qk, d, Hk, 1, 4 * d, 8 * d * Hk, 8 * d * Hk * (n * j + i))
        k_i = lib.view_3d(ctx, qk, d, Hk, 1, 4 * d, 8 * d * Hk, 8 * d * Hk * (n * j + i) + 4 * d * Hk)
        v_i = lib.view_3d(ctx, c, dv, Hv, 1, 4 * dv, 4 * C, 4 * C * (n * j + i) + 8 * Hk * d)
        g_i = lib.view_3d(ctx, gt, 1, Hv, 1, 4, 4 * Hv, 4 * Hv * (row + i))
        b_i = lib.view_3d(ctx, beta, 1, Hv, 1, 4, 4 * Hv, 4 * Hv * (row + i))
        src = -1 if i == 0 else i - 1  # the sequence's own state first, then the previous position's
        s_in = lib.new_tensor_3d(g.meta, GGML_TYPE_F32, d, dv, Hv)
        g.place(wrapped[src], s_in, bufs[src].ctypes.data + 4 * st.head)
        res = lib.gated_delta_net(g.meta, q_i, k_i, v_i, g_i, b_i, s_in, 1)
        g.place(wrapped[i], res, bufs[i].ctypes.data)
        lib.build_forward_expand(g.graph, res)
        dst = lib.view_3d(ctx, o_all, dv, Hv, 1, 4 * dv, 4 * Hv * dv, 4 * Hv * dv * (row + i))
        lib.build_forward_expand(g.graph, lib.cpy(ctx, lib.view_3d(ctx, res, dv, Hv, 1, 4 * dv, 4 * Hv * dv, 0), dst))


def _l2(lib, ctx, x, n: int, eps: float):
    """llama.cpp's l2-norm of Gated DeltaNet's q and k (``build_gdn_l2_norm``)."""
    return lib.scale_inplace(ctx, lib.rms_norm(ctx, x, eps / n), 1.0 / float(np.sqrt(np.float32(n))))


def placeable(st) -> bool:
    """Whether a DeltaNetState's memory can carry ggml tensors: aligned C-contiguous float32
    (``ggml_backend_cpu_buffer_from_ptr`` aborts the process on a misaligned pointer)."""
    return all(a.dtype == F32 and a.flags.c_contiguous and a.ctypes.data % 32 == 0 for a in (st.conv, st.buf))
