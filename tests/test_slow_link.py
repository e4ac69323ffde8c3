"""A link too slow for a request's deadline: the backbone falls back to its replica
within a bounded stall and every token stays exact.

Worker processes behind the in-process WAN proxy (p2pswarm.net.wire.wanproxy) on real sockets. Once the
backbone has learnt each worker's deadline on the fast link, the links' worker -> backbone
direction is capped at 2 kB/s: a reply of a decode step (4 experts x 256 floats = 4 kB) then
takes ~2 s, past the learnt deadline. Each such request is recomputed on the backbone's replica
after at most its deadline (``SocketOwner.deadline_s``: 3x the p99 of the last 64 round trips,
scaled by rows, + 0.25 s, at least 0.5 s, at most ``timeout_s``); the logits equal the monolithic
run's bit for bit, and no step stalls longer than that deadline plus the replica's own work.
"""
from __future__ import annotations

import time

import numpy as np
import pytest
import trio

from p2pswarm.backbone.sessions.local import open_backbone
from p2pswarm.net.wire.wanproxy import open_wan_proxy
from p2pswarm.backbone.serving.generate import sequence_logits

TOKENS = [17, 3, 250, 99, 4, 4, 301, 12, 77, 5, 160, 42]


@pytest.mark.slow
async def test_a_saturated_link_falls_back_within_the_deadline_and_stays_exact(tiny_f32):
    slow_tokens = TOKENS[:4]
    async with open_backbone(tiny_f32, workers=0) as mono:
        want = await sequence_logits(mono.backbone, TOKENS, decode=True)
        want_slow = await sequence_logits(mono.backbone, slow_tokens, decode=True)
        layers = mono.backbone.model.n_layer
    async with open_backbone(tiny_f32, workers=2, transport="socket", timeout_s=20.0) as swarm:
        d = swarm.backbone.dispatcher
        fast = 1e12  # capped from the start (a link's pacing is chosen when it connects), at no real cost
        async with open_wan_proxy(("127.0.0.1", swarm.workers[0].port), down_bytes_per_s=fast) as p0, \
                open_wan_proxy(("127.0.0.1", swarm.workers[1].port), down_bytes_per_s=fast) as p1:
            proxies = [p0, p1]
            for owner, proxy in zip(swarm.owners, proxies):
                owner.port = proxy.port  # (no connection yet: the first request dials the proxy)
            with trio.fail_after(120):
                assert np.array_equal(await sequence_logits(swarm.backbone, TOKENS, decode=True), want)  # learn deadlines
                assert d.stats.fallbacks == 0 and all(len(o._latency) >= 8 for o in swarm.owners)
                deadlines = [o.deadline_s(4) for o in swarm.owners]
                assert max(deadlines) < 20.0  # learnt, not the fixed timeout
                for proxy in proxies:  # saturate: 2 kB/s from each worker
                    proxy.down.bytes_per_s = 2000.0
                t0 = time.perf_counter()
                got = await sequence_logits(swarm.backbone, slow_tokens, decode=True)  # one decode step per token
                took = time.perf_counter() - t0
            for proxy in proxies:
                proxy.down.bytes_per_s = fast
    assert np.array_equal(got, want_slow), "a wrong token after the link saturated"
    assert d.stats.deadline_misses >= 1 and d.stats.fallbacks >= 1
    # each layer of a step waits at most one deadline (owners in parallel), then recomputes here; a
    # late reply may widen a deadline up to LATE_REMEMBER (4) times before it is read
    bound = len(slow_tokens) * layers * (4 * max(deadlines) + 0.5)
    print(f"saturated: {len(slow_tokens)} steps took {took:.2f} s, bound {bound:.2f} s, deadlines {deadlines}, "
          f"{d.stats.deadline_misses} deadline misses")
    assert took < bound, (took, bound, deadlines)


def test_an_owner_predicts_its_round_trip_by_request_size():
    """SocketOwner.predict_s fits fixed + per-row seconds to its recent answers: on a capped link a
    big request is predicted slower than a small one (the hot-expert path reads it)."""
    from p2pswarm.backbone.owners.socket_owner import SocketOwner

    o = SocketOwner("w", "127.0.0.1", 1, model_fingerprint="m", kernel="k", layers=(0, 1), experts=(0, 1))
    assert o.predict_s(10) is None  # nothing measured yet
    for rows in [1, 2, 4, 8, 16, 32, 64, 128] * 2:
        o._record(0.05 + 0.002 * rows, rows)  # 50 ms away, 2 ms per row on the wire
    assert abs(o.predict_s(1) - 0.052) < 1e-9 and abs(o.predict_s(500) - 1.05) < 1e-9


async def test_the_hot_expert_path_keeps_a_big_request_local_on_a_slow_link(tiny_f32, tmp_path):
    """Same measured round trip for small requests, but a link whose time grows with the request's
    size: the hot-expert path sends the small request and computes the big one locally."""
    from p2pswarm.backbone.dispatch.dispatcher import Dispatcher, InProcessOwner
    from p2pswarm.backbone.sessions.local import ensure_shards
    from p2pswarm.engine.kernels import make_bank
    from p2pswarm.model.layout import ModelLayout
    from p2pswarm.model.manifest import model_fingerprint
    from p2pswarm.worker.expert_worker import ExpertWorker

    class CappedOwner(InProcessOwner):
        rtt_s = 0.01  # what a small request measured

        def predict_s(self, rows):
            return 0.01 + 0.004 * rows  # 4 ms per row on its link

    layout = ModelLayout.open(tiny_f32)
    shard = ensure_shards(layout, model_fingerprint(layout), 1, tmp_path)[0]
    owner = CappedOwner(ExpertWorker(shard, kernel="numpy"), "w0")
    disp = Dispatcher(make_bank(layout, "numpy"), [owner], hot_experts=True)
    small, big = [(0, np.arange(2))], [(0, np.arange(40))]  # remote: 18 ms / 170 ms on that link
    disp.local_row_s = 0.02  # 20 ms per row here: the small request is cheaper remote (18 < 40 ms)
    assert owner in disp._assign(0, small)
    disp.local_row_s = 0.003  # 3 ms per row here: the big one is cheaper local (120 < 170 ms)
    assert disp.local in disp._assign(0, big) and owner not in disp._assign(0, big)
    owner.predict_s = lambda rows: 0.01  # a link with bandwidth to spare: the same big request goes remote
    assert owner in disp._assign(0, big)
