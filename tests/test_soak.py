"""The soak's short version (bench/soak.py): a smaller swarm than the long run's (two bootstraps, a
relay, two backbones verifying a quarter of the rows - one holding only the dense part and a 10 %
expert cache - five honest workers: two direct, one behind a WAN proxy, one in a network namespace
behind a NAT reachable only through the relay, one in a namespace of its own; a dishonest worker;
no ``--auto`` worker: bench/soak.SHORT), started in waves of processes started together, under the
openai client's load, at least one fault of each of the eight kinds from a seeded schedule (every
hold 0.15 of the long run's: partitions and slowed links 3-9 s rather than 20-60 s), and the same
checker as the long run: no wrong token, nothing lost or hung, the dishonest worker banned, the
NATed worker reached through the relay, full worker service back after every fault. Needs root,
``ip`` and ``nft`` (fails, never skips, without them)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from system_tools import require

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

pytestmark = pytest.mark.slow


def test_short_soak_keeps_every_promise(tiny_f32, tmp_path):
    import soak

    require("ip", "nft")
    if os.geteuid() != 0:
        pytest.fail("the soak's network namespaces need root", pytrace=False)
    report = soak.run_soak(tiny_f32, tmp_path, duration_s=30, seed=3, clients=3, fault_every_s=0.5,
                           sample_every_s=5, warmup_s=10, min_faults=len(soak.Nemesis.KINDS), hold_scale=0.15,
                           prompts=2, roster=soak.SHORT, auto=False)
    print(report["setup"], report["wall_s"], report["faults_by_kind"])
    kinds = {f["kind"] for f in report["faults"]}
    assert kinds >= set(soak.Nemesis.KINDS), report["faults"]
    assert report["outcomes"].get("ok", 0) >= 20, report["outcomes"]
    assert all(report["per_backbone"][b].get("ok") for b in report["per_backbone"]), report["per_backbone"]
    assert len(report["per_backbone"]) == 2, report["per_backbone"]
    assert report["problems"] == [], report["problems"]
