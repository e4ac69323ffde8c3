"""Token-by-token generation on a backbone, yielding each token with its text and dispatch stats.

Replay on ban (docs/market.md): when a worker whose unverified outputs the sequence used is banned
meanwhile, :func:`generate` rewinds it like the scheduler does (fresh state, the prompt and the kept
tokens fed again the way they were the first time, the sampler restarted from its initial copy)
and yields a :class:`Rewind` before the tokens that replace the withdrawn ones.
"""
from __future__ import annotations

import copy
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from p2pswarm.backbone.dispatch import DispatchStats
from p2pswarm.backbone.runner import Backbone, banned_taint, tokens_kept
from p2pswarm.backbone.sampling import Sampler


@dataclass
class Step:
    index: int
    token: int
    text: str  # the text this token completes ("" mid-way through a UTF-8 character)
    seconds: float
    dispatch: DispatchStats  # what this step's forward pass dispatched
    end: bool = False  # an end-of-generation token: the last step


@dataclass(frozen=True)
class Rewind:
    """The tokens from index ``keep`` on (of the ``sent`` a consumer has) were computed with
    outputs of ``worker``, since banned: they are withdrawn, and the steps that follow, from index
    ``keep``, replace them (replay on ban)."""

    keep: int
    sent: int
    worker: str


async def generate(backbone: Backbone, tokenizer, prompt_ids: list[int], *, max_tokens: int,
                   sampler: Sampler, stop_at_eos: bool = True) -> AsyncIterator[Step | Rewind]:
    if not prompt_ids:
        raise ValueError("empty prompt")
    disp = backbone.dispatcher
    sampler0 = copy.deepcopy(sampler)  # a replay restarts the sampler from here
    tokens: list[int] = []  # yielded so far
    forced, peer, epoch = 0, "", disp.ban_epoch  # replaying: tokens[:forced] are derived again, not yielded
    state, feed, i = backbone.new_state(), list(prompt_ids), 0
    text = tokenizer.stream_decoder()  # never splits a UTF-8 character across two steps
    while i < max_tokens:
        t0 = time.perf_counter()
        before = disp.stats.snapshot()
        logits = await backbone.forward(feed, state)
        if disp.ban_epoch != epoch:
            epoch = disp.ban_epoch
            hit = banned_taint(state, disp.banned)
            if hit is not None:
                pos, peer = hit
                forced = tokens_kept(pos, len(prompt_ids), len(tokens))
                backbone.replays.note("a generation", pos, peer, rows=len(prompt_ids) + forced, kept=forced,
                                      sent=len(tokens))
                if len(tokens) > forced:
                    yield Rewind(forced, len(tokens), peer)
                del tokens[forced:]
                state, feed, i = backbone.new_state(), list(prompt_ids), 0
                sampler, text = copy.deepcopy(sampler0), tokenizer.stream_decoder()
                continue
        token = sampler(logits[-1])
        if i < forced:
            if token == tokens[i]:
                text.push(token)
                feed, i = [token], i + 1
                continue
            yield Rewind(i, len(tokens), peer)  # the kept tokens were not the clean run's: never, honestly
            del tokens[i:]
            forced = i
        end = stop_at_eos and tokenizer.is_eog(token)
        piece = text.push(token) + (text.flush() if end or i == max_tokens - 1 else "")
        tokens.append(token)
        yield Step(i, token, piece, time.perf_counter() - t0, disp.stats.since(before), end)
        if end:
            break
        feed, i = [token], i + 1
