"""The swarm as real OS processes on 127.0.0.1: a bootstrap node, four worker nodes (two of them
replicas of the same expert range) and backbones (`p2pswarm logits --swarm`, `swarm-status`),
finding each other only through the libp2p DHT."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import trio

from p2pswarm.model.slicer import slice_experts

from conftest import run_cli
from helpers.procs import Proc, assert_swarm_logits_exact, start_bootstrap, start_shard_workers, wait_until

TOKENS = "5,17,42,99,100,7,256,300,12,64,128,31,2,77,500,9,33"  # 17 tokens: prefill + 16 decode steps
RANGES = [(0, 6), (6, 11), (11, 16), (0, 6)]  # the last worker is a replica of the first


@pytest.fixture
def swarm(tiny_f32, tmp_path):
    # DEBUG: workers log each request they compute (the tests check who served when)
    env = dict(os.environ, P2PSWARM_KERNEL="numpy", P2PSWARM_HOME=str(tmp_path / "home"), P2PSWARM_LOG_LEVEL="DEBUG")
    boot, workers = None, []
    try:
        boot = start_bootstrap(tmp_path, env)
        workers += start_shard_workers(tiny_f32, tmp_path, env, RANGES, boot.addr, extra=["--ttl", "120"])
        yield boot, workers, env  # a test appends the processes it starts itself: stopped here too
    finally:
        for n in reversed(workers):
            n.stop()
        if boot is not None:
            boot.stop()


@pytest.mark.slow
def test_logits_through_the_swarm_equal_monolithic(tiny_f32, tmp_path, swarm):
    boot, workers, env = swarm
    # A one-shot look-up right after the workers' READY can miss a node record on a loaded machine
    # (one CI-like run saw a peer as "no node record found"; the next refresh finds it): poll.
    def all_live() -> dict | None:
        status = run_cli("swarm-status", "--bootstrap", boot.addr, "--model", str(tiny_f32), "--kernel", "numpy",
                         "--json", env=env, check=True)
        st = json.loads(status.stdout.strip().splitlines()[-1])
        ok = st["missing"] == 0 and [p["status"] for p in st["peers"].values()] == ["live"] * 4
        return st if ok else None

    st = wait_until(all_live, timeout=60, interval=1, what="every unit covered and all four workers live")
    # block 0 (experts 0-7): experts 0-5 held by workers 0 and 3 (replicas), 6-7 by worker 1 alone;
    # block 1: 8-10 by worker 1, 11-15 by worker 2. A block counts its least-covered expert: 1, 1.
    assert [st["replicas"][f"{layer}/{b}"] for layer in st["layers"] for b in (0, 1)] == [1, 1] * len(st["layers"])
    for decode in (False, True):
        assert_swarm_logits_exact(tiny_f32, TOKENS, boot.addr, tmp_path, env, decode=decode)
    # a clean shutdown withdraws the worker's records
    assert workers[1].stop() == 0
    assert "withdrew my records" in workers[1].log.read_text()


@pytest.mark.slow
def test_killed_worker_is_covered_by_replica_and_fallback(tiny_f32, tmp_path, swarm):
    boot, workers, env = swarm
    workers[0].stop(signal.SIGKILL)  # no withdrawal: its records linger until they expire
    out, mono = tmp_path / "swarm.npy", tmp_path / "mono.npy"
    proc = run_cli("logits", str(tiny_f32), "--tokens", TOKENS, "--out", str(out), "--swarm", boot.addr,
                   "--kernel", "numpy", "--decode", "--timeout", "5", "--json", env=env, check=True)
    run_cli("logits", str(tiny_f32), "--tokens", TOKENS, "--out", str(mono), "--kernel", "numpy", "--decode",
            env=env, check=True)
    assert np.array_equal(np.load(mono), np.load(out))
    assert "Traceback" not in proc.stderr
    # The workers computed, not the fallback: the one request sent to the dead worker (its record
    # lingers) falls back, then it is avoided for its 30 s back-off and its experts 0-5 go to its
    # replica (workers[3]). Every expert falling back would be >= 1 fallback per layer and step.
    stats = json.loads(proc.stdout)
    assert stats["fallbacks"] <= 1 and stats["requests"] >= stats["layers"], stats  # a request per layer step
    assert stats["remote_groups"] > stats["local_groups"], stats
    assert "computed layer" in workers[3].text(), workers[3].text()[-1500:]


def _long_tokens(n: int) -> str:
    return ",".join(str((i * 37 + 11) % 500) for i in range(n))


@pytest.mark.slow
def test_worker_killed_mid_generation_then_restarted_is_found_again(tiny_f32, tmp_path, swarm):
    """kill -9 of workers in the middle of a decode run: the run completes bit-equal, the backbone
    logs the fallback, the replica serves later steps, and the worker restarted (same identity, a new
    port) is found again through the DHT and used."""
    boot, workers, env = swarm
    tokens = _long_tokens(500)  # the tiny model's context is 512
    denv = env
    out, mono = tmp_path / "swarm.npy", tmp_path / "mono.npy"
    backbone = subprocess.Popen(
        [sys.executable, "-m", "p2pswarm.cli", "logits", str(tiny_f32), "--tokens", tokens, "--out", str(out),
         "--swarm", boot.addr, "--kernel", "numpy", "--decode", "--timeout", "5", "--refresh", "0.5"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, env=denv)
    lines: list[str] = []
    steps: dict[int, threading.Event] = {n: threading.Event() for n in (10, 30)}

    def read_stderr() -> None:
        for line in backbone.stderr:
            lines.append(line)
            if "decode step " in line:
                done = int(line.split("decode step ")[1].split("/")[0])
                for n, ev in steps.items():
                    if done >= n:
                        ev.set()

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    restarted = None
    try:
        assert steps[10].wait(120), "".join(lines[-30:])
        # mid-generation: workers[1] is the only owner of experts 6-10 (a fallback is certain);
        # workers[0]'s experts 0-5 are replicated by workers[3]
        workers[1].stop(signal.SIGKILL)
        workers[0].stop(signal.SIGKILL)
        killed_at = time.time()
        assert steps[30].wait(120), "".join(lines[-30:])
        # Hold the backbone while the worker comes back on a new port with the same identity, until
        # a fresh look-up finds its new record: the run (~50 tokens/s once resumed) cannot end
        # before the record is there to be found (it once did, with only READY awaited). What is
        # left of the run after the resume (~470 steps, 5-10 s) must still hold one of the
        # backbone's own refreshes reading that record: every 0.5 s (one run of the suite at 1 s
        # ended without it, once in ~20 runs).
        backbone.send_signal(signal.SIGSTOP)
        try:
            restarted = Proc(["node", "--role", "worker", "--shard", str(tmp_path / "shard0.gguf"),
                              "--bootstrap", boot.addr, "--identity", str(tmp_path / "w0.key"), "--ttl", "120"],
                             tmp_path / "w0-restarted.log", env)
            workers.append(restarted)  # stopped by the fixture whatever happens here
            peer, new_addr = restarted.addr.split("/p2p/")[1], restarted.addr.split("/p2p/")[0]

            def found_again() -> bool:
                proc = run_cli("swarm-status", "--bootstrap", boot.addr, "--model", str(tiny_f32), "--kernel",
                               "numpy", "--json", "--no-probe", env=env, timeout=120)
                st = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else {}
                return any(a.startswith(new_addr) for a in st.get("peers", {}).get(peer, {}).get("addrs", []))

            wait_until(found_again, timeout=60, interval=1, what="the restarted worker's new record in a look-up")
        finally:
            backbone.send_signal(signal.SIGCONT)
        assert restarted.addr != workers[0].addr  # same peer id, new port
        assert peer == workers[0].addr.split("/p2p/")[1]
        backbone.wait(timeout=300)  # not communicate(): the reader thread owns stderr
        reader.join(10)
    finally:
        if backbone.poll() is None:
            backbone.kill()
    log_text = "".join(ln for ln in lines if " p2pswarm" in ln or "Traceback" in ln or not ln[:4].isdigit())
    (tmp_path / "backbone.log").write_text(log_text)
    assert backbone.returncode == 0, log_text[-3000:]
    assert "fell back to the local replica" in log_text
    # on failure: what the resolver read after the resume (decode steps and dial noise left out)
    told = [ln for ln in log_text.splitlines() if "decode step" not in ln and "kad rpc to" not in ln]
    assert "is back (new record, new address)" in log_text, "\n".join(told[-60:])
    run_cli("logits", str(tiny_f32), "--tokens", tokens, "--out", str(mono), "--kernel", "numpy", "--decode",
            env=env, check=True)
    assert np.array_equal(np.load(mono), np.load(out))
    # the replica served after the kill; the restarted worker served after its return
    assert restarted.stop() == 0 and workers[3].stop() == 0
    served = [ln for ln in restarted.log.read_text().splitlines() if " served " in ln]
    assert served and int(served[-1].split(" served ")[1].split()[0]) > 0, restarted.log.read_text()[-1500:]
    computed_after = [ln for ln in workers[3].log.read_text().splitlines()
                      if "computed layer" in ln and _log_time(ln) > killed_at]
    assert computed_after, workers[3].log.read_text()[-1500:]


def _log_time(line: str) -> float:
    """The wall-clock time of one of our log lines ("2026-11-29 13:02:15,210 name LEVEL ...")."""
    import datetime

    stamp = " ".join(line.split()[:2])
    return datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


@pytest.mark.slow
def test_worker_of_another_model_is_refused_at_the_handshake(tiny_f32, tmp_path):
    """Two wrong-model workers: one honest (its record names its real model: the backbone never even
    dials it) and one whose signed record claims our model (the backbone dials it, and both sides
    refuse at the handshake, each logging the reason). Output stays exact on the local replica."""
    from p2pswarm.model.manifest import source_fingerprint
    from p2pswarm.model.layout import ModelLayout
    from p2pswarm.model.synth import make_model

    other = tmp_path / "other.gguf"
    make_model(other, preset="tiny", qtype="f32", seed=99)  # same shapes, other weights
    ours_fp = source_fingerprint(ModelLayout.open(tiny_f32))
    assert source_fingerprint(ModelLayout.open(other)) != ours_fp
    shard = tmp_path / "other-shard.gguf"
    slice_experts(other, shard, None, (0, 16))
    env = dict(os.environ, P2PSWARM_KERNEL="numpy", P2PSWARM_HOME=str(tmp_path / "home"))
    nodes: list[Proc] = []
    try:
        boot = Proc(["bootstrap", "--listen", "/ip4/127.0.0.1/tcp/0", "--identity", str(tmp_path / "boot.key")],
                    tmp_path / "boot.log", env)
        nodes.append(boot)
        honest = Proc(["node", "--role", "worker", "--shard", str(shard), "--bootstrap", boot.addr,
                       "--identity", str(tmp_path / "honest.key")], tmp_path / "honest.log", env)
        nodes.append(honest)
        liar = Proc([str(Path(__file__).parent / "helpers" / "lying_worker.py"), "--shard", str(shard),
                     "--claim-model", ours_fp, "--bootstrap", boot.addr, "--identity", str(tmp_path / "liar.key")],
                    tmp_path / "liar.log", env, entry=())
        nodes.append(liar)
        out, mono = tmp_path / "swarm.npy", tmp_path / "mono.npy"
        proc = run_cli("logits", str(tiny_f32), "--tokens", TOKENS, "--out", str(out), "--swarm", boot.addr,
                       "--kernel", "numpy", "--decode", env=env, check=True)
        run_cli("logits", str(tiny_f32), "--tokens", TOKENS, "--out", str(mono), "--kernel", "numpy", "--decode",
                env=env, check=True)
        assert np.array_equal(np.load(mono), np.load(out))
        # the backbone: refused by the worker, with the worker's reason, then fell back - once: the
        # refused worker holds nothing until its record changes, not one fallback per decode step
        assert "refused the handshake: model mismatch" in proc.stderr, proc.stderr[-3000:]
        liar_id = liar.addr.split("/p2p/")[1]
        refusals = [ln for ln in proc.stderr.splitlines() if f"refused worker {liar_id} at the handshake" in ln]
        assert len(refusals) == 1 and "model mismatch" in refusals[0], proc.stderr[-3000:]
        assert proc.stderr.count("fell back to the local replica") == 1, proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr
        # the liar: refused our hello, with the reason; computed nothing
        assert liar.stop() == 0
        liar_log = liar.log.read_text()
        assert "at handshake: model mismatch" in liar_log, liar_log[-2000:]
        assert "served 0 requests" in liar_log
        # the honest worker of the other model was never dialled
        assert honest.stop() == 0
        honest_log = honest.log.read_text()
        assert "at handshake:" not in honest_log and "served 0 expert requests" in honest_log, honest_log[-2000:]
    finally:
        for n in reversed(nodes):
            n.stop()


@pytest.mark.slow
async def test_malformed_frames_and_forged_records_against_node_processes(tiny_f32, tmp_path, swarm):
    """Against the node processes: malformed and oversized frames on the expert protocol close
    only their stream (the worker logs why and keeps serving); a forged record is refused by the
    bootstrap process, and forged or malformed copies served by a rogue DHT node are ignored by
    the backbone, which still computes bit-equal with no fallback."""
    import struct

    import msgpack
    import trio

    from libp2p.kad_dht.utils import sort_peer_ids_by_distance
    from libp2p.peer.id import ID
    from libp2p.records.record import make_signed_put_record

    from p2pswarm.market.swarm_dht import open_dht
    from p2pswarm.net.wire.expert_protocol import PROTOCOL_EXPERT
    from p2pswarm.net.libp2p.host import open_host
    from p2pswarm.net.signed.identity import Identity, load_identity
    from p2pswarm.net.signed.records import SIGNING_DOMAIN, NodeRecord, ShardEntry, node_record_key

    boot, workers, env = swarm
    bad_frames = [struct.pack("!Q", 5) + b"\xc1" * 5, struct.pack("!Q", 3) + msgpack.packb([1, 2]),
                  struct.pack("!Q", 1 << 62) + b"x", struct.pack("!Q", 10) + b"short"]
    victim = load_identity(tmp_path / "w1.key").peer_id_str
    key = node_record_key(victim).encode()
    # The rogue is the node closest to the victim's record key: every look-up of it asks the rogue.
    others = [ID.from_base58(n.addr.split("/p2p/")[1]) for n in (boot, *workers)]
    while True:
        rogue_id = Identity.generate()
        if sort_peer_ids_by_distance(key, [rogue_id.peer_id, *others])[0] == rogue_id.peer_id:
            break
    async with open_host(rogue_id) as net, open_dht(net, server=True, bootstrap=[boot.addr]) as dht:
        for frame in bad_frames:
            stream = await net.open_stream(workers[0].addr, PROTOCOL_EXPERT)
            await stream.send_all(frame)
            await stream.send_eof()
            with trio.fail_after(15):  # the worker answers with an error frame (or nothing) and closes
                while await stream.receive_some(65536):
                    pass
            await stream.aclose()
        # a record naming worker 1, signed by the rogue, with the rogue's address
        body = NodeRecord.make(rogue_id, addrs=net.addrs(), protocol=1, kernel="numpy", block_size=8,
                               shards=[ShardEntry("ab" * 32, "s", (0, 4), (0, 16))], ttl_s=60, seq=1 << 50).body()
        body["peer"] = victim
        raw = msgpack.packb(body)
        forged = msgpack.packb({"body": raw, "sig": rogue_id.sign(SIGNING_DOMAIN + raw)})
        boot_id = ID.from_base58(boot.addr.split("/p2p/")[1])
        record = make_signed_put_record(key, forged, net.host.get_private_key())
        await dht.kad.value_store._store_at_peer(boot_id, key, forged, record=record)
        for bogus in (forged, b"\x93garbage"):
            dht.kad.value_store.put(key, bogus)  # the rogue serves it to anyone who asks
            out, mono = tmp_path / "swarm.npy", tmp_path / "mono.npy"
            proc = await trio.to_thread.run_sync(lambda: run_cli(
                "logits", str(tiny_f32), "--tokens", TOKENS, "--out", str(out), "--swarm", boot.addr,
                "--kernel", "numpy", "--json", env=env, check=True))
            assert "ignored a DHT record" in proc.stderr, proc.stderr[-3000:]
            assert json.loads(proc.stdout)["fallbacks"] == 0, proc.stdout
    await trio.to_thread.run_sync(lambda: run_cli("logits", str(tiny_f32), "--tokens", TOKENS, "--out", str(mono),
                                                  "--kernel", "numpy", env=env, check=True))
    assert np.array_equal(np.load(mono), np.load(out))
    assert workers[0].log.read_text().count("closing connection from") >= 3
    for w in workers:
        assert w.proc.poll() is None  # every worker still up
    boot.stop()
    assert "refused to store a DHT record" in boot.log.read_text()


@pytest.mark.slow
def test_swarm_status_tells_the_truth(tiny_f32, tmp_path):
    """Workers holding experts 0-5, 6-10 and 11-15 (not aligned to the 8-expert blocks), one whose
    record names another kernel, one started with another block size. swarm-status counts each
    unit once (per expert, not per worker touching it), lists the other two as refused with the
    reason, and a backbone logs each refusal once over a run that refreshes twice a second. Two
    workers killed with SIGKILL are unreachable in the next swarm-status (human and JSON) although
    their records are still live, and one whose record's TTL (12 s) has run out is gone from the
    look-ups even without a probe."""
    from p2pswarm.model.layout import ModelLayout
    from p2pswarm.model.manifest import model_fingerprint

    short_ttl = 12
    fp = model_fingerprint(ModelLayout.open(tiny_f32))
    env = dict(os.environ, P2PSWARM_KERNEL="numpy", P2PSWARM_HOME=str(tmp_path / "home"), P2PSWARM_LOG_LEVEL="DEBUG")
    nodes: list[Proc] = []

    def worker(name: str, experts: tuple[int, int], *extra: str) -> Proc:
        shard = tmp_path / f"{name}.gguf"
        slice_experts(tiny_f32, shard, None, experts)
        node = Proc(["node", "--role", "worker", "--shard", str(shard), "--bootstrap", boot.addr,
                     "--identity", str(tmp_path / f"{name}.key"), *extra], tmp_path / f"{name}.log", env)
        nodes.append(node)
        return node

    def peer(node: Proc) -> str:
        return node.addr.split("/p2p/")[1]

    def status(*extra: str) -> str:
        proc = run_cli("swarm-status", "--bootstrap", boot.addr, "--model", str(tiny_f32), "--kernel", "numpy",
                       *extra, env=env, check=True)
        assert "Traceback" not in proc.stderr, proc.stderr
        return proc.stdout

    try:
        boot = Proc(["bootstrap", "--listen", "/ip4/127.0.0.1/tcp/0", "--identity", str(tmp_path / "boot.key")],
                    tmp_path / "boot.log", env)
        nodes.append(boot)
        with ThreadPoolExecutor(4) as pool:  # side by side: each start waits for its READY line
            started = [pool.submit(worker, "w0", (0, 6)), pool.submit(worker, "w1", (6, 11)),
                       pool.submit(worker, "w2", (11, 16), "--ttl", str(short_ttl)),
                       pool.submit(worker, "odd", (0, 16), "--block-size", "4")]
            w, odd = [f.result() for f in started[:3]], started[3].result()
        liar = Proc([str(Path(__file__).parent / "helpers" / "lying_worker.py"), "--shard", str(tmp_path / "odd.gguf"),
                     "--claim-kernel", "ggml-test/other-cpu", "--bootstrap", boot.addr,
                     "--identity", str(tmp_path / "liar.key")], tmp_path / "liar.log", env, entry=())
        nodes.append(liar)

        # Workers that start side by side may not all be in the first look-up's provider lists (the
        # start-up race of docs/benchmarks.md, "Coverage wait": each put its records while it knew
        # few peers), and on a loaded host a record read can fail (one suite run: the odd worker
        # "gone: no node record found"); a later look-up has them. Bounded: a worker that never
        # shows up, or shows up wrong, still fails below.
        def settled(st: dict) -> bool:
            seen = st["peers"]
            return st["missing"] == 0 and all(seen.get(peer(n), {}).get("status", "gone") != "gone"
                                               for n in (*w, liar, odd))

        deadline = time.monotonic() + 30
        while True:
            st = json.loads(status("--json").strip().splitlines()[-1])
            if settled(st) or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert st["model"] == fp and st["missing"] == 0, st
        assert set(st["replicas"].values()) == {1}, st["replicas"]
        peers = st["peers"]
        assert [peers[peer(n)]["status"] for n in w] == ["live"] * 3, peers
        assert all(peers[peer(n)]["shards"][0]["rtt_ms"] > 0 for n in w)
        # each worker's family, and the families it answers in (its hello): numpy, and portable on request
        assert all(peers[peer(n)]["family"] == "numpy" and peers[peer(n)]["answers_in"] == ["numpy", "portable-1"]
                   for n in w), peers
        assert peers[peer(liar)]["status"] == "refused"
        assert peers[peer(liar)]["reason"].startswith("kernel mismatch: worker computes with 'ggml-test/other-cpu'")
        assert peers[peer(odd)]["status"] == "refused"
        assert peers[peer(odd)]["reason"].startswith("block size mismatch: worker provides units of 4 experts")

        # A backbone refreshing twice a second logs each refusal once, with the whole peer id.
        proc = run_cli("logits", str(tiny_f32), "--tokens", _long_tokens(120), "--out", str(tmp_path / "l.npy"),
                       "--swarm", boot.addr, "--kernel", "numpy", "--decode", "--refresh", "0.5", "--json", env=env,
                       check=True)
        assert json.loads(proc.stdout)["fallbacks"] == 0, proc.stdout
        assert proc.stderr.count(" unit look-ups, ") >= 3, proc.stderr[-3000:]  # several refreshes happened
        for node, why in ((liar, "kernel mismatch"), (odd, "block size mismatch")):
            lines = [ln for ln in proc.stderr.splitlines() if f"refused worker {peer(node)}" in ln]
            assert len(lines) == 1 and why in lines[0], proc.stderr[-3000:]

        # kill -9: no withdrawal. w1's record (60 s) stays live; w2's (12 s) expires soon.
        w[1].stop(signal.SIGKILL)
        w[2].stop(signal.SIGKILL)
        killed = time.time()
        with ThreadPoolExecutor(2) as pool:
            human, out = pool.submit(status), pool.submit(status, "--json")
            human, out = human.result(), out.result()
        assert time.time() - killed < 40  # w1's record (signed <= 20 s before the kill) was live: only the probe tells
        assert f"model {fp}\n" in human  # the whole 64-digit fingerprint
        assert max(len(ln) for ln in human.splitlines()) <= 120, human  # a table for a terminal; --json for more
        row = next(ln for ln in human.splitlines() if peer(w[1]) in ln)  # its row, then why
        assert row.startswith("unreachable ") and f"  {peer(w[1])}: unreachable: " in human, human
        assert next(ln for ln in human.splitlines() if peer(w[0]) in ln).startswith("live "), human
        assert f"{peer(liar)}: refused: kernel mismatch" in human and f"{peer(odd)}: refused: block size" in human
        st = json.loads(out.strip().splitlines()[-1])
        assert st["peers"][peer(w[1])]["status"] == "unreachable" and st["peers"][peer(w[0])]["status"] == "live"
        assert set(st["replicas"].values()) == {0}  # experts 6-15 are dead, and in every block

        time.sleep(max(0.0, killed + short_ttl + 1 - time.time()))
        st = json.loads(status("--json", "--no-probe").strip().splitlines()[-1])
        gone = st["peers"][peer(w[2])]
        assert gone["status"] == "gone" and gone["reason"].startswith("record expired"), gone
        # without a probe, the records are all there is: w1 still counts until its record expires
        assert [st["peers"][peer(n)]["status"] for n in w[:2]] == ["unprobed", "unprobed"]
    finally:
        for n in reversed(nodes):
            n.stop()


@pytest.mark.slow
def test_swarm_status_reads_a_missed_record_again_before_calling_its_worker_gone(tiny_f32, tmp_path, monkeypatch):
    """A record read that fails once (a loaded host: one suite run showed a live worker as "gone: no
    node record found") is read again: swarm-status makes a second pass when a provider's record
    was not found, even with every unit covered. A worker whose record is never found is still
    reported gone, with that reason."""
    from argparse import Namespace

    from p2pswarm.commands.swarm_status import _status
    from p2pswarm.net.dht.coverage import NO_RECORD
    from p2pswarm.net.dht.kademlia import SwarmDHT
    from p2pswarm.net.signed.records import DEFAULT_BLOCK_SIZE

    env = dict(os.environ, P2PSWARM_KERNEL="numpy", P2PSWARM_HOME=str(tmp_path / "home"))
    boot, workers = None, []
    try:
        boot = start_bootstrap(tmp_path, env)
        # three workers of every expert: one missed record uncovers no unit (the older retry's trigger)
        workers += start_shard_workers(tiny_f32, tmp_path, env, [(0, 16)] * 3, boot.addr)
        peers = [w.addr.split("/p2p/")[1] for w in workers]

        def all_seen() -> bool:
            proc = run_cli("swarm-status", "--bootstrap", boot.addr, "--model", str(tiny_f32), "--kernel", "numpy",
                           "--json", "--no-probe", env=env, check=True)
            st = json.loads(proc.stdout.strip().splitlines()[-1])
            return all(st["peers"].get(p, {}).get("status") == "unprobed" for p in peers)

        wait_until(all_seen, timeout=60, interval=1, what="all three workers in a look-up")
        once, never = peers[0], peers[1]
        reads: dict[str, int] = {}
        real = SwarmDHT.get_node_record

        async def flaky(self, peer, **kw):
            key = peer if isinstance(peer, str) else peer.to_base58()
            reads[key] = reads.get(key, 0) + 1
            if key == never or (key == once and reads[key] == 1):
                return None  # as a look-up that timed out on a loaded host returns
            return await real(self, peer, **kw)

        monkeypatch.setattr(SwarmDHT, "get_node_record", flaky)
        args = Namespace(bootstrap=[boot.addr], model=str(tiny_f32), block_size=DEFAULT_BLOCK_SIZE, kernel="numpy",
                         probe_timeout=5.0, no_probe=True, json=True)
        st = trio.run(_status, args)
        assert st["missing"] == 0, st["replicas"]
        assert reads[once] == 2 and reads[peers[2]] == 2, reads  # a second pass re-read every record
        assert st["peers"][once]["status"] == "unprobed" and st["peers"][peers[2]]["status"] == "unprobed", st["peers"]
        assert st["peers"][never] == {"status": "gone", "reason": NO_RECORD, "addrs": [], "shards": []}
    finally:
        for n in reversed(workers):
            n.stop()
        if boot is not None:
            boot.stop()
