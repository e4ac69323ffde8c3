"""A worker stopped cleanly takes its last receipts with it: the backbone signs the work
done since its last receipt period when the leaving worker asks (/p2pswarm/receipt/1.0.0), so
`p2pswarm rewards` counts every row. Real processes; the backbone's period (an hour) never comes."""
from __future__ import annotations

import json
import os
import signal

import httpx
import pytest

from conftest import run_cli
from helpers.procs import Proc, stop_all, wait_until
from p2pswarm.model.slicer import slice_experts


@pytest.mark.slow
def test_worker_stopped_cleanly_stores_its_last_receipt(tiny_f32, tmp_path):
    env = dict(os.environ, P2PSWARM_KERNEL="numpy", P2PSWARM_HOME=str(tmp_path / "home"))
    slice_experts(tiny_f32, tmp_path / "s.gguf", None, (0, 16))
    procs: list[Proc] = []
    try:
        boot = Proc(["bootstrap", "--listen", "/ip4/127.0.0.1/tcp/0", "--identity", str(tmp_path / "boot.key")],
                    tmp_path / "boot.log", env)
        procs.append(boot)
        worker = Proc(["node", "--role", "worker", "--shard", str(tmp_path / "s.gguf"), "--bootstrap", boot.addr,
                       "--identity", str(tmp_path / "w.key"), "--receipts-dir", str(tmp_path / "rc")],
                      tmp_path / "w.log", env)
        procs.append(worker)
        bb = Proc(["node", "--role", "backbone", "--model", str(tiny_f32), "--bootstrap", boot.addr, "--http",
                   "127.0.0.1:0", "--receipt-period", "3600", "--identity", str(tmp_path / "bb.key")],
                  tmp_path / "bb.log", env)
        procs.append(bb)
        base = next(w for w in bb.ready if w.startswith("http="))[5:]
        wait_until(lambda: httpx.get(base + "/v1/swarm", timeout=10).json()["workers"], timeout=60, what="worker")
        r = httpx.post(base + "/v1/completions", json={"prompt": "The swarm", "max_tokens": 8}, timeout=60)
        assert r.status_code == 200, r.text
        assert httpx.get(base + "/health", timeout=10).json()["fallbacks"] == 0
        assert worker.stop(signal.SIGTERM) == 0
        log = worker.text()
        assert "stored 1 last receipts from 1 backbones" in log, log[-3000:]
        assert "handed worker" in bb.text()
        out = run_cli("rewards", "--dir", str(tmp_path / "rc"), "--json", env=env, check=True).stdout
        report = json.loads(out.strip().splitlines()[-1])
        assert report["ok"] and len(report["chains"]) == 1, report
        assert report["chains"][0]["rows"] > 0 and report["chains"][0]["receipts"] == 1, report
    finally:
        stop_all([p.proc for p in procs])
