"""What the speculative-decoding tests share (test_speculation.py, test_mtp.py): the prompts and
a scheduler run that collects each sequence's tokens and every emitted position's logits."""
from __future__ import annotations

from p2pswarm.backbone.serving.scheduler import Params, Rows, Scheduler

PROMPT = [5, 211, 37, 90, 14, 14, 14, 302, 8, 66, 19, 180]  # 12 + 5: gpt-oss's window of 8 trims mid-verification
REPEATING = [5, 211, 37, 90, 14, 5, 211, 37, 90, 14, 5, 211, 37]


async def run_spec(bb, prompts, samplers, speculate, max_tokens):
    sched = Scheduler(bb, None, micro_batches=1, gather=(0, 0), rows=True, speculate=speculate)
    out = []
    for prompt, sampler in zip(prompts, samplers):
        toks, rows = [], {}
        async with sched.submit(prompt, Params(max_tokens=max_tokens, sampler=sampler, stop_at_eos=False,
                                                rows=True)) as req:
            async for item in sched.drive(req):
                if isinstance(item, Rows):
                    for i, r in enumerate(item.logits):
                        rows[item.pos0 + i] = r
                else:
                    toks.append(item.token)
        out.append((toks, rows))
    return out, sched.spec
