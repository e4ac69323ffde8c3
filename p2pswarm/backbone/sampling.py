"""Choosing the next token: greedy, or temperature + top-p with a seeded generator."""
from __future__ import annotations

import numpy as np


class Sampler:
    def __init__(self, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0):
        if temperature < 0 or not 0 < top_p <= 1:
            raise ValueError("temperature must be >= 0 and top_p in (0, 1]")
        self.temperature = temperature
        self.top_p = top_p
        self.rng = np.random.default_rng(seed)

    def __call__(self, logits: np.ndarray) -> int:
        if self.temperature == 0:
            return int(np.argmax(logits))
        z = logits.astype(np.float64) / self.temperature
        p = np.exp(z - z.max())
        p /= p.sum()
        order = np.argsort(-p, kind="stable")
        keep = np.searchsorted(np.cumsum(p[order]), self.top_p) + 1
        chosen = order[:keep]
        q = p[chosen] / p[chosen].sum()
        return int(self.rng.choice(chosen, p=q))
