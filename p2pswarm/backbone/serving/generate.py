"""One request on a scheduler of its own, stepped as its consumer asks: token-by-token generation
(:func:`generate`) and a sequence's logits at every position (:func:`sequence_logits`).

Both sit above the scheduler (they drive one) and below the commands and tests that call them, so
they share the scheduler's replay on ban (docs/market.md): when a worker whose unverified outputs
the sequence used is banned meanwhile, the sequence is rewound (fresh state, the prompt and the kept
tokens fed again the way they were the first time, the sampler restarted from its initial copy)
and a :class:`Rewind` comes before the tokens that replace the withdrawn ones (:func:`generate`), or
each position's row is computed again and replaces the old one (:func:`sequence_logits`).
"""
from __future__ import annotations

from collections.abc import AsyncIterator

import numpy as np

from p2pswarm.backbone.serving.items import Params, Rewind, Rows, Step
from p2pswarm.backbone.serving.runner import Backbone
from p2pswarm.backbone.serving.sampling import Sampler
from p2pswarm.backbone.serving.scheduler import Scheduler

__all__ = ["Rewind", "Step", "generate", "sequence_logits"]


async def generate(backbone: Backbone, tokenizer, prompt_ids: list[int], *, max_tokens: int,
                   sampler: Sampler, stop_at_eos: bool = True, speculate=None) -> AsyncIterator[Step | Rewind]:
    """One sequence's tokens, on the scheduler's path: a :class:`~p2pswarm.backbone.serving.scheduler.Scheduler`
    of its own, stepped (:meth:`~p2pswarm.backbone.serving.scheduler.Scheduler.turn`) each time the
    consumer wants more, so nothing runs ahead of it and a ban it causes between two tokens is
    replayed before the next. The prompt goes in as one chunk, as a lone sequence's would.
    ``speculate``: a :class:`~p2pswarm.backbone.serving.speculation.Speculation` (exact: the same tokens)."""
    if not prompt_ids:
        raise ValueError("empty prompt")
    n = len(prompt_ids)
    scheduler = Scheduler(backbone, tokenizer, token_budget=max(n, 256), prefill_chunk=n, max_active=1,
                          micro_batches=1, gather=(0, 0), speculate=speculate)
    async with scheduler.submit(prompt_ids, Params(max_tokens=max_tokens, sampler=sampler, stop_at_eos=stop_at_eos),
                                rewinds=True) as request:
        async for item in scheduler.drive(request):
            yield item  # type: ignore[misc]  # (Rows only for Params(rows=True))


async def sequence_logits(backbone: Backbone, tokens, *, decode: bool = False, on_step=None) -> np.ndarray:
    """All-position logits of a fresh sequence: one prefill, or token by token (``decode``).
    ``on_step(done, total)`` is called after each decode step (progress, long runs).

    On the scheduler's path: one ``Params(rows=True)`` request on a scheduler of its own (the
    prompt as one chunk, or one token per step), stepped until it ends. Replay on ban is the
    scheduler's: when a worker whose unverified outputs the sequence used is banned meanwhile
    (caught by this backbone's verification, or a ban record honoured), the sequence is fed
    again from position 0 on a fresh state the same way, and each position's new row replaces
    the old one (the same bits where it was clean), so the result equals the monolithic run's."""
    tokens = [int(t) for t in tokens]
    n = len(tokens)
    scheduler = Scheduler(backbone, None, token_budget=max(n, 256), prefill_chunk=1 if decode else max(n, 1),
                          max_active=1, micro_batches=1, gather=(0, 0), rows=True)
    out: np.ndarray | None = None
    done = 0
    async with scheduler.submit(tokens, Params(max_tokens=1, rows=True)) as request:
        async for item in scheduler.drive(request):
            if not isinstance(item, Rows):
                continue  # (the one token sampled after the last position)
            if out is None:
                out = np.empty((n, item.logits.shape[1]), item.logits.dtype)
            end = item.pos0 + len(item.logits)
            out[item.pos0:end] = item.logits
            if end > done:
                done = end
                if decode and on_step is not None:
                    on_step(done, n)
    assert out is not None and done == n
    return out
