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
    text: str  # the new text this token completes (may be "" mid-way through a UTF-8 character)
    seconds: float
    dispatch: DispatchStats  # what this step's forward pass dispatched


async def generate(backbone: Backbone, tokenizer, prompt_ids: list[int], *, max_tokens: int,
                   sampler: Sampler, stop_at_eos: bool = True) -> AsyncIterator[Step]:
    if not prompt_ids:
        raise ValueError("empty prompt")
    state = backbone.new_state()
    feed = list(prompt_ids)
    out_ids: list[int] = []
    shown = ""
    for i in range(max_tokens):
        t0 = time.perf_counter()
        before = backbone.dispatcher.stats.snapshot()
        logits = await backbone.forward(feed, state)
        token = sampler(logits[-1])
        out_ids.append(token)
        text = tokenizer.decode(out_ids)
        # Hold back a trailing replacement char: the next token may complete the UTF-8 sequence.
        stable = text[:-1] if text.endswith("\ufffd") else text
        piece = stable[len(shown):] if stable.startswith(shown) else stable
        shown = stable if stable.startswith(shown) else shown + piece
        yield Step(i, token, piece, time.perf_counter() - t0, backbone.dispatcher.stats.since(before))
        if stop_at_eos and token == getattr(tokenizer, "eos_id", None):
            break
        feed = [token]
