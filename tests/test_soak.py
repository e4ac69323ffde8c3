"""The soak's short version (bench/soak.py): the whole swarm (two bootstraps, a relay, seven honest
workers, three behind WAN proxies and two behind the relay, a dishonest worker, a backbone verifying
a quarter of the rows) under the openai client's load, one fault of each kind from a seeded
schedule, and the same checker as the long run: no wrong token, nothing lost or hung, the
dishonest worker banned, full worker service back after every fault."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

pytestmark = pytest.mark.slow


def test_short_soak_keeps_every_promise(tiny_f32, tmp_path):
    import soak

    report = soak.run_soak(tiny_f32, tmp_path, duration_s=90, seed=3, clients=3, fault_every_s=8,
                           sample_every_s=5, warmup_s=30, min_faults=len(soak.Nemesis.KINDS))
    kinds = {f["kind"] for f in report["faults"]}
    assert kinds >= set(soak.Nemesis.KINDS), report["faults"]
    assert report["outcomes"].get("ok", 0) >= 20, report["outcomes"]
    assert report["problems"] == [], report["problems"]
