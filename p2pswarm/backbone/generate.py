"""Token-by-token generation on a backbone, yielding each token with its text and dispatch stats."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from p2pswarm.backbone.dispatch import DispatchStats
from p2pswarm.backbone.runner import Backbone
from p2pswarm.backbone.sampling import Sampler


@dataclass
class Step:
    index: int
    token: int
    text: str  # the text this token completes ("" mid-way through a UTF-8 character)
    seconds: float
    dispatch: DispatchStats  # what this step's forward pass dispatched
    end: bool = False  # an end-of-generation token: the last step


async def generate(backbone: Backbone, tokenizer, prompt_ids: list[int], *, max_tokens: int,
                   sampler: Sampler, stop_at_eos: bool = True) -> AsyncIterator[Step]:
    if not prompt_ids:
        raise ValueError("empty prompt")
    state = backbone.new_state()
    feed = list(prompt_ids)
    text = tokenizer.stream_decoder()  # never splits a UTF-8 character across two steps
    for i in range(max_tokens):
        t0 = time.perf_counter()
        before = backbone.dispatcher.stats.snapshot()
        logits = await backbone.forward(feed, state)
        token = sampler(logits[-1])
        end = stop_at_eos and tokenizer.is_eog(token)
        piece = text.push(token) + (text.flush() if end or i == max_tokens - 1 else "")
        yield Step(i, token, piece, time.perf_counter() - t0, backbone.dispatcher.stats.since(before), end)
        if end:
            break
        feed = [token]
