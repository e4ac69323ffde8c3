"""Relay scale-out as OS processes: relays share nothing but the DHT (p2pswarm/net/libp2p/relay_discovery.py).

Two relay processes (the second bootstraps from the first); a worker behind them is given only the
first. Killed with SIGKILL, the first relay takes the worker's reservation with it: the worker finds
the second relay through the DHT, reserves there, re-publishes its record with the new circuit
address, and a backbone that joins through the second relay computes through it, bit-equal to the
monolithic run with no fallback. And `--relay auto` finds a relay with only a bootstrap address.
"""
from __future__ import annotations

import os
import signal

import numpy as np
import pytest
from conftest import run_cli

from p2pswarm.model.slicer import slice_experts
from p2pswarm.net.libp2p.addrs import circuit_addr
from p2pswarm.net.signed.identity import load_or_create_identity
from p2pswarm.net.signed.tokens import issue_token

from helpers.procs import Proc, get_health, start_relay, worker_args, worker_identity

pytestmark = pytest.mark.slow
TOKENS = "5,17,42,99,100,7,256,300,12,64,128,31"


@pytest.fixture
def env(tmp_path):
    return dict(os.environ, P2PSWARM_KERNEL="numpy", P2PSWARM_HOME=str(tmp_path / "home"), PYTHONUNBUFFERED="1")


def test_worker_moves_to_another_relay_found_in_the_dht(tiny_f32, tmp_path, env):
    issuer = load_or_create_identity(tmp_path / "issuer.key")
    a = start_relay(tmp_path, env, issuer=issuer, name="relay-a")
    b = start_relay(tmp_path, env, issuer=issuer, name="relay-b", extra=["--bootstrap", a.addr])
    procs = [a, b]
    try:
        b.wait_log("advertised this relay")
        shard = tmp_path / "shard.gguf"
        slice_experts(tiny_f32, shard, None, (0, 16))
        ident = worker_identity(tmp_path, "w0")
        token = issue_token(issuer, ident.peer_id_str, ["relay"], 3600).encode()
        worker = Proc(worker_args(tmp_path, shard, a.addr, "w0", token), tmp_path / "w0.log", env)
        procs.append(worker)
        assert worker.addr == circuit_addr(a.addr, ident.peer_id_str)
        a.stop(signal.SIGKILL)
        worker.wait_log("moved to relay", timeout=90)
        worker.wait_log("re-published my records", timeout=60)
        assert b.addr.split("/p2p/")[-1] in [ln for ln in worker.text().splitlines() if "moved to relay" in ln][0]
        assert get_health(b.health)["reservations"] == 1
        mono, swarm = tmp_path / "mono.npy", tmp_path / "swarm.npy"
        run_cli("logits", str(tiny_f32), "--tokens", TOKENS, "--out", str(mono), "--kernel", "numpy", env=env,
                check=True)
        proc = run_cli("logits", str(tiny_f32), "--tokens", TOKENS, "--out", str(swarm), "--swarm", b.addr,
                       "--kernel", "numpy", env=env, check=True)
        assert " 0 fallbacks" in proc.stdout, proc.stdout
        assert int(proc.stdout.split(" expert requests")[0].split()[-1]) > 0
        assert np.array_equal(np.load(mono), np.load(swarm))
        assert get_health(b.health)["circuits_opened"] >= 1  # the backbone dialled it through relay b

        # --relay auto: only a bootstrap address; the DHT names the relay
        w1 = worker_identity(tmp_path, "w1")
        token1 = issue_token(issuer, w1.peer_id_str, ["relay"], 3600).encode()
        auto = Proc(worker_args(tmp_path, shard, "auto", "w1", token1, extra=["--bootstrap", b.addr]),
                    tmp_path / "w1.log", env)
        procs.append(auto)
        assert auto.addr == circuit_addr(b.addr, w1.peer_id_str)
    finally:
        for p in reversed(procs):
            p.stop()
    for p in procs[1:]:
        assert "Traceback" not in p.text(), p.text()[-3000:]
