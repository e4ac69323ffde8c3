"""Small compute runs inline on the event loop, big compute in a thread, with the same bits.

The policy (p2pswarm.offload) on its own, then the real worker behind the real libp2p expert
protocol handler (a request computed inline equals the threaded one and the direct call, bit for
bit; a large request still goes to a thread), and the backbone's dense path (a batched schedule's
logits inline == threaded)."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import trio

from p2pswarm.backbone.dispatch.dispatcher import pack_rows
from p2pswarm.backbone.sessions.local import ensure_shards, open_backbone
from p2pswarm.errors import UserError
from p2pswarm.model.layout import ModelLayout
from p2pswarm.model.manifest import model_fingerprint
from p2pswarm.net.libp2p.host import open_host
from p2pswarm.net.signed.identity import Identity
from p2pswarm.offload import Offload
from p2pswarm.settings import INLINE_MS
from p2pswarm.worker.expert_worker import ExpertWorker

from helpers.ggml import needs_ggml
from helpers.owners import libp2p_owner, served


async def test_policy_measures_first_then_inlines_small_and_threads_big():
    off = Offload(inline_s=0.05)
    loop = threading.get_ident()
    where = []

    def work():
        where.append(threading.get_ident() == loop)
        return 7

    assert await off.run(work, 10, "k") == 7  # never measured: a thread, once, to time it
    assert where == [False] and off.thread_calls == 1
    assert off.expected_s("k", 10) is not None and off.expected_s("k", 10) < 0.05
    assert await off.run(work, 10, "k") == 7
    assert where[-1] is True and off.inline_calls == 1  # measured short: on the loop
    assert await off.run(work, 10, "other") == 7 and where[-1] is False  # another kind: measured apart
    # expected over the bound: a thread, whatever it was before
    big = int(0.06 / off.expected_s("k", 1)) + 1
    await off.run(work, big, "k")
    assert where[-1] is False
    # exceptions come through either way
    with pytest.raises(ValueError):
        await off.run(lambda: int("x"), 1, "k")


async def test_policy_threads_while_a_thread_runs_and_when_switched_off():
    off = Offload(inline_s=0.05)
    loop = threading.get_ident()
    await off.run(lambda: None, 1, "k")  # measured: the next one would be inline
    assert off.inline("k", 1)
    release = threading.Event()
    where = []

    def slow():
        release.wait(5)

    def quick():
        where.append(threading.get_ident() == loop)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(off.run, slow, 1000000, "big")  # never measured: a thread
        await trio.sleep(0.05)
        assert off.threaded_now == 1 and not off.inline("k", 1)
        await off.run(quick, 1, "k")  # would wait on the kernel lock the thread holds: a thread too
        release.set()
    assert where == [False] and off.threaded_now == 0 and off.inline("k", 1)
    never = Offload(inline_s=0.0)
    for _ in range(3):
        await never.run(quick, 1, "k")
    assert where[1:] == [False] * 3 and never.inline_calls == 0


def test_inline_ms_setting(monkeypatch):
    monkeypatch.setenv("P2PSWARM_INLINE_MS", "0")
    assert Offload().inline_s == 0.0
    monkeypatch.setenv("P2PSWARM_INLINE_MS", "2.5")
    assert Offload().inline_s == 0.0025
    monkeypatch.setenv("P2PSWARM_INLINE_MS", "-1")
    with pytest.raises(UserError, match="P2PSWARM_INLINE_MS"):
        INLINE_MS.get()


@pytest.fixture
def q8_shards(tiny_q8, tmp_path):
    layout = ModelLayout.open(tiny_q8)
    return ensure_shards(layout, model_fingerprint(layout), 2, tmp_path / "shards")


@needs_ggml
async def test_libp2p_worker_inline_equals_threaded_and_big_requests_still_thread(q8_shards):
    worker = ExpertWorker(q8_shards[1], kernel="ggml")
    info = worker.info
    layer = info.layer_begin
    experts = list(range(info.expert_begin, info.expert_begin + 4))
    rng = np.random.default_rng(3)
    small_cur = rng.standard_normal((2, info.n_embd)).astype(np.float32)
    small = [(e, np.array([i % 2])) for i, e in enumerate(experts)]  # 4 routed rows
    big_cur = rng.standard_normal((256, info.n_embd)).astype(np.float32)
    big = [(e, np.arange(256)) for e in experts]  # 1024 routed rows
    off = worker.offload
    async with served(worker) as wnet, open_host(Identity.generate()) as bnet:
        owner = libp2p_owner(bnet, wnet, worker)
        off.inline_s = 0.0  # threads only: the reference
        threaded = await owner.compute(layer, small_cur, small)
        for _ in range(3):
            await owner.compute(layer, small_cur, small)
        assert off.inline_calls == 0 and off.thread_calls == 4
        per_row = off.expected_s(("compute", None), 1)
        off.inline_s = 40 * per_row  # 4 rows: well inside; 1024 rows: 25x over
        inline = await owner.compute(layer, small_cur, small)
        assert off.inline_calls == 1 and off.thread_calls == 4, "a 4-row request was not computed inline"
        rows, local = pack_rows(small_cur, small)
        direct = worker.compute(layer, rows, local)
        for a, b, c in zip(threaded, inline, direct):
            assert a.dtype == b.dtype == np.float32 and np.array_equal(a, b) and np.array_equal(b, c)
        got = await owner.compute(layer, big_cur, big)
        assert off.thread_calls == 5 and off.inline_calls == 1, "a 1024-row request did not go to a thread"
        rows, local = pack_rows(big_cur, big)
        assert all(np.array_equal(g, w) for g, w in zip(got, worker.compute(layer, rows, local)))
        await owner.aclose()


@needs_ggml
async def test_backbone_dense_path_inline_equals_threaded(tiny_q8, monkeypatch):
    prompts = [[17, 3, 250, 99], [12, 77, 5], [9, 120]]

    async def run(inline_ms: str):
        monkeypatch.setenv("P2PSWARM_INLINE_MS", inline_ms)
        async with open_backbone(tiny_q8, workers=2, transport="inproc", kernel="ggml") as swarm:
            bb = swarm.backbone
            states = [bb.new_state() for _ in prompts]
            out = [await bb.forward_batch(list(zip(prompts, states)))]
            for step in range(4):  # decode steps of one row per sequence
                out.append(await bb.forward_batch([([5 + step + i], st) for i, st in enumerate(states)]))
            return out, bb.offload

    threaded, off0 = await run("0")
    inline, off1 = await run("1000")  # a bound no piece of this tiny model reaches
    assert off0.inline_calls == 0 and off1.inline_calls > 0
    assert off1.thread_calls < off0.thread_calls
    for a, b in zip(threaded, inline):
        for x, y in zip(a, b):
            assert x.shape == y.shape and np.array_equal(x, y)


async def test_a_thread_time_clock_counts_the_calls_cpu_not_its_waits():
    """A call that waits (a sleep here; a worker thread's wait for the GIL in a busy backbone)
    but computes little: measured by wall time it keeps taking the hop, by its thread's CPU time
    it runs inline after its first, timed call."""
    import time

    def waits():
        time.sleep(0.08)

    wall, cpu = Offload(inline_s=0.05), Offload(inline_s=0.05, clock=time.thread_time)
    for off in (wall, cpu):
        await off.run(waits, 1, "k")
    assert wall.expected_s("k", 1) >= 0.08 and not wall.inline("k", 1)
    assert cpu.expected_s("k", 1) < 0.05 and cpu.inline("k", 1)
