"""Fuzzed and mutated frames against the expert, shard-transfer and token handlers of live nodes.

Three real processes -- a worker (`node --role worker`, `/p2pswarm/expert/1.0.0`), a shard source
(`serve-shards`, `/p2pswarm/shard/1.0.0`) and a relay (`relay`, `/p2pswarm/token/1.0.0`) -- get
protocol-shaped garbage from tests/helpers/fuzz.py, one case per stream. What must hold: no node
crashes or logs a traceback or an unhandled handler error, every bad case ends with the node closing
(or resetting) *that* stream (none left hanging), a valid stream opened before the storm keeps
working through it, and memory stays bounded. `bench/fuzz_protocols.py` runs 100,000 frames.
"""
from __future__ import annotations

import os

import pytest

from helpers import fuzz

pytestmark = pytest.mark.slow
CASES = int(os.environ.get("P2PSWARM_FUZZ_CASES", "1000"))  # per protocol; the benchmark runs more
RSS_GROWTH_KB = 150 << 10


async def test_fuzzed_frames_close_only_their_stream(tiny_f32, tmp_path):
    env = dict(os.environ, P2PSWARM_KERNEL="numpy", P2PSWARM_HOME=str(tmp_path / "home"), PYTHONUNBUFFERED="1")
    report = await fuzz.run_storm(tiny_f32, tmp_path, env, CASES)
    for name, s in report.stats.items():
        print(f"{name}: {s.line()}")
        assert s.cases == CASES
        assert s.outcomes["hung"] == 0 and s.outcomes["open_failed"] == 0, (name, s.line())
    for name, (start, peak) in report.rss_kb.items():
        print(f"{name}: RSS {start / 1024:.0f} MB -> peak {peak / 1024:.0f} MB")
        assert report.alive[name], report.logs[name][-3000:]
        assert peak - start < RSS_GROWTH_KB, (name, start, peak)
    for name, text in report.logs.items():
        assert "Traceback" not in text, text[-3000:]
        assert "handler failed" not in text, [ln for ln in text.splitlines() if "handler failed" in ln][:5]
