"""Per-sequence decode state: one object per sequence, so a backbone can later hold many.

Attention layers carry a KV cache (K stored after its norm and RoPE). Other architectures add their
own per-layer state (e.g. recurrent state for linear-attention layers) in ``extra``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


class KVCache:
    """Keys and values of one attention layer, grown by doubling (amortised O(1) per token).

    Keys are ``k`` (capacity, Hkv, hd); values are stored transposed, ``vt`` (Hkv, hd, capacity),
    with ``v`` the (capacity, Hkv, hd) view of them. Both sit on 64-byte aligned memory: ggml wraps
    them in place (``ggml_backend_cpu_buffer_from_ptr`` wants 32), so the ggml kernel's attention
    graph (:mod:`p2pswarm.engine.ggml.attention`) writes a step's new keys and values straight into
    the cache and reads the whole cache from there, with no copy either way. Values transposed are
    what ``V^T @ softmax(K q)`` multiplies (one row per value dimension, positions contiguous), as
    llama.cpp keeps them without flash attention; numpy's attention reads the view."""

    def __init__(self, n_head_kv: int, head_dim: int, capacity: int = 64):
        self.k = aligned_zeros((capacity, n_head_kv, head_dim))
        self.vt = aligned_zeros((n_head_kv, head_dim, capacity))
        self.n = 0

    @property
    def v(self) -> np.ndarray:
        """The values as (capacity, Hkv, hd): a view of ``vt``."""
        return self.vt.transpose(2, 0, 1)

    def reserve(self, t: int) -> None:
        """Room for ``t`` more positions (a new, larger buffer if needed; the old rows are kept)."""
        if self.n + t > self.k.shape[0]:
            cap = max(self.n + t, 2 * self.k.shape[0])
            k = aligned_zeros((cap, *self.k.shape[1:]))
            k[: self.n] = self.k[: self.n]
            vt = aligned_zeros((*self.vt.shape[:2], cap))
            vt[..., : self.n] = self.vt[..., : self.n]
            self.k, self.vt = k, vt

    def append(self, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Add T new positions; return views of all keys and values so far, (n, Hkv, hd) each."""
        t = k.shape[0]
        self.reserve(t)
        self.k[self.n : self.n + t] = k
        self.vt[..., self.n : self.n + t] = np.asarray(v).transpose(1, 2, 0)
        self.n += t
        return self.k[: self.n], self.v[: self.n]

    def checkpoint(self):
        """What :meth:`restore` needs to return to this point (speculative decoding's rollback):
        the position count alone, since positions are only ever appended after it."""
        return self.n

    def restore(self, snap) -> None:
        """Back to :meth:`checkpoint`'s point: later rows are dropped (and written over later)."""
        self.n = snap


ALIGN = 64  # bytes: ggml's TENSOR_ALIGNMENT is 32, a cache line 64


def aligned_zeros(shape: tuple[int, ...]) -> np.ndarray:
    """float32 zeros whose first byte is ALIGN-aligned (a view into a slightly larger buffer)."""
    n = int(np.prod(shape))
    raw = np.zeros(4 * n + ALIGN, dtype=np.uint8)
    skip = (-raw.ctypes.data) % ALIGN
    return raw[skip:skip + 4 * n].view(np.float32).reshape(shape)


@dataclass
class SequenceState:
    kv: dict[int, KVCache] = field(default_factory=dict)
    extra: dict[int, Any] = field(default_factory=dict)
    n_past: int = 0
    #: remote worker peer id -> the first position whose computation used that worker's unverified
    #: outputs (sampled verification checked none of them). If the worker is banned later, every
    #: position from there on is suspect; earlier ones are not (the model is causal): the
    #: scheduler rewinds the sequence to there (p2pswarm.backbone.serving.scheduler, "Replay on ban").
    taint: dict[str, int] = field(default_factory=dict)
    #: after a verification step (speculative decoding): layer -> one checkpoint of that layer's
    #: state after each verified position, so that the positions not accepted can be dropped
    #: (:meth:`p2pswarm.backbone.serving.runner.Backbone.keep_positions`); empty otherwise
    checkpoints: dict[int, list] = field(default_factory=dict)
    verified: int = 0  # positions the last verification step fed (their checkpoints above)
    #: ``--speculate mtp`` only: the trunk's hidden states the MTP block has not read yet
    #: (:class:`p2pswarm.backbone.serving.mtp.HiddenRows`) and the block's own state (``MtpState``)
    hidden: Any = None
    mtp: Any = None

    def layer_state(self, il: int):
        """Layer ``il``'s own state object (a KV cache, a DeltaNet state, a latent cache)."""
        got = self.kv.get(il)
        return got if got is not None else self.extra.get(il)
