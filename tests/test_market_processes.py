"""The verification market's must-show, as real OS processes on 127.0.0.1: a dishonest worker (it falsifies 1% of
its output rows) is caught by a backbone's sampled verification within the number of rows the
sample rate predicts, banned swarm-wide by a signed DHT record that the other backbones honour (one
started after the ban, one already running), and its unpaid receipts are voided; the honest
worker's receipts verify; both backbones' logits equal the monolithic run's bit for bit (the
detecting one's through replay on ban: the rows it computed from the liar's unchecked outputs
before the catch are recomputed)."""
from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import numpy as np
import pytest

from p2pswarm.market.verify import rows_for_confidence
from p2pswarm.model.slicer import slice_experts
from p2pswarm.net.signed.identity import load_or_create_identity

from conftest import run_cli
from helpers.procs import Proc

RATE, FRACTION, HONEST_ROWS = 0.5, 0.01, 400
TOKENS = ",".join(str((i * 37 + 11) % 500) for i in range(300))


@pytest.mark.slow
def test_dishonest_worker_is_caught_banned_everywhere_and_its_receipts_voided(tiny_f32, tmp_path):
    env = dict(os.environ, P2PSWARM_KERNEL="numpy", P2PSWARM_HOME=str(tmp_path / "home"))
    nodes: list[Proc] = []
    liar_id = load_or_create_identity(tmp_path / "liar.key").peer_id_str
    b1_id = load_or_create_identity(tmp_path / "b1.key").peer_id_str
    try:
        boot = Proc(["bootstrap", "--listen", "/ip4/127.0.0.1/tcp/0", "--identity", str(tmp_path / "boot.key")],
                    tmp_path / "boot.log", env)
        nodes.append(boot)
        slice_experts(tiny_f32, tmp_path / "lo.gguf", None, (0, 8))
        slice_experts(tiny_f32, tmp_path / "hi.gguf", None, (8, 16))
        honest = Proc(["node", "--role", "worker", "--shard", str(tmp_path / "lo.gguf"), "--bootstrap", boot.addr,
                       "--identity", str(tmp_path / "honest.key"), "--receipts-dir", str(tmp_path / "honest-r"),
                       "--ttl", "120"], tmp_path / "honest.log", env)
        nodes.append(honest)
        liar = Proc([str(Path(__file__).parent / "helpers" / "dishonest_worker.py"), "--shard", str(tmp_path / "hi.gguf"),
                     "--bootstrap", boot.addr, "--identity", str(tmp_path / "liar.key"), "--receipts-dir",
                     str(tmp_path / "liar-r"), "--fraction", str(FRACTION), "--seed", "5",
                     "--honest-rows", str(HONEST_ROWS)], tmp_path / "liar.log", env, entry=())
        nodes.append(liar)
        # A long-running backbone (node) that trusts backbone 1's bans, up before the ban exists.
        b3 = Proc(["node", "--role", "backbone", "--model", str(tiny_f32), "--bootstrap", boot.addr, "--identity",
                   str(tmp_path / "b3.key"), "--http", "127.0.0.1:0", "--trust-bans", b1_id, "--ban-refresh", "1"],
                  tmp_path / "b3.log", env)
        nodes.append(b3)
        mono = tmp_path / "mono.npy"
        run_cli("logits", str(tiny_f32), "--tokens", TOKENS, "--out", str(mono), "--kernel", "numpy", "--decode",
                env=env, check=True)
        # Backbone 1 checks half the rows; the liar turns dishonest after its first 400.
        b1 = run_cli("logits", str(tiny_f32), "--tokens", TOKENS, "--out", str(tmp_path / "b1.npy"), "--decode",
                     "--kernel", "numpy", "--swarm", boot.addr, "--swarm-identity", str(tmp_path / "b1.key"),
                     "--verify-rate", str(RATE), "--verify-seed", "11", "--receipt-period", "0.3", env=env,
                     check=True)
        m = re.search(rf"BANNED worker {liar_id}: layer (\d+) expert (\d+) row \d+: max \|delta\| (\S+) .*caught "
                      rf"after (\d+) rows served, (\d+) checked", b1.stderr)
        assert m, b1.stderr[-3000:]
        assert 8 <= int(m.group(2)) < 16 and float(m.group(3)) > 0
        served = int(m.group(4))
        bound = rows_for_confidence(RATE, FRACTION, 0.999)  # ln(0.001) / ln(1 - r p) = 1,378 rows
        assert HONEST_ROWS < served <= HONEST_ROWS + bound, (served, bound)
        assert "published the ban" in b1.stderr and "Traceback" not in b1.stderr
        # Replay on ban: the rows backbone 1 computed from the liar's unchecked outputs before the
        # catch are recomputed, so its logits too equal the monolithic run's bit for bit.
        assert re.search(rf"replaying request \S+ from position \d+.*: worker {liar_id}, whose unverified outputs it "
                         rf"used, was banned", b1.stderr), b1.stderr[-3000:]
        assert np.array_equal(np.load(mono), np.load(tmp_path / "b1.npy"))
        # Backbone 2 (another identity) trusts backbone 1's bans: it never asks the liar anything.
        b2 = run_cli("logits", str(tiny_f32), "--tokens", TOKENS, "--out", str(tmp_path / "b2.npy"), "--decode",
                     "--kernel", "numpy", "--swarm", boot.addr, "--trust-bans", b1_id, "--receipt-period", "0.3",
                     env=env, check=True)
        assert f"honouring the ban of worker {liar_id} by backbone {b1_id}" in b2.stderr, b2.stderr[-3000:]
        assert "BANNED" not in b2.stderr and not re.search(rf"worker {liar_id[-10:]}/\w+ (failed|answered)", b2.stderr)
        assert np.array_equal(np.load(mono), np.load(tmp_path / "b2.npy"))
        deadline = time.time() + 30
        while f"honouring the ban of worker {liar_id} by backbone {b1_id}" not in b3.log.read_text():
            assert time.time() < deadline, b3.log.read_text()[-3000:]
            time.sleep(0.2)
        liar.stop()
        honest.stop()
        log = liar.log.read_text()
        total = int(re.search(r"DISHONEST: served (\d+) rows", log).group(1))
        # replies that came after their deadline (a loaded machine) were computed but recomputed
        # locally, not used: backbone 1 logs them
        late = sum(int(n) for n in re.findall(rf"worker {liar_id[-10:]}/\w+ answered its request of (\d+) rows",
                                              b1.stderr))
        assert total == served + late, (total, served, late)  # nothing after the ban, from either backbone
        # The honest worker's receipts from both backbones verify and add up.
        good = run_cli("rewards", "--dir", str(tmp_path / "honest-r"), "--json", env=env)
        assert good.returncode == 0, good.stderr
        chains = json.loads(good.stdout)["chains"]
        assert len({c["backbone"] for c in chains}) == 2 and all(c["rows"] > 0 and not c["problems"] for c in chains)
        # The liar's receipts from backbone 1 (earned while honest) are void: the ban says so.
        bad = run_cli("rewards", "--dir", str(tmp_path / "liar-r"), "--json", "--bootstrap", boot.addr, env=env)
        assert bad.returncode == 0, bad.stderr
        [chain] = [c for c in json.loads(bad.stdout)["chains"] if c["backbone"] == b1_id]
        # (receipts cover only work used before the catch: the detecting request is not credited)
        assert chain["receipts"] >= 1 and chain["voided_from"] == 1 and chain["rows"] < served
        print(f"caught after {served} rows served ({served - HONEST_ROWS} after it turned dishonest; 99.9% bound "
              f"{bound:.0f}); liar's voided receipts: {chain['receipts']} for {chain['rows']} rows")
    finally:
        for n in reversed(nodes):
            n.stop()
