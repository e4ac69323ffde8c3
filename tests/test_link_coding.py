"""The output coding chosen per link from the link's measured rate (p2pswarm.net.wire.link_rate).

A worker OS process answers the same big expert requests (256 kB replies) on a plain loopback
socket and through the WAN proxy capped at 40 Mbit/s: on the fast link, once measured, the backbone
stops asking for the planes-zstd coding and the replies come raw; on the capped one they stay coded.
Every reply equals the backbone's own replica's outputs bit for bit.
"""
from __future__ import annotations

import numpy as np
import pytest
import trio

from p2pswarm.backbone.sessions.local import open_backbone
from p2pswarm.net.wire import codec as wire_codec
from p2pswarm.net.wire.link_rate import MIN_SAMPLES, LinkRate
from p2pswarm.net.wire.wanproxy import open_wan_proxy


def test_the_rate_is_the_median_of_multi_read_messages(monkeypatch):
    """Pace from the reads after a message's first; a message in one read gives no sample; fast
    only from MIN_SAMPLES samples on, at the configured Mbit/s."""
    clock = iter(np.arange(0, 100, 0.01))  # each read 10 ms after the one before
    monkeypatch.setattr("p2pswarm.net.wire.link_rate.time.perf_counter", lambda: float(next(clock)))
    r = LinkRate()
    for _ in range(MIN_SAMPLES):
        r.begin(False)
        r.read(1 << 20)  # whole, one read: no sample
        r.message_done()
    assert r.bytes_per_s() is None and not r.fast()
    for _ in range(MIN_SAMPLES):
        r.begin(False)
        r.read(100)
        r.read(50_000)  # 50 kB in 10 ms: 5 MB/s, 40 Mbit/s
        r.message_done()
    assert r.bytes_per_s() == pytest.approx(5e6)
    monkeypatch.setenv("P2PSWARM_WIRE_CODEC_FAST_MBPS", "39")
    assert r.fast()
    monkeypatch.setenv("P2PSWARM_WIRE_CODEC_FAST_MBPS", "41")
    assert not r.fast()


@pytest.mark.slow
async def test_a_fast_link_is_answered_raw_and_a_capped_one_coded_both_exact(tiny_f32):
    async with open_backbone(tiny_f32, workers=2, transport="socket") as swarm:
        d = swarm.backbone.dispatcher
        fast, capped = swarm.owners
        cap = 40e6 / 8  # 40 Mbit/s, worker -> backbone
        async with open_wan_proxy(("127.0.0.1", capped.port), down_bytes_per_s=cap) as proxy:
            capped.port = proxy.port  # (not connected yet: the first request dials the proxy)
            rng = np.random.default_rng(5)
            with trio.fail_after(120):
                for owner in (fast, capped):
                    assert owner.output_coding == wire_codec.OUTPUT_CODING or owner._stream is None
                    layer = owner.layers[0]
                    n_embd = swarm.backbone.model.n_embd
                    experts = list(range(owner.experts[0], owner.experts[1]))[:4]
                    for i in range(12):
                        cur = rng.standard_normal((64, n_embd)).astype(np.float32)
                        groups = [(e, np.arange(64, dtype=np.int32)) for e in experts]  # 4 x 64 rows
                        got = await owner.compute(layer, cur, groups)
                        want = d.local.forward_groups(layer, cur, groups)
                        assert all(np.array_equal(g, w) for g, w in zip(got, want)), (owner.name, i)
    rate_fast, rate_capped = fast.link.bytes_per_s(), capped.link.bytes_per_s()
    print(f"fast link {rate_fast and rate_fast * 8e-6:.0f} Mbit/s, {fast.coded_replies} coded of 12; "
          f"capped {rate_capped and rate_capped * 8e-6:.1f} Mbit/s, {capped.coded_replies} coded of 12")
    assert fast.output_coding == capped.output_coding == wire_codec.OUTPUT_CODING  # both could code
    assert fast.link.fast() and fast.coded_replies <= MIN_SAMPLES + 1  # raw once measured
    # every reply coded but the first: a request made before its connection's hello asks for none
    assert not capped.link.fast() and capped.coded_replies >= 11
    assert rate_capped * 8e-6 < 45
