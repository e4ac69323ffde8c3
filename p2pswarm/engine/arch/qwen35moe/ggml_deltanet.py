"""Gated DeltaNet by llama.cpp's own op, ``ggml_gated_delta_net``, for the ggml kernel.

Why ggml's op rather than numpy: it walks each (value head, sequence) state of 128 x 128 floats
once per token while it sits in the core's cache (decay, ``S^T k``, the rank-1 update, ``S^T q``),
on ggml's threads, where numpy makes a pass over all heads' memory per operation; with many
sequences decoding, that state traffic is the dense path's biggest cost. It is also exactly what
llama.cpp computes (F32 state, token by token), so our DeltaNet is llama.cpp's.

One graph per call holds one op per sequence (each on its own state, ``n_seqs = 1``): the op
splits its work by (head, sequence) and each head's arithmetic does not depend on the others, so a
sequence's bits are the same alone or beside any others (batch invariance, tested in
tests/test_batching.py). For a single token the op's result ``[o | new state]`` is placed on the
sequence's own buffer (:class:`~p2pswarm.engine.arch.qwen35moe.deltanet.DeltaNetState` keeps ``H * dv`` floats
before ``S`` for it), so the new state lands on the old one and nothing is copied: the op reads
each head's state once, into the same place (``memcpy`` of a region onto itself), before writing it,
and no other head or sequence touches that region. Longer calls (prefill) get a fresh result and
the new state is copied back once.
"""
from __future__ import annotations

import numpy as np

from p2pswarm.engine.ggml.lib import GGML_TYPE_F32, GgmlUnavailable, _InitParams
from p2pswarm.engine.ggml.runner import GgmlRunner, f32_view
from p2pswarm.engine.ggml.runner import place_tensor as _place

F32 = np.float32


def available(runner: GgmlRunner | None) -> bool:
    """Whether ``runner``'s libggml has the op (ggml 0.25's; an older library falls back to numpy)."""
    return runner is not None and runner.lib.has("gated_delta_net")


def gated_delta_net(runner: GgmlRunner, segs: list[tuple]) -> list[np.ndarray]:
    """The gated delta rule for several sequences in one ggml graph, each carrying its own state.

    ``segs``: one ``(q, k, v, g, beta, state)`` per sequence: q, k (T, Hk, d) l2-normalised, v
    (T, Hv, d), g (log-decay) and beta (T, Hv), ``state`` a DeltaNetState (updated in place). Value
    head h reads q/k head ``h mod Hk``, as the op (and :mod:`~p2pswarm.engine.arch.qwen35moe`)
    tiles them. Returns each sequence's o (T, Hv, d) float32.
    """
    lib = runner.lib
    delta_rule = lib.gated_delta_net
    if delta_rule is None:  # (callers ask available() first)
        raise GgmlUnavailable("this libggml has no ggml_gated_delta_net")
    n_in = sum(q.size + k.size + v.size + g.size + b.size for q, k, v, g, b, _ in segs)
    n_out = sum(v.size + st.S.size for _, _, v, _, _, st in segs if v.shape[0] > 1)
    n_tensors = 8 * len(segs)
    macs = sum(4 * v.size * v.shape[-1] for _, _, v, _, _, _ in segs)
    outs: list[np.ndarray] = []
    with runner.lock:
        ctx = runner.context(4 * (n_in + n_out) + 64 * n_tensors, n_tensors)
        # the tensors on the sequences' own memory: metadata only, placed with tensor_alloc
        meta = lib.init(_InitParams(n_tensors * (lib.tensor_overhead_bytes + 16) + 1024, None, True))
        if not meta:
            raise MemoryError("ggml_init failed")
        buffers, results = [], []
        try:
            graph = lib.new_graph_custom(ctx, runner.graph_size(n_tensors), False)
            for q, k, v, g, b, st in segs:
                T, Hk, d = q.shape
                Hv, dv = v.shape[1], v.shape[2]
                if d != dv or st.S.shape != (Hv, dv, d):
                    raise ValueError(f"gated_delta_net: q/k width {d}, v width {dv}, state {st.S.shape}")
                ins = []
                for a, ne in ((q, (d, Hk, T)), (k, (d, Hk, T)), (v, (dv, Hv, T)), (g, (1, Hv, T)), (b, (1, Hv, T))):
                    t = lib.new_tensor_3d(ctx, GGML_TYPE_F32, *ne)
                    f32_view(lib, t, a.shape)[...] = a
                    ins.append(t)
                buf = lib.backend_cpu_buffer_from_ptr(st.buf.ctypes.data, st.buf.nbytes)
                if not buf:
                    raise MemoryError("ggml could not wrap a DeltaNet state")
                buffers.append(buf)
                s_in = lib.new_tensor_3d(meta, GGML_TYPE_F32, d, dv, Hv)
                _place(lib, buf, s_in, st.buf.ctypes.data + 4 * st.head)
                if T == 1:
                    op = delta_rule(meta, *ins, s_in, 1)
                    _place(lib, buf, op, st.buf.ctypes.data)  # [o | new state] onto [head | S]
                else:
                    op = delta_rule(ctx, *ins, s_in, 1)
                lib.build_forward_expand(graph, op)
                results.append(op)
            runner.compute(graph, macs)
            for (_, _, v, _, _, st), op in zip(segs, results):
                T, Hv, dv = v.shape
                if T == 1:
                    outs.append(st.buf[: st.head].reshape(1, Hv, dv).copy())
                else:
                    res = f32_view(lib, op, (T * Hv * dv + st.S.size,))
                    outs.append(res[: T * Hv * dv].reshape(T, Hv, dv).copy())
                    st.S[...] = res[T * Hv * dv:].reshape(st.S.shape)
            runner.done()
        finally:
            lib.free(meta)
            for buf in buffers:
                lib.backend_buffer_free(buf)
    return outs
