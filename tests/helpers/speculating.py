"""What the speculative-decoding tests share (test_speculation.py, test_mtp.py): the prompts and
a scheduler run that collects each sequence's tokens and every emitted position's logits, and
costs that make every sequence draft its cap (FreeDrafts)."""
from __future__ import annotations

from p2pswarm.backbone.serving.scheduler import Params, Rows, Scheduler
from p2pswarm.backbone.serving.speculation import Costs

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


class FreeDrafts(Costs):
    """Costs that say drafts and verified rows are free, so every sequence drafts its cap each step:
    the tests of exactness under concurrency need full, partial and rejected drafts in every step,
    whatever this machine's timings would choose (the choice itself: the choose_lengths tests)."""

    def __init__(self):
        super().__init__()
        self.draft_s = 0.0

    def observe_draft(self, seconds, tokens):
        """Measured drafts are not recorded: drafts stay free, whatever they took."""

    def observe_step(self, seconds, rows):
        """Measured steps are not recorded: a verified row stays free (``row_s`` 0)."""

    @property
    def row_s(self):
        return 0.0

    def step_s(self, rows):
        return 1.0
