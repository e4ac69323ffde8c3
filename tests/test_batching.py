"""Continuous batching: the batched step is exact (swarm == monolithic, bit for bit, for mixed
prefill + decode), batch-invariant when asked, and the scheduler batches, cancels and refuses."""
from __future__ import annotations

import numpy as np
import pytest
import trio

from p2pswarm.backbone.dispatch.dispatcher import DemandCounter, Dispatcher, InProcessOwner
from p2pswarm.backbone.serving.runner import Backbone
from p2pswarm.backbone.serving.sampling import Sampler
from p2pswarm.backbone.serving.scheduler import AUTO_BUDGET_CAP, AUTO_BUDGET_FLOOR, Params, Scheduler, choose_micro_batches, \
    choose_token_budget
from p2pswarm.backbone.sessions.local import ensure_shards, open_backbone
from p2pswarm.errors import WorkerError
from p2pswarm.engine.arch import load_dense
from p2pswarm.engine.kernels import make_bank
from p2pswarm.model.layout import ModelLayout
from p2pswarm.model.manifest import model_fingerprint
from p2pswarm.worker.expert_worker import ExpertWorker

from helpers.arch_checks import SCHEDULE
from helpers.arch_checks import alone as _alone
from helpers.arch_checks import run_schedule as _run_schedule
from helpers.ggml import needs_ggml










@pytest.mark.parametrize("transport,kernel", [("inproc", "numpy"),
                                              pytest.param("inproc", "ggml", marks=pytest.mark.slow),
                                              pytest.param("socket", "auto", marks=pytest.mark.slow)])
async def test_batched_swarm_equals_batched_monolithic(tiny_q8, transport, kernel):
    async with open_backbone(tiny_q8, workers=0, kernel=kernel) as mono:
        want = {inv: await _run_schedule(mono.backbone, inv) for inv in (False, True)}
        alone = await _alone(mono.backbone)
    async with open_backbone(tiny_q8, workers=3, transport=transport, kernel=kernel) as swarm:
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


@pytest.mark.slow
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


@pytest.mark.slow
async def test_an_idle_scheduler_gathers_a_burst_before_its_first_step(tiny_f32):
    """Requests that arrive a few ms apart (as an HTTP server parses a burst) share the first step:
    every one of 6 gets its first token from step 1, so 4 tokens take 4 steps, not 5. A stream
    that never pauses still starts by the most the scheduler waits."""
    async with open_backbone(tiny_f32, workers=0) as mono:
        sched = Scheduler(mono.backbone, gather=(0.05, 1.0))
        first_step: dict[int, int] = {}
        async with trio.open_nursery() as nursery:
            await nursery.start(sched.run)

            async def one(i, prompt):
                async with sched.submit(prompt, Params(max_tokens=4)) as req:
                    async for step in req:
                        first_step.setdefault(i, sched.stats.steps)

            with trio.fail_after(60):
                async with trio.open_nursery() as clients:
                    for i, prompt in enumerate(PROMPTS):
                        clients.start_soon(one, i, prompt)
                        await trio.sleep(0.005)
            assert sched.stats.steps == 4 and set(first_step.values()) == {1}, first_step
            # a stream of arrivals 10 ms apart for 0.6 s, gathered for at most 0.1 s: the first
            # request's first token comes before the stream ends
            sched.gather = (0.05, 0.1)
            first_token_at: list[float] = []
            t0 = trio.current_time()

            async def early():
                async with sched.submit(PROMPTS[0], Params(max_tokens=2)) as req:
                    async for _ in req:
                        first_token_at.append(trio.current_time() - t0)
                        break

            with trio.fail_after(60):
                async with trio.open_nursery() as clients:
                    clients.start_soon(early)
                    for i in range(60):
                        await trio.sleep(0.01)
                        clients.start_soon(_collect, sched, PROMPTS[i % len(PROMPTS)], 1)
                    stream_end = trio.current_time() - t0
            nursery.cancel_scope.cancel()
    assert first_token_at and first_token_at[0] < stream_end, (first_token_at, stream_end)


async def test_the_automatic_gather_window_follows_the_step_time(tiny_f32):
    """``auto``: before any step a fixed small window; then up to a step's time while requests
    keep coming a tenth of a step apart, capped; bad fixed windows are refused."""
    from p2pswarm.backbone.serving.scheduler import GATHER_FIRST, GATHER_MAX_S

    async with open_backbone(tiny_f32, workers=0) as mono:
        sched = Scheduler(mono.backbone)
        assert sched.gather_window() == GATHER_FIRST
        sched.step_s = 0.2  # e.g. 4 layers at 50 ms RTT
        assert sched.gather_window() == pytest.approx((0.02, 0.2))
        sched.step_s = 10.0
        assert sched.gather_window() == (GATHER_MAX_S, GATHER_MAX_S)
        for bad in ((-1, 0.1), (0.1,), "soon"):
            with pytest.raises(ValueError, match="gather"):
                Scheduler(mono.backbone, gather=bad)


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


@pytest.mark.slow
async def test_row_invariance_is_measured_per_kernel_and_type(tiny_q8, tiny_q4km):
    """The batch-invariant mode batches a mat-mul across sequences only where a probe found it
    row-invariant: libggml on Q8_0 yes; libggml on K-quants no (it switches kernels at 8 rows, so
    a row alone and a row among 8 differ); OpenBLAS (numpy) never."""
    seen, dense, small = {}, {}, {}
    for name, path in (("q8_0", tiny_q8), ("q4_k_m", tiny_q4km)):
        for kernel in ("numpy", "ggml"):
            async with open_backbone(path, workers=0, kernel=kernel) as mono:
                bb = mono.backbone
                seen[(name, kernel)] = (bb.row_invariant_experts, bb.row_invariant_output)
                dense[(name, kernel)] = bb.dense_invariance(0)
                small[(name, kernel)] = bb.small_call_rows
                if (name, kernel) == ("q8_0", "ggml"):  # the dense path of all sequences really is batched
                    real, widths = bb.model.layer_in, []

                    def counting(il, h, segments, real=real, widths=widths):
                        widths.append(len(segments))
                        return real(il, h, segments)

                    bb.model.layer_in = counting
                    try:
                        await _run_schedule(bb, True)
                    finally:
                        del bb.model.layer_in  # (a wrapper ties the model into a cycle: see test_glm4moe)
                    assert widths.count(4) == bb.model.n_layer  # the 4-sequence step of SCHEDULE, every layer
                if (name, kernel) == ("q4_k_m", "ggml"):  # invariant anyway: per-sequence mat-muls
                    alone = await _alone(bb)
                    real_local, calls = bb.dispatcher.run_groups_local, []

                    def recording(layer, cur, groups, real_local=real_local, calls=calls):
                        calls.append((cur.shape[0], groups))
                        return real_local(layer, cur, groups)

                    bb.dispatcher.run_groups_local = recording
                    got = await _run_schedule(bb, True)
                    # one-row decode groups of different sequences merged (a 3-sequence decode step)
                    assert any(len(idx) >= 2 for n, groups in calls if n == 3 for _, idx in groups)
                    for i, step in enumerate(SCHEDULE):
                        for (s, _), x in zip(step, got[i]):
                            assert np.array_equal(x, alone[(i, s)]), (i, s)
    assert seen[("q8_0", "numpy")] == seen[("q4_k_m", "numpy")] == (False, False)
    assert seen[("q8_0", "ggml")] == (True, True)
    assert seen[("q4_k_m", "ggml")] == (False, False)
    # K-quants on libggml: calls of up to 7 rows give every row the same bits (vec_dot below the
    # tiled GEMM's 8 rows), so sequences' small groups of one expert merge; OpenBLAS: never
    assert small[("q4_k_m", "ggml")] == 7 and small[("q4_k_m", "numpy")] == 1
    # a layer's way in (projections, the experts' input, the router): Q8_0 on libggml batches (the
    # F32 router too: one row padded to two, the single-row kernel is 1 ulp off); F32 on OpenBLAS
    # does not, nor K-quants on libggml (another kernel from 8 rows)
    assert dense[("q8_0", "ggml")].layer_in
    assert not dense[("q8_0", "numpy")].layer_in and not dense[("q4_k_m", "numpy")].layer_in
    assert not dense[("q4_k_m", "ggml")].layer_in


def test_micro_batch_rule():
    # WAN: the round trip dwarfs the dense work, nothing to hide
    assert choose_micro_batches(0.001, 0.05, 64) == 1
    # dense work comparable to the round trip: split, but never more than the sequences
    assert choose_micro_batches(0.05, 0.05, 64) >= 2
    assert choose_micro_batches(0.05, 0.05, 1) == 1
    # dense-bound (local, fast owners): more micro-batches cost overhead for nothing
    assert choose_micro_batches(0.05, 0.0, 64) == 1
    # measured at 0 ms RTT, 64 sequences on 2 shared cores (~5.5 ms dense per layer, ~10 ms wait):
    # M = 2-3 ran 10-50% slower than M = 1 (docs/benchmarks.md, "Inline compute of small requests")
    assert choose_micro_batches(0.0055, 0.010, 64) == 1
    # ... and at 25 ms (5.5 ms dense, 39 ms wait): M = 2 was no faster
    assert choose_micro_batches(0.0055, 0.039, 64) == 1


async def test_a_burst_of_prompts_is_pipelined_by_its_own_dense_time(tiny_f32):
    """The micro-batch rule is fed the dense time expected of *this* step: a decode step's as
    measured, a prefill step of ten times the rows ten times that (its rows times the per-row
    cost), so a burst's prefill is split into micro-batches while the decode steps are not."""
    async with open_backbone(tiny_f32, workers=0) as mono:
        sched = Scheduler(mono.backbone, micro_batches="auto")
        sched.dense_s, sched.dense_row_s, sched.wait_s = 0.0065, 0.0065 / 64, 0.032  # 64 decoding, 25 ms RTT
        decode, prefill = [[1]] * 64, [[1] * 10] * 64
        assert sched.step_dense_s(decode) == pytest.approx(0.0065)
        assert sched.step_dense_s(prefill) == pytest.approx(0.065)
        batch = [None] * 64
        assert len(sched._split(batch, decode)) == 1
        assert len(sched._split(batch, prefill)) >= 2


async def test_dense_busy_time_is_the_union_of_overlapping_pieces(tiny_f32):
    """Micro-batches' dense pieces that overlap wait on each other for the cores and the GIL: the
    time the backbone was busy is the union of the pieces, not their sum (LayerTiming.busy_s), and
    the micro-batch rule reads the union. (With the sum, 3 micro-batches measured 3x the dense time
    of 1 for the same work and kept choosing 3: docs/benchmarks.md, 2026-12-03.)"""
    async with open_backbone(tiny_f32, workers=0) as mono:
        bb = mono.backbone
        before = bb.timing.snapshot()

        async def piece(delay: float) -> None:
            with bb._dense_piece():
                await trio.sleep(delay)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(piece, 0.3)
            nursery.start_soon(piece, 0.2)  # inside the first unless it starts 0.1 s late
        assert bb.timing.dense_s - before.dense_s >= 0.5  # summed
        assert 0.3 <= bb.timing.busy_s - before.busy_s < 0.45  # the overlap counted once
        mid = bb.timing.snapshot()
        await piece(0.05)  # alone: both grow by it
        assert bb.timing.busy_s - mid.busy_s == pytest.approx(bb.timing.dense_s - mid.dense_s)

        sched = Scheduler(bb, micro_batches=2)
        for i in range(4):
            sched.submit([1 + i, 2, 3])
        sched._admit()
        t0 = bb.timing.snapshot()
        await sched.step()
        layers = bb.model.n_layer
        assert sched.last_micro_batches == 2
        assert sched.dense_s == pytest.approx((bb.timing.busy_s - t0.busy_s) / layers)
        assert sched.dense_s <= (bb.timing.dense_s - t0.dense_s) / layers + 1e-9


def test_token_budget_rule():
    assert choose_token_budget(None, None) == AUTO_BUDGET_FLOOR  # unmeasured
    # local owners (no round trip to hide rows behind): the floor
    assert choose_token_budget(1e-4, 0.0) == AUTO_BUDGET_FLOOR
    # WAN: 60 ms per layer on the network, 0.1 ms of dense work per row -> 600 rows cost one round trip
    assert choose_token_budget(1e-4, 0.06) == 600
    assert choose_token_budget(1e-7, 0.06) == AUTO_BUDGET_CAP


async def test_auto_token_budget_grows_only_while_network_bound(tiny_f32):
    async with open_backbone(tiny_f32, workers=0) as mono:
        sched = Scheduler(mono.backbone, token_budget="auto", prefill_chunk=8)
        for i in range(60):
            sched.submit([1 + i % 50] * 8)
        sched._admit()
        # a burst with nobody decoding yet: every prompt's chunk, whatever the budget (none to stall)
        assert len(sched.plan()) == 60 and sched.last_token_budget == AUTO_BUDGET_CAP
        first = sched._active[0]  # from now on one sequence decodes: the budget protects its row
        first.fed, first.next_token = len(first.prompt), 1
        assert len(sched.plan()) == AUTO_BUDGET_FLOOR // 8  # nothing measured yet: the floor
        sched.dense_row_s, sched.wait_s = 1e-4, 0.06  # as measured behind a 50 ms link: 600 rows
        assert len(sched.plan()) == 60 and sched.last_token_budget == 600
        sched.wait_s = 0.0  # owners on a fast link: back to the floor
        assert len(sched.plan()) == AUTO_BUDGET_FLOOR // 8
        with pytest.raises(ValueError, match="token_budget"):
            Scheduler(mono.backbone, token_budget="lots")


@pytest.mark.slow
async def test_pipelined_micro_batches_are_exact(tiny_f32):
    async with open_backbone(tiny_f32, workers=2, transport="socket") as swarm:
        out = {}
        for m in (1, 3):
            sched = Scheduler(swarm.backbone, micro_batches=m)
            async with trio.open_nursery() as nursery:
                await nursery.start(sched.run)
                res = {}

                async def one(i):
                    res[i] = await _collect(sched, PROMPTS[i])

                async with trio.open_nursery() as clients:
                    for i in range(len(PROMPTS)):
                        clients.start_soon(one, i)
                nursery.cancel_scope.cancel()
            out[m] = res
            assert sched.last_micro_batches == m
    assert out[1] == out[3]


class _SlowOwner(InProcessOwner):
    """A worker 30 ms away."""

    rtt_s = 0.03

    async def compute(self, layer, cur, groups):
        await trio.sleep(self.rtt_s)
        return await super().compute(layer, cur, groups)


async def test_hot_experts_computed_locally_when_the_owner_is_slower(tiny_f32, tmp_path):
    layout = ModelLayout.open(tiny_f32)
    shards = ensure_shards(layout, model_fingerprint(layout), 2, tmp_path)
    tokens = [17, 3, 250, 99, 4, 4, 301]
    results = {}
    for hot in (False, True):
        owners = [_SlowOwner(ExpertWorker(s, kernel="numpy"), f"w{i}") for i, s in enumerate(shards)]
        disp = Dispatcher(make_bank(layout, "numpy"), owners, hot_experts=hot)
        bb = Backbone(load_dense(layout), disp)
        results[hot] = [await bb.forward(tokens, bb.new_state()) for _ in range(2)]
        if hot:  # after one measured local share, the slow owners get no more requests
            assert disp.local_row_s is not None and disp.stats.requests < disp.stats.layers
            assert disp.stats.local_groups > 0
        else:
            assert disp.stats.local_groups == 0
    assert all(np.array_equal(a, b) for a, b in zip(results[False], results[True]))
    # the demand counter saw every routed (row, expert) pair: 7 rows x top-k per layer, twice
    d = disp.demand
    total = sum(d.value(il, e) for il in range(4) for e in range(16))
    assert abs(total - 2 * 4 * 7 * bb.model.n_expert_used) < 1e-6 * total + 0.5
    assert d.top(1)[0][1] >= d.top(5)[-1][1]


class _MovingOwner(InProcessOwner):
    """A worker whose link changes: its round trip is whatever ``delay_s`` is when it answers (a
    real owner's ``rtt_s`` learns from answered requests the same way)."""

    def __init__(self, worker, name, delay_s):
        super().__init__(worker, name)
        self.delay_s = delay_s
        self.rtt_s = None

    async def compute(self, layer, cur, groups):
        delay = self.delay_s
        await trio.sleep(delay)
        out = await super().compute(layer, cur, groups)
        self.rtt_s = delay
        return out


@pytest.mark.slow
async def test_hot_experts_probe_owners_kept_local_and_use_them_again_once_fast(tiny_f32, tmp_path):
    """An owner the hot-expert path keeps local gets no requests, so its round trip is never
    measured again: without probes a worker that was slow once stays unused for good. A probe (its
    share, in the background, the outputs dropped) re-measures it; once fast it gets requests again."""
    layout = ModelLayout.open(tiny_f32)
    shards = ensure_shards(layout, model_fingerprint(layout), 2, tmp_path)
    tokens = [17, 3, 250, 99, 4, 4, 301]
    mono = Backbone(load_dense(layout), Dispatcher(make_bank(layout, "numpy")))
    want = await mono.forward(tokens, mono.new_state())
    for probe_s in (float("inf"), 0.05):
        owners = [_MovingOwner(ExpertWorker(s, kernel="numpy"), f"w{i}", 0.05) for i, s in enumerate(shards)]
        disp = Dispatcher(make_bank(layout, "numpy"), owners, hot_experts=True)
        disp.hot_probe_s = float("inf")
        bb = Backbone(load_dense(layout), disp)
        for _ in range(3):  # measured slow, then kept local
            assert np.array_equal(await bb.forward(tokens, bb.new_state()), want)
        assert disp.stats.local_groups > 0 and all(o.rtt_s == 0.05 for o in owners)
        for o in owners:
            o.delay_s = 0.0  # the links got fast
        disp.hot_probe_s = probe_s
        await trio.sleep(0.1)
        before = disp.stats.snapshot()
        assert np.array_equal(await bb.forward(tokens, bb.new_state()), want)  # due: probed, outputs local
        await trio.sleep(0.05)  # the probes answer
        assert np.array_equal(await bb.forward(tokens, bb.new_state()), want)
        d = disp.stats.since(before)
        if probe_s == float("inf"):  # no probes: the fast owners are never asked again
            assert d.probes == 0 and d.requests == 0 and all(o.rtt_s == 0.05 for o in owners)
        else:
            assert d.probes > 0 and all(o.rtt_s == 0.0 for o in owners)
            assert d.requests > 0 and d.remote_groups > 0  # used again, and the same bits
    # a probe that fails (the worker died while kept local) backs the owner off: no probe every 2 s
    owners[0].delay_s = 0.05
    for _ in range(3):
        await bb.forward(tokens, bb.new_state())
    dead = next(o for o in owners if o.rtt_s == 0.05)

    async def gone(*a, **k):
        raise WorkerError("unreachable")
    dead.compute = gone
    await trio.sleep(0.1)
    before = disp.stats.snapshot()
    for _ in range(3):
        assert np.array_equal(await bb.forward(tokens, bb.new_state()), want)
        await trio.sleep(0.06)
    assert disp.stats.since(before).probes == 1 and not disp.healthy(dead)


def test_demand_counter_decays():
    d = DemandCounter(half_life_s=10.0)
    d.add(0, [(3, np.arange(8))], now=100.0)
    d.add(0, [(3, np.arange(8))], now=110.0)
    assert d.value(0, 3, now=110.0) == pytest.approx(12.0)
    assert d.value(0, 3, now=130.0) == pytest.approx(3.0)
    assert d.value(1, 3, now=130.0) == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("kernel,qtype", [("numpy", "q8_0"), ("ggml", "q8_0"), ("ggml", "q4_k_m")])
async def test_batched_qwen35moe_deltanet_and_shared_expert(models_dir, kernel, qtype):
    """The hybrid architecture: per-sequence DeltaNet conv + S state and KV, a shared expert in
    post_moe. Batched swarm == batched monolithic, and batch-invariant == alone, bit for bit.
    (Q4_K_M on ggml: the layer graph's shared expert is a K-quant mat-mul, not row-invariant; it
    once reached a sequence's post_moe from the batched graph while the probe had put post_moe
    per sequence, and the batched run differed from the run alone.)"""
    from p2pswarm.model.synth import make_model

    path = models_dir / f"q35-batching-{qtype.replace('q8_0', 'q8')}.gguf"  # (q8: shared with the test below)
    if not path.exists():
        make_model(path, arch="qwen35moe", preset="tiny", qtype=qtype, seed=31)
    async with open_backbone(path, workers=0, kernel=kernel) as mono:
        want = await _run_schedule(mono.backbone, True)
        fast = await _run_schedule(mono.backbone, False)
        alone = await _alone(mono.backbone)
    async with open_backbone(path, workers=2, transport="inproc", kernel=kernel) as swarm:
        got = await _run_schedule(swarm.backbone, True)
        got_fast = await _run_schedule(swarm.backbone, False)
        assert swarm.backbone.dispatcher.stats.requests > 0
    for a, b, c, d in zip(want, got, fast, got_fast):
        assert all(np.array_equal(x, y) for x, y in zip(a, b))
        assert all(np.array_equal(x, y) for x, y in zip(c, d))
    for i, step in enumerate(SCHEDULE):
        for (s, _), x in zip(step, want[i]):
            assert np.array_equal(x, alone[(i, s)]), (i, s)


@needs_ggml
def test_qwen35moe_shared_expert_batches_in_the_invariant_mode(models_dir):
    """With the ggml kernel a qwen35moe layer's post_moe (shared expert + its F32 per-token gate)
    is measured row-invariant, so the batch-invariant default runs it once for all sequences, not
    once per sequence: the gate is a per-row reduction, not OpenBLAS's (T, E) x (E, 1) product."""
    from p2pswarm.backbone.serving.runner import probe_dense_invariance
    from p2pswarm.model.synth import make_model

    path = models_dir / "q35-batching-q8.gguf"
    if not path.exists():
        make_model(path, arch="qwen35moe", preset="tiny", qtype="q8_0", seed=31)
    model = load_dense(ModelLayout.open(path), "ggml")
    assert model.backend.tensors > 0
    got = [probe_dense_invariance(model, il) for il in range(model.n_layer)]
    assert all(g.layer_in and g.layer_out for g in got), got


async def test_a_failing_step_fails_its_requests_and_the_scheduler_goes_on(tiny_f32):
    async with open_backbone(tiny_f32, workers=0) as mono:
        sched = Scheduler(mono.backbone)
        real = mono.backbone.forward_batch
        calls = [0]

        async def flaky(items, **kw):
            calls[0] += 1
            if calls[0] == 2:
                raise RuntimeError("boom")
            return await real(items, **kw)

        mono.backbone.forward_batch = flaky
        async with trio.open_nursery() as nursery:
            await nursery.start(sched.run)
            with trio.fail_after(60):
                with pytest.raises(RuntimeError, match="boom"):
                    await _collect(sched, [1, 2, 3])
                assert len(await _collect(sched, [4, 5], max_tokens=3)) == 3
            nursery.cancel_scope.cancel()
    assert sched.stats.failed == 1 and sched.stats.completed == 1
