"""A worker behind a NAT, reachable only through a relay, whose re-published DHT records never reach
the backbone, stays in the backbone's coverage map and keeps serving while it answers on its open
connection (bench/soak.py found NATed workers leaving the map with no fault at all, and one took
126 s to be found again after a slowed link: its records reach the DHT only through the relay, and
under load the backbone's look-ups missed them).

Real processes: a bootstrap, a relay, the backbone, and the worker in a network namespace whose
nftables let nothing in and nothing out but the relay's WebSocket (tests/helpers/netns.py). The
worker is the real ``node --role worker`` wrapped by tests/helpers/quiet_record_worker.py: once the
backbone uses it, every re-publication of its record (``--ttl 8``) is dropped, so 8 s later the
DHT holds only an expired record of it. The backbone must keep it until a request fails, not drop
it at its next coverage refresh (every 30 s) and fall back to its local replica. Needs root,
``ip`` and ``nft`` (fails, never skips, without them)."""
from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import pytest
from helpers.netns import Netns
from helpers.procs import Proc, free_port
from system_tools import require

from p2pswarm.model.slicer import slice_experts

pytestmark = pytest.mark.slow

HELPER = Path(__file__).parent / "helpers" / "quiet_record_worker.py"


def _chat(base: str) -> None:
    r = httpx.post(base + "/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200, r.text


def test_a_natted_worker_whose_records_are_missed_stays_in_service(tiny_f32, tmp_path):
    require("ip", "nft")
    if os.geteuid() != 0:
        pytest.fail("the NAT's network namespace needs root", pytrace=False)
    env = dict(os.environ, P2PSWARM_KERNEL="numpy", P2PSWARM_HOME=str(tmp_path / "home"), PYTHONUNBUFFERED="1")
    shard = tmp_path / "shard.gguf"
    slice_experts(tiny_f32, shard, None, (0, 16))
    ns = Netns(f"{os.getpid()}9", (os.getpid() * 7 + 9) % 250, net_hi=234).create()
    procs: list[Proc] = []
    try:
        boot = Proc(["bootstrap", "--listen", "/ip4/127.0.0.1/tcp/0", "--identity", str(tmp_path / "boot.key")],
                    tmp_path / "boot.log", env)
        procs.append(boot)
        ws = free_port(ns.host_ip)
        relay = Proc(["relay", "--listen", f"/ip4/127.0.0.1/tcp/{free_port()}", "--listen",
                      f"/ip4/{ns.host_ip}/tcp/{ws}/ws", "--open", "--identity", str(tmp_path / "relay.key"),
                      "--bootstrap", boot.addr], tmp_path / "relay.log", env)
        procs.append(relay)
        ns.nat([(ns.host_ip, ws)])
        relay_id = relay.addr.rsplit("/p2p/", 1)[1]
        quiet = tmp_path / "quiet"
        worker = Proc([str(HELPER), "--quiet-when", str(quiet), "node", "--role", "worker", "--shard", str(shard), "--ttl", "8",
                       "--relay", f"/ip4/{ns.host_ip}/tcp/{ws}/ws/p2p/{relay_id}",
                       "--listen", f"/ip4/{ns.ns_ip}/tcp/{free_port()}", "--identity", str(tmp_path / "w.key")],
                      tmp_path / "worker.log", env, prefix=ns.prefix, entry=())
        procs.append(worker)
        assert "/p2p-circuit/" in worker.addr
        peer = worker.addr.rsplit("/p2p/", 1)[1]
        backbone = Proc(["node", "--role", "backbone", "--model", str(tiny_f32), "--bootstrap", boot.addr,
                         "--http", "127.0.0.1:0", "--timeout", "5", "--served-model-name", "tiny",
                         "--identity", str(tmp_path / "backbone.key")], tmp_path / "backbone.log", env)
        procs.append(backbone)
        base = next(w for w in backbone.ready if w.startswith("http="))[5:].replace("0.0.0.0", "127.0.0.1")

        def state() -> tuple[dict | None, dict, int]:
            sw = httpx.get(base + "/v1/swarm", timeout=30).json()
            me = next((w for w in sw["workers"] if w["peer"] == peer), None)
            return me, sw["resolver"], httpx.get(base + "/health", timeout=30).json()["fallbacks"]

        deadline = time.monotonic() + 90  # found through the relay (its first record), then used
        while True:
            _chat(base)
            me, _, _ = state()
            if me is not None and me["state"] == "live" and me["requests"] > 0:
                break
            assert time.monotonic() < deadline, f"the worker was never used: {me}"
            time.sleep(1)
        assert me["relayed"], me  # nothing reaches it but through the relay
        quiet.touch()  # from now on its records are not re-published: the last one expires within 8 s
        _, resolver, fallbacks0 = state()
        # Requests keep the connection answering while the backbone refreshes its map twice
        # (every 30 s); its last record expires in the DHT within 8 s of the cue.
        refreshes0, t0 = resolver["refreshes"], time.monotonic()
        while resolver["refreshes"] < refreshes0 + 2 or resolver["vouched"] == 0:
            assert time.monotonic() - t0 < 120, f"no refresh kept the worker: {resolver}"
            _chat(base)
            me, resolver, fallbacks = state()
            assert me is not None, f"the worker left the backbone's map: {backbone.text()[-3000:]}"
            assert fallbacks == fallbacks0, f"the backbone fell back to its replica: {backbone.text()[-3000:]}"
            time.sleep(0.5)
        used = me["requests"]
        for _ in range(3):
            _chat(base)
        me, resolver, fallbacks = state()
        assert me["state"] == "live" and me["requests"] > used and fallbacks == fallbacks0, (me, fallbacks)
        assert "left the coverage map" not in backbone.text()
        assert "re-publication" in worker.text() and "dropped" in worker.text()  # its records really went stale
    finally:
        for p in reversed(procs):
            p.stop()
        ns.delete()
