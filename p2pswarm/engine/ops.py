"""The numeric building blocks, float32 throughout, written to follow llama.cpp's CPU kernels.

Every function is pure numpy on float32 arrays (no I/O, no network). Where llama.cpp accumulates
in double (RMSNorm's sum of squares) we do too, so our F32 logits sit within ~1e-5 of llama.cpp's.
Shapes are numpy's: a weight W is (out, in), activations are (tokens, features).
"""
from __future__ import annotations

import threading

import numpy as np

F32 = np.float32


#: the most float64 scratch one thread keeps for :func:`rms_norm`'s squares (a 2,048 x 4,096 step)
_SQUARES_MAX = 8 << 20
_squares = threading.local()


def _squares_of(x: np.ndarray) -> np.ndarray:
    """x^2 in float64, into a buffer this thread keeps (a larger ``x``: a fresh array).

    Why: a fresh T x n_embd float64 array per call is new pages to the process each time
    (malloc hands a large block back on free), and on these VMs the first touch of a page costs
    ~10x writing mapped memory: ~4% of a 0.3-core backbone's CPU with workers went to it. The
    squares and their mean are the same numbers in the same layout, so the same bits."""
    n = x.size
    if n > _SQUARES_MAX or not x.flags.c_contiguous:  # (another layout: numpy's own, in its order)
        return np.square(x, dtype=np.float64)
    buf = getattr(_squares, "buf", None)
    if buf is None or buf.size < n:
        buf = _squares.buf = np.empty(max(n, 1 << 16), np.float64)
    out = buf[:n].reshape(x.shape)
    return np.square(x, out=out, dtype=np.float64)


def rms_norm(x: np.ndarray, weight: np.ndarray | None, eps: float) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) * weight over the last axis (sum of squares in float64).

    The float64 squares go to a per-thread buffer (:func:`_squares_of`) and the weight multiplies
    in place where that is the same operation (same dtype, same shape out): the same products in
    the same order as ``x * s * weight``, with one fresh array instead of three."""
    ms = np.mean(_squares_of(x), axis=-1, keepdims=True).astype(F32)
    y = x * (F32(1.0) / np.sqrt(ms + F32(eps)))
    if weight is None:
        return y
    if y.dtype == F32 and weight.dtype == F32 and np.broadcast_shapes(y.shape, weight.shape) == y.shape:
        return np.multiply(y, weight, out=y)
    return y * weight


def silu(x: np.ndarray) -> np.ndarray:
    return x / (F32(1.0) + np.exp(-x))


def sigmoid(x: np.ndarray) -> np.ndarray:
    return F32(1.0) / (F32(1.0) + np.exp(-x))


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """exp(x - max) / sum over ``axis``; the array methods and an in-place divide give the same
    bits as ``np.max`` / ``np.sum`` and a new quotient, ~4 us a call sooner (it runs per sequence
    and attention layer on the backbone)."""
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    e /= e.sum(axis=axis, keepdims=True)
    return e


def matmul(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x (T, in) @ W^T with W (out, in): the one mat-mul every layer uses."""
    return x @ w.T


def matmuls(x: np.ndarray, ws: list) -> list[np.ndarray]:
    """``[matmul(x, W) for W in ws]``, with the weights ggml holds in the memory map multiplied in
    one ggml graph (:func:`~p2pswarm.engine.ggml.dense.fused_matmuls`; same bits as one by one)."""
    from p2pswarm.engine.ggml.dense import QuantisedMatrix, fused_matmuls  # optional kernel

    out: list = [None] * len(ws)
    by_runner: dict[int, list[int]] = {}
    for i, w in enumerate(ws):
        if isinstance(w, QuantisedMatrix):
            by_runner.setdefault(id(w.runner), []).append(i)
    for idx in by_runner.values():
        got = fused_matmuls(x, [ws[i] for i in idx])
        if got is not None:
            for i, y in zip(idx, got):
                out[i] = y
    return [matmul(x, w) if y is None else y for w, y in zip(ws, out)]


def _rotate_neox(x: np.ndarray, theta: np.ndarray, n_rot: int) -> np.ndarray:
    """Rotate NEOX pairs (i, i + n_rot/2) of each head by angles theta (T, n_rot/2); dims >= n_rot
    pass through. Shared by plain NEOX RoPE and IMROPE, which differ only in their angles."""
    return rotate_neox_cs(x, np.cos(theta).astype(F32)[:, None, :], np.sin(theta).astype(F32)[:, None, :], n_rot)


def rotate_neox_cs(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, n_rot: int) -> np.ndarray:
    """x (T, heads, head_dim) with NEOX pairs (i, i + n_rot/2) turned by float32 (cos, sin) of shape
    (T, 1, n_rot/2); dims >= n_rot pass through. Apart from the angles so that tables made once
    (gpt-oss's YaRN tables, shared by q, k and a step's layers) turn several tensors."""
    half = n_rot // 2
    x0 = x[..., :half]
    x1 = x[..., half:n_rot]
    out = x.copy()
    out[..., :half] = x0 * cos - x1 * sin
    out[..., half:n_rot] = x0 * sin + x1 * cos
    return out


def rope_neox(x: np.ndarray, positions: np.ndarray, n_rot: int, base: float) -> np.ndarray:
    """NEOX-style rotary embedding on the first ``n_rot`` dims of each head.

    x: (T, H, hd); pairs are (i, i + n_rot/2). Dims >= n_rot pass through unrotated.
    """
    half = n_rot // 2
    inv = np.power(np.float64(base), -2.0 * np.arange(half, dtype=np.float64) / n_rot)
    theta = positions.astype(np.float64)[:, None] * inv[None, :]  # (T, half)
    return _rotate_neox(x, theta, n_rot)


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos0: int) -> np.ndarray:
    """Causal grouped-query attention.

    q: (T, H, hd) for positions q_pos0..q_pos0+T-1; k, v: (S, Hkv, hd) for positions 0..S-1.
    Query head j reads KV head j // (H / Hkv). Returns (T, H, hd).

    The query heads that share a KV head are one matrix (their rows stacked), multiplied by that
    head's keys and values as they lie in the cache (strided views, no copy): no repeat of the cache
    per query head, and no mask where every key is visible (a decode row). Why: this runs once per
    sequence per attention layer on the backbone; the form with ``np.repeat`` and an explicit
    mask took 44 us (5 cached positions) to 2 ms (1,000) per decode row, this one 19-140 us
    (docs/benchmarks.md, "ops.attention without np.repeat").
    """
    T, H, _ = q.shape
    S, Hkv, _ = k.shape
    scores = gqa_scores(q, k)
    if q_pos0 + T < S or T > 1:  # some key lies after some query's position
        qpos = q_pos0 + np.tile(np.arange(T), H // Hkv)
        scores = np.where((np.arange(S)[None, :] > qpos[:, None])[None], F32(-np.inf), scores)
    return gqa_values(softmax(scores, axis=-1), v, T)


def gqa_scores(q: np.ndarray, k: np.ndarray) -> np.ndarray:
    """``q . k / sqrt(hd)`` of GQA, q (T, H, hd), k (S, Hkv, hd): (Hkv, group * T, S), the query
    heads that share a KV head stacked as one matrix, rows (head in group, t)."""
    T, H, hd = q.shape
    Hkv = k.shape[1]
    group = H // Hkv
    qh = q.reshape(T, Hkv, group, hd).transpose(1, 2, 0, 3).reshape(Hkv, group * T, hd)
    return (qh @ k.transpose(1, 2, 0)) * F32(1.0 / np.sqrt(hd))


def gqa_values(probs: np.ndarray, v: np.ndarray, T: int) -> np.ndarray:
    """The attention weights ``probs`` (Hkv, group * T, S) of :func:`gqa_scores`' layout times the
    values v (S, Hkv, hd): (T, H, hd)."""
    Hkv, rows, _ = probs.shape
    hd = v.shape[2]
    out = probs @ v.transpose(1, 0, 2)  # (Hkv, group * T, hd)
    return out.reshape(Hkv, rows // T, T, hd).transpose(2, 0, 1, 3).reshape(T, rows // T * Hkv, hd)


def route_topk(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Router: softmax over all experts -> top-k by probability (descending) -> renormalise.

    Returns (ids (T, k) int64, weights (T, k) float32). Ties keep the lower expert id first.
    The renormalising sum is clamped below at 2^-14 as llama.cpp does.
    """
    probs = softmax(logits.astype(F32, copy=False), axis=-1)
    order = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    sel = np.take_along_axis(probs, order, axis=-1)
    # summed in float64 and rounded once, as ggml's sum_rows does (llama.cpp's build_moe_ffn)
    total = np.maximum(np.sum(sel, axis=-1, keepdims=True, dtype=np.float64).astype(F32), F32(6.103515625e-5))
    return order.astype(np.int64), (sel / total).astype(F32)


def swiglu_expert(x: np.ndarray, w_gate: np.ndarray, w_up: np.ndarray, w_down: np.ndarray) -> np.ndarray:
    """down(silu(gate x) * (up x)) for rows x (n, E): the whole work of one expert.

    Weights ggml holds in the memory map run as one ggml graph with ggml's SwiGLU (llama.cpp's
    numerics, as the routed experts already are); float32 arrays are multiplied here."""
    if type(w_gate).__name__ == "QuantisedMatrix":
        from p2pswarm.engine.ggml.dense import fused_swiglu  # optional kernel

        got = fused_swiglu(x, w_gate, w_up, w_down)
        if got is not None:
            return got
    return matmul(silu(matmul(x, w_gate)) * matmul(x, w_up), w_down)


def imrope_positions(positions: np.ndarray, n_rot: int, sections) -> np.ndarray:
    """The position each rotary pair of an IMROPE head turns by: (T,) or (T, 4) -> (T, n_rot/2).

    IMROPE (the interleaved multi-axis RoPE of Qwen3-VL / Qwen3.5) gives every pair i one of four
    position streams (t, h, w, e) by llama.cpp's section rule: with ``sector = i mod sum(sections)``,
    pair i takes h if ``sector % 3 == 1 and sector < 3*s1``, w if ``sector % 3 == 2 and sector < 3*s2``,
    t if ``sector % 3 == 0 and sector < 3*s0``, else e. Text tokens are at (p, p, p, 0), so with
    sections that cover every pair this is plain NEOX rope, and any pair that falls to e is *not*
    rotated; which pairs those are is why the rule must be followed exactly.
    """
    s = [int(v) for v in sections]
    if len(s) != 4 or min(s) < 0 or sum(s) <= 0:
        raise ValueError(f"rope sections must be 4 non-negative ints with a positive sum, got {sections!r}")
    pos = np.asarray(positions)
    if pos.ndim == 1:  # text: t = h = w = p, e = 0
        pos = np.stack([pos, pos, pos, np.zeros_like(pos)], axis=1)
    sector = np.arange(n_rot // 2) % sum(s)
    stream = np.full(sector.shape, 3)
    stream[(sector % 3 == 0) & (sector < 3 * s[0])] = 0
    stream[(sector % 3 == 2) & (sector < 3 * s[2])] = 2
    stream[(sector % 3 == 1) & (sector < 3 * s[1])] = 1
    return pos[:, stream]


def rope_imrope(x: np.ndarray, positions: np.ndarray, n_rot: int, base: float, sections) -> np.ndarray:
    """IMROPE on the first ``n_rot`` dims of each head, NEOX pairing (i, i + n_rot/2).

    x: (T, H, hd); positions (T,) for text or (T, 4) as (t, h, w, e). Dims >= n_rot pass through
    unrotated. Angles are computed as in :func:`rope_neox` (float64, then float32 cos/sin), so with
    covering sections the two give identical bits.
    """
    half = n_rot // 2
    pp = imrope_positions(positions, n_rot, sections)  # (T, half)
    inv = np.power(np.float64(base), -2.0 * np.arange(half, dtype=np.float64) / n_rot)
    theta = pp.astype(np.float64) * inv[None, :]
    return _rotate_neox(x, theta, n_rot)
