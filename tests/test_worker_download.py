"""A worker with no shard file: `node --role worker --model FINGERPRINT --layers --experts --token`
downloads its slice from the backbone (found through the DHT) and then serves it. Real processes."""
from __future__ import annotations

import os

import numpy as np
import pytest

from conftest import run_cli
from helpers.procs import Proc
from p2pswarm.model.layout import ModelLayout
from p2pswarm.model.manifest import source_fingerprint
from p2pswarm.model.slicer import slice_experts

TOKENS = "5,17,42,99,100,7,256,300,12,64,128,31,2,77,500,9,33"  # 17 tokens: prefill + 16 decode steps


@pytest.mark.slow
def test_worker_downloads_its_slice_then_serves_it(tiny_f32, tmp_path):
    env = dict(os.environ, P2PSWARM_KERNEL="numpy", P2PSWARM_HOME=str(tmp_path / "home"))
    fp = source_fingerprint(ModelLayout.open(tiny_f32))
    issuer_key = tmp_path / "issuer.key"
    issuer = run_cli("identity", "--path", str(issuer_key), env=env, check=True).stdout.split()[-1]
    worker_id = run_cli("identity", "--path", str(tmp_path / "w.key"), env=env, check=True).stdout.split()[-1]
    manifest = tmp_path / "tiny.manifest"
    run_cli("manifest", "--model", str(tiny_f32), "--key", str(issuer_key), "--out", str(manifest), env=env,
            check=True)
    token = tmp_path / "w.token"
    run_cli("token", "issue", "--key", str(issuer_key), "--peer", worker_id, "--allow", f"shard:{fp}:0-3:8-15",
            "--ttl", "1h", "--out", str(token), env=env, check=True)
    nodes: list[Proc] = []
    try:
        boot = Proc(["bootstrap", "--listen", "/ip4/127.0.0.1/tcp/0", "--identity", str(tmp_path / "boot.key")],
                    tmp_path / "boot.log", env)
        nodes.append(boot)
        backbone = Proc(["node", "--role", "backbone", "--model", str(tiny_f32), "--manifest", str(manifest),
                         "--bootstrap", boot.addr, "--http", "off", "--identity", str(tmp_path / "bb.key")],
                        tmp_path / "backbone.log", env)
        nodes.append(backbone)
        # wrong range for the token: refused by the shard server, the worker exits with one line
        proc = run_cli("node", "--role", "worker", "--model", fp, "--layers", "0-3", "--experts", "0-7",
                       "--token", str(token), "--trust-issuer", issuer, "--bootstrap", boot.addr,
                       "--identity", str(tmp_path / "w.key"), env=env, timeout=120)
        assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert "does not allow" in proc.stderr or "refused" in proc.stderr, proc.stderr[-2000:]
        worker = Proc(["node", "--role", "worker", "--model", fp, "--layers", "0-3", "--experts", "8-15",
                       "--token", str(token), "--trust-issuer", issuer, "--bootstrap", boot.addr,
                       "--identity", str(tmp_path / "w.key")], tmp_path / "worker.log", env)
        nodes.append(worker)
        log = worker.log.read_text()
        assert "downloaded slice" in log, log[-2000:]
        downloaded = tmp_path / "home" / "shards" / f"{fp[:16]}-L0-3-E8-15.gguf"
        sliced = tmp_path / "sliced.gguf"
        slice_experts(tiny_f32, sliced, None, (8, 16))
        assert downloaded.read_bytes() == sliced.read_bytes()
        out, mono = tmp_path / "swarm.npy", tmp_path / "mono.npy"
        proc = run_cli("logits", str(tiny_f32), "--tokens", TOKENS, "--out", str(out), "--swarm", boot.addr,
                       "--kernel", "numpy", env=env, check=True)
        assert " 0 fallbacks" in proc.stdout
        run_cli("logits", str(tiny_f32), "--tokens", TOKENS, "--out", str(mono), "--kernel", "numpy", env=env,
                check=True)
        assert np.array_equal(np.load(mono), np.load(out))
        # restarted: the complete slice is reused, nothing fetched again
        assert worker.stop() == 0
        again = Proc(["node", "--role", "worker", "--model", fp, "--layers", "0-3", "--experts", "8-15",
                      "--token", str(token), "--trust-issuer", issuer, "--bootstrap", boot.addr,
                      "--identity", str(tmp_path / "w.key")], tmp_path / "worker2.log", env)
        nodes.append(again)
        assert "already complete and verified" in again.log.read_text()
    finally:
        for n in reversed(nodes):
            n.stop()
