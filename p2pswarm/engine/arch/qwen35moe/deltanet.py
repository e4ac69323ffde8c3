"""Gated DeltaNet, the linear-attention half of qwen35moe (Qwen3.5), in numpy.

A linear-attention layer keeps, per value head, a d_k x d_v matrix S instead of a KV cache. Per
token t (``g_t <= 0`` a log-decay, ``beta_t`` in (0, 1), ``q_t``/``k_t`` l2-normalised)::

    S     <- e^{g_t} S
    delta  = beta_t (v_t - S^T k_t)          # the delta rule: correct what S predicts for k_t
    S     <- S + k_t delta^T
    o_t    = S^T q_t / sqrt(d_k)

Two forms compute it:

* :func:`delta_rule_recurrent`, token by token: what decode needs (one token, carried S).
* :func:`delta_rule_chunked`, 64 tokens at a time (the WY form llama.cpp also uses): within a chunk
  the corrections ``Delta`` solve one unit-lower-triangular system
  ``(I + A) Delta = beta (V - diag(e^G) K S0)`` with ``A[t, s] = beta_t e^{G_t - G_s} k_t.k_s``
  (s < t, G the cumulative log-decay), and outputs and the next S are a few mat-muls. Same result,
  a fraction of the Python-level work for a long prefill.

Both run in float64 inside and return float32; the two forms then agree to ~1e-13 before the
final rounding, so which one ran is invisible in the float32 output.

The carried state is float32, stored as llama.cpp stores it (its ``ggml_gated_delta_net`` op and
recurrent-state cache are F32): per value head the transpose ``M = S^T`` (dv x dk, row j = column
j of S), so :class:`DeltaNetState` can hand its memory to that op unchanged
(:mod:`p2pswarm.engine.arch.qwen35moe.ggml_deltanet`, which the ggml kernel uses for every call). Why float32: a
float64 S was 8 MiB per sequence per layer at the 122B's geometry (288 MiB per sequence over its
36 DeltaNet layers) for precision llama.cpp does not keep either; the F32 logits tests against
llama.cpp hold with it (tests/test_qwen35moe.py).

The other pieces of the layer live here too because nothing else uses them: the causal depthwise
conv with its carried K-1 rows, softplus, the l2-norm and the gated RMSNorm, each written the way
ggml's CPU kernels compute them.
"""
from __future__ import annotations

import threading

from typing import cast

import numpy as np

from p2pswarm.engine.ops import rms_norm, silu

F32 = np.float32
F64 = np.float64
CHUNK = 64


def softplus(x: np.ndarray) -> np.ndarray:
    """log(1 + e^x), and x itself above 20 (ggml's cut-over: there the two agree in float32)."""
    x = np.asarray(x, dtype=F32)
    return np.where(x > F32(20.0), x, np.log(F32(1.0) + np.exp(np.minimum(x, F32(20.0))))).astype(F32)


def l2_norm(x: np.ndarray, eps: float) -> np.ndarray:
    """x / max(||x||, eps) over the last axis, as ggml_l2_norm does (eps floors the norm; it is not
    added under the root). Squares in float32, summed in float64, one float32 reciprocal."""
    ss = np.sum(np.square(x, dtype=F32), axis=-1, keepdims=True, dtype=F64)
    scale = F32(1.0) / np.maximum(np.sqrt(ss).astype(F32), F32(eps))
    return x * scale


def gated_rms_norm(o: np.ndarray, weight: np.ndarray, z: np.ndarray, eps: float) -> np.ndarray:
    """rms(o, weight) * silu(z) over the last axis (per head): the DeltaNet output norm."""
    return rms_norm(o, weight, eps) * silu(z)


def causal_conv1d(m: np.ndarray, conv_state: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Causal depthwise conv over time, no bias; returns (conv output (T, C), new conv state).

    m: (T, C) this call's inputs; conv_state: (K-1, C) the inputs before them (zeros at the start
    of a sequence); w: (C, K), w[:, K-1] weighs the current token. ``X = [conv_state; m]`` and
    ``out[t] = sum_i X[t + i] * w[:, i]``, summed in i order as ggml_ssm_conv does. The new state is
    the last K-1 rows of X, so a sequence fed in pieces sees exactly what one prefill sees.
    """
    K = w.shape[1]
    T = m.shape[0]
    X = np.concatenate([conv_state.astype(F32, copy=False), m.astype(F32, copy=False)], axis=0)
    out = X[0:T] * w[:, 0]
    for i in range(1, K):
        out = out + X[i : i + T] * w[:, i]
    return out, np.ascontiguousarray(X[X.shape[0] - (K - 1):])


def delta_rule_recurrent(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
                         S: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The gated delta rule token by token.

    q, k: (T, H, dk) (l2-normalised, already one per value head); v: (T, H, dv); g, beta: (T, H);
    S: (H, dk, dv), the state before the first token. Returns (o (T, H, dv) float32, S float64).
    """
    q, k, v, g, beta = (np.asarray(a, dtype=F64) for a in (q, k, v, g, beta))
    S = np.array(S, dtype=F64, copy=True)
    T, H, dk = q.shape
    scale = 1.0 / np.sqrt(dk)
    out = np.empty((T, H, v.shape[-1]), dtype=F64)
    decay = np.exp(g)
    for t in range(T):
        S *= decay[t][:, None, None]
        pred = np.einsum("hk,hkv->hv", k[t], S)  # S^T k
        delta = beta[t][:, None] * (v[t] - pred)
        S += k[t][:, :, None] * delta[:, None, :]
        out[t] = np.einsum("hk,hkv->hv", q[t], S) * scale
    return out.astype(F32), S


def delta_rule_step_inplace(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
                            M: np.ndarray) -> np.ndarray:
    """One token of the gated delta rule in float32, updating the state in place: numpy's decode
    step (the ggml kernel runs llama.cpp's op instead).

    ``M`` (H, dv, dk) float32 is the state in llama.cpp's layout (``M[h] = S[h]^T``). With
    ``d = e^g``, one batched mat-mul reads M once for both projections::

        [S^T k, S^T q] = M_old [k, q]
        delta = beta (v - d S_old^T k)
        o     = (d S_old^T q + (k . q) delta) / sqrt(dk)   # = S_new^T q
        M     = d M_old + delta k^T                        # in place

    The same math as :func:`delta_rule_recurrent`, rounded to float32 at each step (as llama.cpp's
    op is). q, k: (1, H, dk); v: (1, H, dv); g, beta: (1, H). Returns o (1, H, dv) float32.
    """
    if M.dtype != F32 or not M.flags.c_contiguous:
        raise ValueError("the state must be a C-contiguous float32 array (H, dv, dk)")
    q0, k0, v0 = (np.asarray(a[0], dtype=F32) for a in (q, k, v))
    g0, b0 = np.asarray(g[0], dtype=F32), np.asarray(beta[0], dtype=F32)
    dk = q0.shape[-1]
    d = np.exp(g0)  # (H,)
    kq = np.stack([k0, q0], axis=2)  # (H, dk, 2)
    proj = np.matmul(M, kq)  # (H, dv, 2): S^T k and S^T q
    delta = b0[:, None] * (v0 - d[:, None] * proj[:, :, 0])
    kdotq = cast(np.ndarray, np.sum(k0 * q0, axis=-1, dtype=F32))  # (H,): a 2-D sum's rows
    o = (d[:, None] * proj[:, :, 1] + kdotq[:, None] * delta) * F32(1.0 / np.sqrt(dk))
    outer = _scratch(M.shape)
    np.einsum("hv,hk->hvk", delta, k0, out=outer)  # delta k^T, into reused memory (no page faults)
    M *= d[:, None, None]
    M += outer
    return o[None].astype(F32, copy=False)


_tls = threading.local()


def _scratch(shape: tuple[int, ...]) -> np.ndarray:
    """A float32 buffer of ``shape`` reused by this thread: a fresh 4 MB temporary per token costs
    more in page faults than the arithmetic it holds."""
    buf = getattr(_tls, "buf", None)
    if buf is None or buf.shape != shape:
        buf = _tls.buf = np.empty(shape, dtype=F32)
    return buf


def delta_rule_chunked(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
                       S: np.ndarray, chunk: int = CHUNK) -> tuple[np.ndarray, np.ndarray]:
    """The gated delta rule a chunk at a time; same arguments and results as the recurrent form.

    Per chunk of L tokens (all heads at once), with G the inclusive cumulative sum of g in the
    chunk, D[t, s] = e^{G_t - G_s} for s <= t (else 0), S0 the state at the chunk's start::

        A     = strictly_lower(beta[:, None] * (K K^T) * D)
        Delta = (I + A)^{-1} (beta[:, None] * (V - e^{G}[:, None] * (K S0)))
        O     = (e^{G}[:, None] * (Q S0) + (lower(Q K^T) * D) Delta) / sqrt(dk)
        S     = e^{G_L} S0 + K^T (e^{G_L - G}[:, None] * Delta)

    Every exponent is <= 0 (g <= 0 and s <= t), so nothing overflows however long the chunk.
    """
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    q, k, v, g, beta = (np.asarray(a, dtype=F64) for a in (q, k, v, g, beta))
    S = np.array(S, dtype=F64, copy=True)
    T, H, dk = q.shape
    dv = v.shape[-1]
    scale = 1.0 / np.sqrt(dk)
    out = np.empty((T, H, dv), dtype=F64)
    for c0 in range(0, T, chunk):
        c1 = min(T, c0 + chunk)
        L = c1 - c0
        qc = q[c0:c1].transpose(1, 0, 2)  # (H, L, dk)
        kc = k[c0:c1].transpose(1, 0, 2)
        vc = v[c0:c1].transpose(1, 0, 2)  # (H, L, dv)
        bc = beta[c0:c1].T  # (H, L)
        G = np.cumsum(g[c0:c1].T, axis=1)  # (H, L)
        lower = np.tril(np.ones((L, L), dtype=bool))
        diff = np.where(lower, G[:, :, None] - G[:, None, :], -np.inf)
        D = np.exp(diff)  # (H, L, L), zero above the diagonal
        eG = np.exp(G)[:, :, None]
        A = bc[:, :, None] * (kc @ kc.transpose(0, 2, 1)) * D
        A[:, np.arange(L), np.arange(L)] = 0.0
        rhs = bc[:, :, None] * (vc - eG * (kc @ S))
        delta = np.linalg.solve(np.eye(L) + A, rhs)  # (H, L, dv)
        o = eG * (qc @ S) + ((qc @ kc.transpose(0, 2, 1)) * D) @ delta
        out[c0:c1] = (o * scale).transpose(1, 0, 2)
        tail = np.exp(G[:, -1:] - G)[:, :, None]  # (H, L, 1)
        S = np.exp(G[:, -1])[:, None, None] * S + kc.transpose(0, 2, 1) @ (tail * delta)
    return out.astype(F32), S


def delta_rule(q, k, v, g, beta, S, *, mode: str = "auto"):
    """Pick the form: ``auto`` is recurrent for a single token (decode) and chunked otherwise."""
    if mode == "recurrent" or (mode == "auto" and q.shape[0] == 1):
        return delta_rule_recurrent(q, k, v, g, beta, S)
    if mode in ("auto", "chunked"):
        return delta_rule_chunked(q, k, v, g, beta, S)
    raise ValueError(f"unknown DeltaNet mode {mode!r} (auto, chunked or recurrent)")


ALIGN = 64  # bytes; ggml wants tensor memory aligned to 32 (TENSOR_ALIGNMENT), a cache line is 64


def _aligned_zeros(shape: tuple[int, ...]) -> np.ndarray:
    """A zeroed C-contiguous float32 array whose data starts on an ``ALIGN``-byte boundary (what
    ``ggml_backend_cpu_buffer_from_ptr`` asserts; numpy alone guarantees 16)."""
    n = int(np.prod(shape))
    raw = np.zeros(n * 4 + ALIGN, dtype=np.uint8)
    skip = (-raw.ctypes.data) % ALIGN
    return raw[skip:skip + n * 4].view(F32).reshape(shape)


class DeltaNetState:
    """What one linear-attention layer carries between calls for one sequence.

    ``S`` (H, dv, dk) float32 is the recurrent state in llama.cpp's layout (``S[h] = state_h^T``),
    ``conv`` the last K-1 conv inputs. ``S`` is the tail of one aligned buffer whose head holds
    ``H * dv`` floats more: the shape of ``ggml_gated_delta_net``'s result for one token
    (``[o | new state]``), so a decode step of the ggml kernel writes its new state over the old
    one in place, with no copy (:mod:`p2pswarm.engine.arch.qwen35moe.ggml_deltanet`). ``conv`` is aligned too and
    only ever written in place (never rebound), so the ggml kernel's one-graph layer
    (:mod:`p2pswarm.engine.arch.qwen35moe.deltanet_graph`) can read the old rows from it and write the new ones onto
    it inside its graph."""

    __slots__ = ("S", "conv", "buf", "head")

    def __init__(self, conv_channels: int, kernel: int, n_v_heads: int, dk: int, dv: int):
        self.conv = _aligned_zeros(((kernel - 1), conv_channels))
        self.head = n_v_heads * dv
        self.buf = _aligned_zeros((self.head + n_v_heads * dv * dk,))
        self.S = self.buf[self.head:].reshape(n_v_heads, dv, dk)

    def checkpoint(self) -> tuple[np.ndarray, np.ndarray]:
        """Copies of the recurrent state and the conv rows (speculative decoding's rollback)."""
        return self.buf.copy(), self.conv.copy()

    def restore(self, snap: tuple[np.ndarray, np.ndarray]) -> None:
        """Back to a :meth:`checkpoint`, written in place (ggml graphs hold this memory)."""
        np.copyto(self.buf, snap[0])
        np.copyto(self.conv, snap[1])

    def set_state(self, S: np.ndarray) -> None:
        """Replace the state with ``S`` in the math's layout (H, dk, dv), any float dtype."""
        np.copyto(self.S, np.asarray(S).transpose(0, 2, 1), casting="same_kind")

    def state(self) -> np.ndarray:
        """The state in the math's layout (H, dk, dv), as a float32 view."""
        return self.S.transpose(0, 2, 1)
