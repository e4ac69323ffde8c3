"""Multi-head Latent Attention (DeepSeek-V2/V3, Kimi K2) and its YaRN RoPE, in numpy float32.

MLA, as llama.cpp computes it (``src/models/deepseek2.cpp``), per token ``x`` (after attn_norm)::

    q      = q_b(rms_norm(q_a x)) or q x             (H, nope + rope) per head
    c, kpe = kv_a_mqa x                              c (Rkv) the compressed KV, kpe (rope): ONE head
    c      = rms_norm(c) * kv_a_norm;  q_pe, kpe = YaRN-RoPE(q_pe), YaRN-RoPE(kpe)   (NORM pairing)
    k_h    = [k_b_h c, kpe],  v_h = v_b_h c          (k_b, v_b: attn_kv_b's two halves per head)
    out    = wo [softmax(kq_scale * q_h . k_h) v_h]_h

What is cached per position is what llama.cpp caches in its MLA form: ``c`` and ``kpe`` (Rkv +
rope floats, one "head"), not the expanded K/V (H * (nope + v)). Attention runs in the *absorbed*
form: ``q_h . k_h = (k_b_h^T q_nope_h) . c + q_pe_h . kpe`` and ``v_h-weighted sum = v_b_h (sum p c)``,
so a decode step multiplies each head's query once by k_b instead of expanding every cached
position. The math is the unabsorbed form's exactly (one reassociation, float32 rounding only),
which is why the older ``attn_kv_b`` files and the newer split ``attn_k_b``/``attn_v_b`` ones give
the same logits within float32 noise (tests/test_deepseek2.py checks both against llama.cpp).

YaRN (:class:`Yarn`) follows llama.cpp's hparams -> cparams -> graph chain: the rotation angles mix
interpolated and extrapolated frequencies across ggml's correction dims, and the attention scale
``kq_scale = mscale^2 / sqrt(nope + rope)`` carries DeepSeek's ``yarn_log_multiplier`` (the GGUF stores
0.1 times it, llama.cpp divides it out: [TAG_DEEPSEEK2_YARN_LOG_MUL_FIX]).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from p2pswarm.engine import ops
from p2pswarm.engine.state import aligned_zeros

F32 = np.float32
#: ggml's defaults (llama.cpp reads no GGUF key for them)
YARN_BETA_FAST = 32.0
YARN_BETA_SLOW = 1.0


@dataclass(frozen=True)
class Yarn:
    """The rotary parameters of one model: ``freq_scale`` 1 / ``ext_factor`` 0 is plain RoPE."""

    n_rot: int
    base: float
    freq_scale: float = 1.0
    ext_factor: float = 0.0
    attn_factor: float = 1.0  # llama.cpp's cparams.yarn_attn_factor
    n_ctx_orig: int = 4096
    log_mul: float = 0.0  # hparams.rope_yarn_log_mul (already divided by 0.1)

    @classmethod
    def from_hparams(cls, hp, n_rot: int, n_ctx_train: int) -> "Yarn":
        """From a layout's ``hparam(key, default)``, as llama.cpp's loader and context set it up, in
        float32 arithmetic as there (the attention scale's last bit moves the softmax's)."""
        f32, log = np.float32, _logf
        one, tenth = f32(1.0), f32(0.1)
        base = float(hp("rope.freq_base", 10000.0))
        kind = str(hp("rope.scaling.type", "linear"))
        factor = f32(hp("rope.scaling.factor", 0.0) or 0.0)
        freq_scale = one if factor == 0 or kind == "none" else one / factor
        n_ctx_orig = int(hp("rope.scaling.original_context_length", n_ctx_train) or n_ctx_train)
        log_mul = f32(hp("rope.scaling.yarn_log_multiplier", 0.0)) / tenth
        ext = 1.0 if kind == "yarn" else 0.0
        attn = one
        if ext != 0.0:
            f = one / freq_scale

            def get_mscale(scale, m):
                return one if scale <= one else tenth * m * log(scale) + one

            # deepseek2: mscale = mscale_all_dim (when not 1), so the ratio is 1; else get_mscale(f, 1)
            attn = get_mscale(f, log_mul) / get_mscale(f, log_mul) if log_mul != 0 else get_mscale(f, one)
            attn = attn * (one / (one + tenth * log(f)))
        attn = attn * f32(hp("rope.scaling.attn_factor", 1.0))
        return cls(n_rot, base, float(freq_scale), ext, float(attn), n_ctx_orig, float(log_mul))

    def kq_scale(self, head_k: int) -> float:
        """The attention scale of deepseek2's graph: YaRN's magnitude correction, squared (float32)."""
        f32, one, tenth = np.float32, np.float32(1.0), np.float32(0.1)
        inv = one / f32(self.freq_scale)
        org = f32(self.attn_factor) * (one + tenth * _logf(inv))
        mscale = org * (one + tenth * f32(self.log_mul) * _logf(inv))
        return float(one * mscale * mscale / np.sqrt(f32(head_k)))

    def _corr_dims(self) -> tuple[float, float]:
        def dim(beta: float) -> float:
            return self.n_rot * math.log(self.n_ctx_orig / (beta * 2 * math.pi)) / (2 * math.log(self.base))

        return max(0.0, math.floor(dim(YARN_BETA_FAST))), min(self.n_rot - 1.0, math.ceil(dim(YARN_BETA_SLOW)))

    def cos_sin(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """cos and sin (T, n_rot/2) float32 of every pair at every position, magnitude-scaled."""
        half = self.n_rot // 2
        i = np.arange(half, dtype=np.float64)
        extrap = positions.astype(np.float64)[:, None] * np.power(self.base, -2.0 * i / self.n_rot)[None, :]
        theta = self.freq_scale * extrap
        mscale = self.attn_factor
        if self.ext_factor != 0.0:
            low, high = self._corr_dims()
            ramp = 1.0 - np.clip((i - low) / max(0.001, high - low), 0.0, 1.0)
            mix = ramp * self.ext_factor
            theta = theta * (1 - mix) + extrap * mix
            mscale *= 1.0 + 0.1 * math.log(1.0 / self.freq_scale)
        return (np.cos(theta) * mscale).astype(F32), (np.sin(theta) * mscale).astype(F32)

    def rope_norm(self, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """ggml's NORM-mode RoPE (pairs ``(2i, 2i+1)``) on all of ``x`` (T, H, n_rot)."""
        cos, sin = self.cos_sin(positions)
        cos, sin = cos[:, None, :], sin[:, None, :]
        x0, x1 = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x, dtype=F32)
        out[..., 0::2] = x0 * cos - x1 * sin
        out[..., 1::2] = x0 * sin + x1 * cos
        return out


def _logf(x) -> np.float32:
    """C's ``logf``: the float32 log of a float32."""
    return np.log(np.float32(x))


class LatentCache:
    """One sequence's MLA cache of one layer: the normed compressed KV ``c`` (S, Rkv) and the roped
    key part ``kpe`` (S, rope) of every position, side by side in one (S, Rkv + rope) array (the
    row llama.cpp's MLA cache holds), grown by doubling. The rows sit on aligned memory, as
    :class:`~p2pswarm.engine.state.KVCache`'s do: the ggml kernel's one-graph MLA layer
    (:func:`~p2pswarm.engine.arch.deepseek2.ggml_mla.mla_layer`) wraps them in place, writes a step's rows into
    them and attends over them, with no copy."""

    def __init__(self, width: int, capacity: int = 64):
        self.rows = aligned_zeros((capacity, width))
        self.n = 0

    def reserve(self, t: int) -> None:
        """Room for ``t`` more positions (a new, larger buffer if needed; the old rows are kept)."""
        if self.n + t > self.rows.shape[0]:
            grown = aligned_zeros((max(self.n + t, 2 * self.rows.shape[0]), self.rows.shape[1]))
            grown[: self.n] = self.rows[: self.n]
            self.rows = grown

    def append(self, rows: np.ndarray) -> np.ndarray:
        t = rows.shape[0]
        self.reserve(t)
        self.rows[self.n : self.n + t] = rows
        self.n += t
        return self.rows[: self.n]

    def checkpoint(self) -> int:
        """The position count: rows are only appended after it (speculative decoding's rollback)."""
        return self.n

    def restore(self, snap: int) -> None:
        self.n = snap


def latent_attention(q_abs: np.ndarray, cache: np.ndarray, n_lat: int, kq_scale: float, q_pos0: int) -> np.ndarray:
    """Causal MLA in the absorbed form for one sequence, up to the latent: ``sum_s p_hts c_s``.

    ``q_abs`` (T, H, Rkv + rope): each head's ``[k_b^T q_nope, q_pe]``; ``cache`` (S, Rkv + rope):
    ``[c, kpe]`` of positions 0..S-1. Returns (H, T, Rkv); the caller applies each head's v_b."""
    T, H, _ = q_abs.shape
    S = cache.shape[0]
    qh = np.ascontiguousarray(q_abs.transpose(1, 0, 2))  # (H, T, Rkv + rope)
    scores = (qh @ cache.T) * F32(kq_scale)  # (H, T, S)
    if q_pos0 + T < S or T > 1:
        qpos = q_pos0 + np.arange(T)
        scores = np.where((np.arange(S)[None, :] > qpos[:, None])[None], F32(-np.inf), scores)
    probs = ops.softmax(scores, axis=-1)
    return probs @ cache[:, :n_lat]  # (H, T, Rkv)
