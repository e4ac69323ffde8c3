"""Choosing the next token: greedy, or temperature + top-p with a random number per position.

Why per position and not a stream: a seeded request must give the same text however its tokens
are computed. With speculative decoding (:mod:`p2pswarm.backbone.serving.speculation`) a step may verify
several positions at once and keep only some of them; a stream of random numbers would then be
consumed differently with speculation on and off. Here the number that decides the token at
position ``p`` is drawn from ``(seed, stream, p)`` alone (``stream`` tells a request's independent
sequences apart; 0 for one), so the token at ``p`` is a function of that position's logits and
those three numbers: the same with speculation on or off, whatever the batch, however often it is
asked (a draft is accepted exactly when it equals the token this function gives).
"""
from __future__ import annotations

import numpy as np


def position_uniform(seed: int, stream: int, position: int) -> float:
    """The uniform number in [0, 1) of ``(seed, stream, position)``: a fresh generator seeded by
    the three (numpy's SeedSequence mixes them), its first double."""
    return float(np.random.default_rng([int(seed), int(stream), int(position)]).random())


class Sampler:
    """``sampler(logits, position)`` -> token id. Greedy at temperature 0; else softmax of
    ``logits / temperature``, cut to the smallest top-p set (most probable first, ties by id), and
    the token whose cumulative probability interval holds :func:`position_uniform`. Without
    ``position`` the n-th call uses position n (callers that sample every position in order)."""

    def __init__(self, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, stream: int = 0):
        if temperature < 0 or not 0 < top_p <= 1:
            raise ValueError("temperature must be >= 0 and top_p in (0, 1]")
        self.temperature = temperature
        self.top_p = top_p
        self.seed = int(seed)
        self.stream = int(stream)
        self.calls = 0

    def __call__(self, logits: np.ndarray, position: int | None = None) -> int:
        pos = self.calls if position is None else position
        self.calls += 1
        if self.temperature == 0:
            return int(np.argmax(logits))
        z = np.asarray(logits, dtype=np.float64).reshape(-1) / self.temperature
        p = np.exp(z - z.max())
        p /= p.sum()
        order = np.argsort(-p, kind="stable")
        cdf = np.cumsum(p[order])
        keep = min(int(np.searchsorted(cdf, self.top_p)) + 1, len(order))
        u = position_uniform(self.seed, self.stream, pos) * cdf[keep - 1]
        at = min(int(np.searchsorted(cdf[:keep], u, side="right")), keep - 1)
        return int(order[at])
