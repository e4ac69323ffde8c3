"""A libp2p implementation we did not write (js-libp2p 3.x, from the npm registry) uses our swarm.

Our processes: a relay (`p2pswarm relay --open`, also a DHT bootstrap), a worker that joins
through it directly and advertises its coverage units, and a worker behind the relay (reachable
only by a circuit). The js node (tests/js/interop.mjs, pinned in tests/js/package-lock.json) dials,
identifies and pings the worker, finds the providers of one of its units through our Kademlia
protocol id, makes a reservation on our relay, and identifies the relayed worker over a circuit --
which failed before py-libp2p's bogus observed address was fixed (js-libp2p dropped the whole
identify message and never learnt the worker's protocols).

The test installs the npm packages itself (`npm ci` in tests/js, once); Node 20 needs
`--experimental-websocket` and a `Promise.withResolvers` polyfill (in the script).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from p2pswarm.model.layout import ModelLayout
from p2pswarm.model.manifest import model_fingerprint
from p2pswarm.model.slicer import slice_experts
from p2pswarm.net.libp2p.kad_patches import KAD_PROTOCOL
from p2pswarm.net.libp2p.addrs import circuit_addr
from p2pswarm.net.wire.expert_protocol import PROTOCOL_EXPERT
from p2pswarm.net.signed.records import DEFAULT_BLOCK_SIZE, CoverageUnit

from helpers.procs import Proc, get_health, start_relay, worker_args
from system_tools import require

JS = Path(__file__).parent / "js"


@pytest.fixture
def env(tmp_path):
    return dict(os.environ, P2PSWARM_KERNEL="numpy", P2PSWARM_HOME=str(tmp_path / "home"), PYTHONUNBUFFERED="1")


def _node_cmd() -> list[str]:
    """node (with the flag Node 20 needs), js-libp2p installed from tests/js/package-lock.json first."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        require("node", "npm")
    if not (JS / "node_modules" / "libp2p").is_dir():
        proc = subprocess.run([npm, "ci", "--no-audit", "--no-fund", "--loglevel=error"], cwd=JS,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"npm ci in tests/js failed: {proc.stderr[-2000:]}"
    major = int(subprocess.run([node, "--version"], capture_output=True, text=True).stdout.lstrip("v").split(".")[0])
    return [node, "--experimental-websocket"] if major < 22 else [node]


@pytest.mark.slow
def test_js_libp2p_dials_identifies_pings_finds_providers_and_reserves(tiny_f32, tmp_path, env):
    cmd = _node_cmd()
    relay = start_relay(tmp_path, env)
    procs = [relay]
    try:
        shard = tmp_path / "shard.gguf"
        slice_experts(tiny_f32, shard, None, (0, 8))
        direct = Proc(["node", "--role", "worker", "--shard", str(shard), "--bootstrap", relay.addr,
                       "--identity", str(tmp_path / "direct.key"), "--ttl", "120"], tmp_path / "direct.log", env)
        procs.append(direct)
        relayed = Proc(worker_args(tmp_path, shard, relay.addr, "relayed"), tmp_path / "relayed.log", env)
        procs.append(relayed)
        direct.wait_log("reached the DHT")
        unit = CoverageUnit(model_fingerprint(ModelLayout.open(tiny_f32)), 0, 0, DEFAULT_BLOCK_SIZE)
        cfg = {"bootstrap": relay.addr, "worker": direct.addr, "unitKey": unit.key().hex(), "relay": relay.addr,
               "relayedWorker": relayed.addr, "provider": direct.addr.split("/p2p/")[-1], "kadProtocol": str(KAD_PROTOCOL),
               "expertProtocol": str(PROTOCOL_EXPERT)}
        proc = subprocess.run([*cmd, str(JS / "interop.mjs"), json.dumps(cfg)], capture_output=True, text=True,
                              timeout=180, cwd=JS)
        assert proc.returncode == 0, proc.stderr[-3000:]
        seen = json.loads(proc.stdout.strip().splitlines()[-1])
        print(json.dumps(seen, indent=1))
        assert seen["errors"] == [], seen["errors"]
        assert str(PROTOCOL_EXPERT) in seen["workerProtocols"]
        assert str(KAD_PROTOCOL) in seen["bootstrapProtocols"]
        assert seen["pingMs"] >= 0
        assert direct.addr.split("/p2p/")[-1] in seen["providers"]
        assert any(a.startswith(relay.addr) and a.endswith(seen["peerId"]) for a in seen["reservation"])
        assert relayed.addr == circuit_addr(relay.addr, relayed.addr.split("/p2p/")[-1])
        assert str(PROTOCOL_EXPERT) in seen["relayedWorkerProtocols"]  # identify over the circuit
        assert str(PROTOCOL_EXPERT) in seen["relayedIdentify"]["protocols"]
        assert seen["relayedIdentify"]["observedAddr"] is None  # no made-up circuit address
        assert get_health(relay.health)["reservations"] >= 2  # the relayed worker's and the js node's
    finally:
        for p in reversed(procs):
            p.stop()
    for p in procs:
        assert "Traceback" not in p.text(), p.text()[-3000:]
