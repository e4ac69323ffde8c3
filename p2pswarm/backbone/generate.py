"""Token-by-token generation on a backbone, yielding each token with its text and dispatch stats.

Replay on ban (docs/market.md): when a worker whose unverified outputs the sequence used is banned
meanwhile, :func:`generate` rewinds it the way the scheduler does (the shared bookkeeping is
:class:`p2pswarm.backbone.replay.TokenReplay`: fresh state, the prompt and the kept tokens fed
again the way they were the first time, the sampler restarted from its initial copy) and yields a
:class:`Rewind` before the tokens that replace the withdrawn ones.
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from p2pswarm.backbone.dispatch import DispatchStats
from p2pswarm.backbone.replay import Rewind, TokenReplay
from p2pswarm.backbone.runner import Backbone
from p2pswarm.backbone.sampling import Sampler

__all__ = ["Rewind", "Step", "generate"]


@dataclass
class Step:
    index: int
    token: int
    text: str  # the text this token completes ("" mid-way through a UTF-8 character)
    seconds: float
    dispatch: DispatchStats  # what this step's forward pass dispatched
    end: bool = False  # an end-of-generation token: the last step


async def generate(backbone: Backbone, tokenizer, prompt_ids: list[int], *, max_tokens: int,
                   sampler: Sampler, stop_at_eos: bool = True) -> AsyncIterator[Step | Rewind]:
    if not prompt_ids:
        raise ValueError("empty prompt")
    disp = backbone.dispatcher
    replay = TokenReplay(sampler, len(prompt_ids))
    epoch = disp.ban_epoch
    state, feed, i = backbone.new_state(), list(prompt_ids), 0
    text = tokenizer.stream_decoder()  # never splits a UTF-8 character across two steps
    while i < max_tokens:
        t0 = time.perf_counter()
        before = disp.stats.snapshot()
        logits = await backbone.forward(feed, state)
        if disp.ban_epoch != epoch:
            epoch = disp.ban_epoch
            rewound = replay.rewind(state, disp.banned, backbone.replays, "a generation")
            if rewound is not None:
                sampler, withdrawn = rewound
                if withdrawn is not None:
                    yield withdrawn
                state, feed, i = backbone.new_state(), list(prompt_ids), 0
                text = tokenizer.stream_decoder()
                continue
        token = sampler(logits[-1])
        again, withdrawn = replay.rederive(i, token, backbone.replays, "a generation")
        if again:
            text.push(token)
            feed, i = [token], i + 1
            continue
        if withdrawn is not None:
            yield withdrawn
        end = stop_at_eos and tokenizer.is_eog(token)
        piece = text.push(token) + (text.flush() if end or i == max_tokens - 1 else "")
        replay.tokens.append(token)
        yield Step(i, token, piece, time.perf_counter() - t0, disp.stats.since(before), end)
        if end:
            break
        feed, i = [token], i + 1
