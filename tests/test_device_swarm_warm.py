"""bench/device_swarm.py's ``--warm``: untimed rounds at every measured N before the timed ones,
so the first timed round is not the swarm's cold start (docs/benchmarks.md, i46c)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import device_swarm


def test_warm_up_measures_every_n_warm_times_in_the_timed_order(monkeypatch):
    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(device_swarm, "measure", lambda sw, n, tokens: calls.append((n, tokens)) or {"n": n})
    got = device_swarm.warm_up(object(), [16, 64], argparse.Namespace(warm=2, tokens=4))
    assert calls == [(16, 4), (64, 4), (16, 4), (64, 4)]
    assert [r["n"] for r in got] == [16, 64, 16, 64]
    calls.clear()
    assert device_swarm.warm_up(object(), [16, 64], argparse.Namespace(warm=0, tokens=4)) == []
    assert calls == []


def test_a_measurement_counts_the_coverage_refreshes_in_its_window():
    """A refresh's DHT look-ups land in a short round's CPU per token: the line says so."""
    assert device_swarm.refreshes({"resolver": {"refreshes": 3}}) == 3
    assert device_swarm.refreshes({"resolver": None}) == 0 and device_swarm.refreshes({}) == 0
    r = {"tokens": 64, "cpu": {"backbone": 0.64}, "steps": 4, "requests": 64, "micro_batches": 2, "refreshes": 1}
    assert "1 coverage refresh(es) in the window" in device_swarm.per_token(r)
    assert "refresh" not in device_swarm.per_token(dict(r, refreshes=0))


def test_f_is_pooled_over_every_timed_round_of_both_alone_runs():
    """One round's f moved 0.69-0.77 between runs of the same tree under a quota (i46f): the
    Amdahl bound uses the sums over all of them, not the best round of the first run."""
    rounds1 = [{"expert_s": 7.0, "busy_s": 10.0, "tokens": 64}, {"expert_s": 7.7, "busy_s": 10.0, "tokens": 64}]
    rounds2 = [{"expert_s": 7.3, "busy_s": 10.0, "tokens": 64}]
    alone = dict(rounds1[0], pooled=device_swarm.pooled(rounds1))
    alone2 = dict(rounds2[0], pooled=device_swarm.pooled(rounds2))
    assert alone["pooled"] == {"expert_s": 14.7, "busy_s": 20.0, "tokens": 128}
    f, per_tok = device_swarm.amdahl_share(alone, alone2)
    assert abs(f - 22.0 / 30.0) < 1e-12 and abs(per_tok - 22.0 / 192) < 1e-12
    assert abs(device_swarm.amdahl_share(alone)[0] - 0.735) < 1e-12
    # an entry without rounds pooled (older JSON) counts its own round
    assert device_swarm.amdahl_share(rounds2[0])[0] == 0.73
