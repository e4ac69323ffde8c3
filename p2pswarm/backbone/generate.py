"""Token-by-token generation on a backbone, yielding each token with its text and dispatch stats.

:func:`generate` is one request on the scheduler's path (one step per token its consumer asks
for), so it shares the scheduler's replay on ban (docs/market.md): when a worker whose unverified
outputs the sequence used is banned meanwhile, the sequence is rewound (fresh state, the prompt and
the kept tokens fed again the way they were the first time, the sampler restarted from its initial
copy) and a :class:`Rewind` comes before the tokens that replace the withdrawn ones.
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from p2pswarm.backbone.dispatch import DispatchStats
from p2pswarm.backbone.replay import Rewind
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
    drafted: int = 0  # tokens drafted in the step this token opens (speculative decoding)
    accepted: bool = False  # this token is a draft the model confirmed


async def generate(backbone: Backbone, tokenizer, prompt_ids: list[int], *, max_tokens: int,
                   sampler: Sampler, stop_at_eos: bool = True, speculate=None) -> AsyncIterator[Step | Rewind]:
    """One sequence's tokens, on the scheduler's path: a :class:`~p2pswarm.backbone.scheduler.Scheduler`
    of its own, stepped (:meth:`~p2pswarm.backbone.scheduler.Scheduler.turn`) each time the
    consumer wants more, so nothing runs ahead of it and a ban it causes between two tokens is
    replayed before the next. The prompt goes in as one chunk, as a lone sequence's would.
    ``speculate``: a :class:`~p2pswarm.backbone.speculation.Speculation` (exact: the same tokens)."""
    from p2pswarm.backbone.scheduler import Params, Scheduler  # (the scheduler imports Step from here)

    if not prompt_ids:
        raise ValueError("empty prompt")
    n = len(prompt_ids)
    scheduler = Scheduler(backbone, tokenizer, token_budget=max(n, 256), prefill_chunk=n, max_active=1,
                          micro_batches=1, gather=(0, 0), speculate=speculate)
    async with scheduler.submit(prompt_ids, Params(max_tokens=max_tokens, sampler=sampler, stop_at_eos=stop_at_eos),
                                rewinds=True) as request:
        async for item in scheduler.drive(request):
            yield item  # type: ignore[misc]  # (Rows only for Params(rows=True))
