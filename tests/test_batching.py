"""Continuous batching: the batched step is exact (swarm == monolithic, bit for bit, for mixed
prefill + decode), batch-invariant when asked, and the scheduler batches, cancels and refuses."""
from __future__ import annotations

import numpy as np
import pytest
import trio

from p2pswarm.backbone.sampling import Sampler
from p2pswarm.backbone.scheduler import Params, Scheduler
from p2pswarm.backbone.session import open_backbone

# (sequence, tokens) per step: prefill chunks of different lengths mixed with decode rows, sequences
# joining late and one leaving early
SCHEDULE = [
    [(0, [17, 3, 250, 99, 4, 4, 301]), (1, [12, 77, 5])],
    [(0, [160]), (1, [42, 8, 200, 31, 64]), (2, [9, 120, 2, 88])],
    [(0, [270]), (1, [15]), (2, [6]), (3, [190, 11, 23, 47, 51, 302, 13, 7, 91])],
    [(1, [33]), (2, [400]), (3, [1])],
    [(0, [2]), (2, [8]), (3, [77, 78])],
]


async def _run_schedule(backbone, invariant: bool) -> list[list[np.ndarray]]:
    states = {}
    out: list[list[np.ndarray]] = []
    for step in SCHEDULE:
        items = [(toks, states.setdefault(s, backbone.new_state())) for s, toks in step]
        out.append(await backbone.forward_batch(items, batch_invariant=invariant))
    return out


async def _alone(backbone) -> dict[tuple[int, int], np.ndarray]:
    """Each sequence of SCHEDULE on its own, fed the same chunks: (step, sequence) -> logits."""
    res = {}
    for seq in range(4):
        state = backbone.new_state()
        for i, step in enumerate(SCHEDULE):
            for s, toks in step:
                if s == seq:
                    res[(i, s)] = (await backbone.forward_batch([(toks, state)], batch_invariant=True))[0]
    return res


@pytest.mark.parametrize("transport", ["inproc", "socket"])
async def test_batched_swarm_equals_batched_monolithic(tiny_q8, transport):
    async with open_backbone(tiny_q8, workers=0) as mono:
        want = {inv: await _run_schedule(mono.backbone, inv) for inv in (False, True)}
        alone = await _alone(mono.backbone)
    async with open_backbone(tiny_q8, workers=3, transport=transport) as swarm:
        before = swarm.backbone.dispatcher.stats.snapshot()
        got = {inv: await _run_schedule(swarm.backbone, inv) for inv in (False, True)}
        stats = swarm.backbone.dispatcher.stats.since(before)
    # one request per owner per layer, whatever the number of sequences in the step
    assert stats.layers == 2 * len(SCHEDULE) * swarm.backbone.model.n_layer
    assert 0 < stats.requests <= 3 * stats.layers and stats.local_groups == 0 and stats.fallbacks == 0
    for inv in (False, True):
        for a, b in zip(want[inv], got[inv]):
            assert len(a) == len(b)
            for x, y in zip(a, b):
                assert x.shape == y.shape and np.array_equal(x, y), f"batch_invariant={inv}"
    # batch-invariant: every sequence's logits are exactly what it gets alone
    for i, step in enumerate(SCHEDULE):
        for (s, _), x in zip(step, want[True][i]):
            assert np.array_equal(x, alone[(i, s)]), (i, s)
    # the same step with the other mode is the same computation up to rounding (a sanity check)
    for a, b in zip(want[False], want[True]):
        for x, y in zip(a, b):
            assert np.allclose(x, y, atol=2e-2 * max(1.0, float(np.abs(y).max())))


async def test_forward_batch_equals_forward_for_one_sequence(tiny_f32):
    async with open_backbone(tiny_f32, workers=0) as mono:
        bb = mono.backbone
        tokens = [17, 3, 250, 99, 4]
        a = await bb.forward(tokens, bb.new_state())
        b = (await bb.forward_batch([(tokens, bb.new_state())]))[0]
        assert np.array_equal(a, b)
        with pytest.raises(ValueError, match="twice"):
            st = bb.new_state()
            await bb.forward_batch([([1], st), ([2], st)])


async def _collect(scheduler, prompt, max_tokens=6, sampler=None):
    async with scheduler.submit(prompt, Params(max_tokens=max_tokens, sampler=sampler)) as req:
        return [s.token async for s in req]


PROMPTS = [[17, 3, 250], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [99], [120, 2, 88, 4],
           [301, 12, 77, 5, 160, 42, 8, 200, 31], [64, 64]]


async def test_scheduler_batches_and_each_request_equals_alone(tiny_f32):
    async with open_backbone(tiny_f32, workers=2, transport="inproc") as swarm:
        sched = Scheduler(swarm.backbone, token_budget=16, prefill_chunk=4)
        async with trio.open_nursery() as nursery:
            await nursery.start(sched.run)
            alone = [await _collect(sched, p) for p in PROMPTS]
            steps_alone, req_alone = sched.stats.steps, swarm.backbone.dispatcher.stats.requests
            together: dict[int, list[int]] = {}

            async def one(i):
                sampler = Sampler(0.8, 0.9, seed=i) if i == 5 else None
                together[i] = await _collect(sched, PROMPTS[i], sampler=sampler)

            async with trio.open_nursery() as clients:
                for i in range(len(PROMPTS)):
                    clients.start_soon(one, i)
            nursery.cancel_scope.cancel()
    for i in range(5):  # greedy: identical to the request alone (batch-invariant mode, the default)
        assert together[i] == alone[i], i
    assert len(together[5]) == 6
    assert sched.stats.max_active == len(PROMPTS)
    # batched: far fewer steps and expert requests than the same requests one after another
    assert sched.stats.steps - steps_alone < steps_alone / 2
    assert swarm.backbone.dispatcher.stats.requests - req_alone < req_alone / 2


async def test_scheduler_cancel_and_refusals(tiny_f32):
    async with open_backbone(tiny_f32, workers=0) as mono:
        sched = Scheduler(mono.backbone)
        with pytest.raises(ValueError, match="out of range"):
            sched.submit([1, 10**6])
        with pytest.raises(ValueError, match="empty"):
            sched.submit([])
        async with trio.open_nursery() as nursery:
            await nursery.start(sched.run)
            async with sched.submit([1, 2, 3], Params(max_tokens=1000)) as req:
                async for step in req:
                    if step.index == 2:
                        break  # the client goes away
            with trio.fail_after(30):
                assert len(await _collect(sched, [4, 5], max_tokens=3)) == 3
                while sched.active:
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
    assert sched.stats.cancelled == 1 and sched.stats.completed == 1
    assert sched.stats.generated < 20
