"""A worker the backbone does not use is told why: its log and its /health say
"refused" with the backbone's reason, instead of "serving" for ever. Real processes: a bootstrap, a
worker whose block size is not the backbone's, and a backbone; then a worker the backbone does use,
whose /health says "serving"."""
from __future__ import annotations

import json
import os
import urllib.request

import pytest

from helpers.procs import Proc, stop_all, wait_until
from p2pswarm.model.slicer import slice_experts


def _health(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.load(r)


@pytest.mark.slow
def test_refused_worker_is_told_why(tiny_f32, tmp_path):
    env = dict(os.environ, P2PSWARM_KERNEL="numpy", P2PSWARM_HOME=str(tmp_path / "home"))
    slice_experts(tiny_f32, tmp_path / "s.gguf", None, (0, 8))
    procs: list[Proc] = []
    try:
        boot = Proc(["bootstrap", "--listen", "/ip4/127.0.0.1/tcp/0", "--identity", str(tmp_path / "boot.key")],
                    tmp_path / "boot.log", env)
        procs.append(boot)

        def worker(name: str, *extra: str) -> Proc:
            w = Proc(["node", "--role", "worker", "--shard", str(tmp_path / "s.gguf"), "--bootstrap", boot.addr,
                      "--identity", str(tmp_path / f"{name}.key"), "--health", "127.0.0.1:0", *extra],
                     tmp_path / f"{name}.log", env)
            procs.append(w)
            assert w.health and w.health.endswith("/health"), w.ready
            return w

        odd = worker("odd", "--block-size", "4")  # the backbone's is 8 (the default): it cannot use this record
        good = worker("good")
        assert _health(odd.health)["status"] == "serving"  # nobody has refused it yet
        procs.append(Proc(["node", "--role", "backbone", "--model", str(tiny_f32), "--bootstrap", boot.addr,
                           "--http", "off", "--identity", str(tmp_path / "bb.key")], tmp_path / "bb.log", env))
        odd.wait_log("does not use this worker", timeout=60)
        line = next(ln for ln in odd.text().splitlines() if "does not use this worker" in ln)
        assert "block size" in line, line
        h = wait_until(lambda: (x := _health(odd.health))["refused_by"] and x, timeout=10, what="refusal in /health")
        assert h["status"] == "refused", h
        assert "block size" in next(iter(h["refused_by"].values())), h
        # the worker the backbone uses is told nothing and says "serving"
        g = _health(good.health)
        assert g["status"] == "serving" and not g["refused_by"], g
        assert "does not use this worker" not in good.text()
    finally:
        stop_all([p.proc for p in procs])
