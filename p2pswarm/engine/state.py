"""Per-sequence decode state: one object per sequence, so a backbone can later hold many.

Attention layers carry a KV cache (K stored after its norm and RoPE). Other architectures add their
own per-layer state (e.g. recurrent state for linear-attention layers) in ``extra``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


class KVCache:
    """Keys and values of one attention layer, grown by doubling (amortised O(1) per token)."""

    def __init__(self, n_head_kv: int, head_dim: int, capacity: int = 64):
        self.k = np.zeros((capacity, n_head_kv, head_dim), dtype=np.float32)
        self.v = np.zeros_like(self.k)
        self.n = 0

    def append(self, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Add T new positions; return views of all keys and values so far."""
        t = k.shape[0]
        if self.n + t > self.k.shape[0]:
            cap = max(self.n + t, 2 * self.k.shape[0])
            for name in ("k", "v"):
                old = getattr(self, name)
                new = np.zeros((cap, *old.shape[1:]), dtype=np.float32)
                new[: self.n] = old[: self.n]
                setattr(self, name, new)
        self.k[self.n : self.n + t] = k
        self.v[self.n : self.n + t] = v
        self.n += t
        return self.k[: self.n], self.v[: self.n]


@dataclass
class SequenceState:
    kv: dict[int, KVCache] = field(default_factory=dict)
    extra: dict[int, Any] = field(default_factory=dict)
    n_past: int = 0
    #: remote worker peer id -> the first position whose computation used that worker's unverified
    #: outputs (sampled verification checked none of them). If the worker is banned later, every
    #: position from there on is suspect; earlier ones are not (the model is causal): the
    #: scheduler rewinds the sequence to there (p2pswarm.backbone.scheduler, "Replay on ban").
    taint: dict[str, int] = field(default_factory=dict)
