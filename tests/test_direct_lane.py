"""The direct lane (p2pswarm/net/wire/direct.py): expert requests on a sealed TCP connection keyed through
the authenticated libp2p stream. Real hosts, real sockets on 127.0.0.1: the answers are the
worker's bits; a forged, reused or tampered ticket or record is refused; an unreachable lane leaves
the requests on libp2p; a late reply on the lane can still be read (cancel-safe)."""
from __future__ import annotations

import os
import struct

import numpy as np
import pytest
import trio
import trio.testing

from p2pswarm.backbone.dispatch.dispatcher import pack_rows
from p2pswarm.errors import FrameError
from p2pswarm.net.wire import expert_protocol as proto
from p2pswarm.net.wire.direct import DirectLane, SealedStream, open_direct
from p2pswarm.net.wire.framing import DEFAULT_MAX_FRAME, FrameReader, send_frame
from p2pswarm.net.libp2p.host import open_host
from p2pswarm.net.signed.identity import Identity
from p2pswarm.worker.expert_worker import ExpertWorker

from helpers.owners import hello_offer, libp2p_owner, random_request, served
from helpers.procs import free_port


@pytest.fixture
def worker(shards):
    return ExpertWorker(shards[1])


async def test_requests_take_the_direct_lane_and_stay_bit_identical(worker):
    lane = DirectLane("127.0.0.1", 0, max_frame=DEFAULT_MAX_FRAME)
    rng = np.random.default_rng(5)
    async with trio.open_nursery() as nursery, served(worker, direct=lane) as wnet, \
            open_host(Identity.generate()) as bnet:
        await nursery.start(lane.serve)
        owner = libp2p_owner(bnet, wnet, worker)
        for layer in range(worker.info.layer_begin, worker.info.layer_end):
            cur, groups = random_request(worker, rng)
            got = await owner.compute(layer, cur, groups)
            want = worker.compute(layer, *pack_rows(cur, groups))
            assert all(np.array_equal(g, w) for g, w in zip(got, want))
        assert owner.lane == "direct" and owner.direct_failed is None
        assert lane.redeemed == 1 and lane.refused == 0
        assert await owner.echo(b"x" * 100_000) == b"x" * 100_000  # frames of any size cross it intact
        # a backbone that does not want it stays on libp2p (the worker offers nothing unasked)
        plain = libp2p_owner(bnet, wnet, worker, direct=False)
        assert await plain.echo(b"y") == b"y" and plain.lane == "libp2p" and lane.redeemed == 1
        for o in (owner, plain):
            await o.aclose()
        nursery.cancel_scope.cancel()


async def test_forged_reused_and_tampered_tickets_and_records_are_refused(worker, caplog):
    lane = DirectLane("127.0.0.1", 0, max_frame=DEFAULT_MAX_FRAME)
    async with trio.open_nursery() as nursery, served(worker, direct=lane) as wnet, \
            open_host(Identity.generate()) as bnet:
        await nursery.start(lane.serve)

        async def drain(stream) -> bytes:
            """Everything the worker sends until it closes the connection (bounded: no hang)."""
            got = b""
            with trio.fail_after(20):
                while chunk := await stream.receive_some(1 << 16):
                    got += chunk
            return got

        # a forged ticket: the connection is closed, nothing is served
        raw = await trio.open_tcp_stream("127.0.0.1", lane.port)
        await raw.send_all(os.urandom(16))
        assert await drain(raw) == b""
        assert lane.refused == 1 and lane.redeemed == 0
        # a real ticket works once ...
        offer, hello = await hello_offer(bnet, wnet, worker)
        sealed = await open_direct("127.0.0.1", offer["port"], offer["ticket"], offer["key"], max_frame=DEFAULT_MAX_FRAME)
        await send_frame(sealed, proto.pack(dict(hello, direct=False)))
        assert proto.unpack(await FrameReader(sealed).read_frame())["ok"]
        # ... and not twice
        again = await trio.open_tcp_stream("127.0.0.1", lane.port)
        await again.send_all(offer["ticket"])
        assert await drain(again) == b""
        assert lane.refused == 2 and lane.redeemed == 1
        # a record that does not authenticate (forged on the wire): one error frame saying so, then closed
        body = os.urandom(40)
        await sealed.stream.send_all(struct.pack("!I", len(body)) + body)
        err = await drain(sealed)
        msg = proto.unpack(err[8:])
        assert msg["op"] == "error" and "failed authentication" in msg["error"], msg
        # a wrong key on our side: neither end can open the other's records
        offer2, _ = await hello_offer(bnet, wnet, worker)
        wrong = await open_direct("127.0.0.1", offer2["port"], offer2["ticket"], os.urandom(32),
                                  max_frame=DEFAULT_MAX_FRAME)
        await send_frame(wrong, proto.pack(dict(hello, direct=False)))
        with pytest.raises(FrameError, match="failed authentication"):
            await drain(wrong)
        assert any("refused a direct connection" in r.getMessage() and "unknown, used or expired ticket"
                   in r.getMessage() for r in caplog.records)
        for s in (raw, again, sealed, wrong):
            await trio.aclose_forcefully(s)
        nursery.cancel_scope.cancel()


async def test_an_unreachable_lane_leaves_the_requests_on_libp2p(worker, caplog):
    caplog.set_level("INFO")
    dead = free_port()  # nothing listens there: the announced lane cannot be reached
    lane = DirectLane("127.0.0.1", 0, announce_host="127.0.0.1", announce_port=dead, max_frame=DEFAULT_MAX_FRAME)
    rng = np.random.default_rng(6)
    async with trio.open_nursery() as nursery, served(worker, direct=lane) as wnet, \
            open_host(Identity.generate()) as bnet:
        await nursery.start(lane.serve)
        owner = libp2p_owner(bnet, wnet, worker)
        cur, groups = random_request(worker, rng)
        got = await owner.compute(worker.info.layer_begin, cur, groups)
        want = worker.compute(worker.info.layer_begin, *pack_rows(cur, groups))
        assert all(np.array_equal(g, w) for g, w in zip(got, want))
        assert owner.lane == "libp2p" and owner.direct_failed
        assert any("no direct lane to worker" in r.getMessage() for r in caplog.records)
        await owner._drop()  # a reconnect does not try the lane again (until the record changes)
        await owner.compute(worker.info.layer_begin, cur, groups)
        assert owner.lane == "libp2p" and sum("no direct lane" in r.getMessage() for r in caplog.records) == 1
        await owner.aclose()
        nursery.cancel_scope.cancel()


async def test_a_sealed_read_cancelled_midway_loses_nothing():
    """What the late-reply reader relies on: a cancelled receive_some keeps the bytes it had."""
    a, b = trio.testing.memory_stream_pair()
    key = os.urandom(32)
    tx = SealedStream(a, key, initiator=True, max_record=1 << 20)
    rx = SealedStream(b, key, initiator=False, max_record=1 << 20)
    payload = os.urandom(5000)
    head = struct.pack("!I", len(payload) + 16)
    sealed = tx._aead.encrypt(tx._nonce(tx._send_dir, 0), payload, head)
    await a.send_all(head + sealed[:1000])  # half a record
    with trio.move_on_after(0.05) as scope:
        await rx.receive_some()
    assert scope.cancelled_caught
    await a.send_all(sealed[1000:])
    assert await rx.receive_some() == payload


async def test_frames_read_a_record_at_a_time_whatever_the_records_hold():
    """FrameReader on a direct lane takes a whole record at a time (its fast path: a record that
    is one frame) and falls back to its buffer for the rest: a frame over a MiB (header and payload
    in two records), two frames in one record, a frame cut across records, an empty one. Every
    payload comes back as bytes, equal, in order, on a socket (the reused receive buffer) and on a
    memory stream; a record sealed in one buffer with its header opens as before."""
    key = os.urandom(32)
    sizes = [0, 5, 70_000, (1 << 20) + 3, 200_000]
    payloads = [os.urandom(n) for n in sizes]
    pair = trio.socket.socketpair()
    streams = [trio.testing.memory_stream_pair(), (trio.SocketStream(pair[0]), trio.SocketStream(pair[1]))]
    for a, b in streams:
        tx = SealedStream(a, key, initiator=True, max_record=DEFAULT_MAX_FRAME)
        reader = FrameReader(SealedStream(b, key, initiator=False, max_record=DEFAULT_MAX_FRAME), DEFAULT_MAX_FRAME)

        async def send() -> None:
            for p in payloads:
                await send_frame(tx, p)
            two = struct.pack("!Q", 3) + b"abc" + struct.pack("!Q", 4) + b"defg"
            await tx.send_all(two)  # two frames, one record
            cut = struct.pack("!Q", 10) + b"0123456789"
            await tx.send_all(cut[:6])  # a frame in three records
            await tx.send_all(memoryview(cut)[6:12])
            await tx.send_all(bytearray(cut[12:]))
            await tx.send_all(b"")  # an empty record between frames

            await send_frame(tx, b"last")

        got = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(send)
            for _ in range(len(payloads) + 4):
                got.append(await reader.read_frame())
        assert got == payloads + [b"abc", b"defg", b"0123456789", b"last"]
        assert all(type(g) is bytes for g in got)



@pytest.mark.slow
def test_worker_processes_with_direct_lanes_serve_a_swarm_run_bit_for_bit(tiny_f32, tmp_path):
    """Real processes: bootstrap, two `node --role worker --direct 127.0.0.1:0`, and `logits
    --swarm`: every expert request on the direct lanes (both taken, no fallback), the logits the
    monolithic run's bits; the worker's receipts, sent on the lane, name the backbone's peer."""
    import json

    from conftest import run_cli
    from helpers.procs import Proc
    from p2pswarm.model.slicer import slice_experts
    from p2pswarm.net.signed.identity import load_or_create_identity

    env = dict(os.environ, P2PSWARM_KERNEL="numpy", P2PSWARM_HOME=str(tmp_path / "home"))
    tokens = "5,17,42,99,100,7,256,300,12,64,128,31"
    procs: list[Proc] = []
    try:
        boot = Proc(["bootstrap", "--listen", "/ip4/127.0.0.1/tcp/0", "--identity", str(tmp_path / "boot.key")],
                    tmp_path / "boot.log", env)
        procs.append(boot)
        for i, rng in enumerate([(0, 8), (8, 16)]):
            slice_experts(tiny_f32, tmp_path / f"s{i}.gguf", None, rng)
            procs.append(Proc(["node", "--role", "worker", "--shard", str(tmp_path / f"s{i}.gguf"), "--bootstrap",
                               boot.addr, "--identity", str(tmp_path / f"w{i}.key"), "--direct", "127.0.0.1:0",
                               "--receipts-dir", str(tmp_path / f"r{i}")], tmp_path / f"w{i}.log", env))
        mono = tmp_path / "mono.npy"
        run_cli("logits", str(tiny_f32), "--tokens", tokens, "--out", str(mono), "--kernel", "numpy", "--decode",
                env=env, check=True)
        bb_id = load_or_create_identity(tmp_path / "bb.key").peer_id_str
        split = run_cli("logits", str(tiny_f32), "--tokens", tokens, "--out", str(tmp_path / "split.npy"), "--decode",
                        "--kernel", "numpy", "--swarm", boot.addr, "--swarm-identity", str(tmp_path / "bb.key"),
                        env=env, check=True)
        assert np.array_equal(np.load(mono), np.load(tmp_path / "split.npy"))
        assert split.stderr.count("direct lane to worker") == 2, split.stderr[-3000:]
        assert " 0 fallbacks" in split.stdout and "no direct lane" not in split.stderr
        for p in procs[1:]:
            p.stop()
        for i in range(2):
            log = (tmp_path / f"w{i}.log").read_text()
            assert "direct lane from 127.0.0.1" in log and f"opened for peer {bb_id}" in log, log[-3000:]
            good = run_cli("rewards", "--dir", str(tmp_path / f"r{i}"), "--json", env=env)
            chains = json.loads(good.stdout)["chains"]
            assert [c["backbone"] for c in chains] == [bb_id] and chains[0]["rows"] > 0 and not chains[0]["problems"]
    finally:
        for p in reversed(procs):
            p.stop()


@pytest.mark.slow
@pytest.mark.parametrize("flags, needle", [
    (["--direct", "nonsense"], "--direct 'nonsense': expected HOST:PORT"),
    (["--direct-announce", "127.0.0.1:9"], "--direct-announce needs --direct"),
    (["--direct", "127.0.0.1:0", "--direct-announce", "127.0.0.1:0"], "--direct-announce needs a real port"),
], ids=["malformed", "announce-alone", "announce-port-0"])
def test_bad_direct_flags_are_one_line_errors(tiny_f32, tmp_path, flags, needle):
    from conftest import assert_one_line_error, run_cli
    from p2pswarm.model.slicer import slice_experts

    slice_experts(tiny_f32, tmp_path / "s.gguf", None, (0, 8))
    proc = run_cli("node", "--role", "worker", "--shard", str(tmp_path / "s.gguf"), *flags,
                   env={"P2PSWARM_HOME": str(tmp_path / "home")}, timeout=60)
    assert_one_line_error(proc, needle)


@pytest.mark.slow
def test_a_taken_direct_port_is_a_one_line_error(tiny_f32, tmp_path):
    import socket

    from conftest import assert_one_line_error, run_cli
    from p2pswarm.model.slicer import slice_experts

    slice_experts(tiny_f32, tmp_path / "s.gguf", None, (0, 8))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = run_cli("node", "--role", "worker", "--shard", str(tmp_path / "s.gguf"), "--direct", f"127.0.0.1:{port}",
                       env={"P2PSWARM_HOME": str(tmp_path / "home"), "P2PSWARM_KERNEL": "numpy"}, timeout=60)
    assert_one_line_error(proc, f"--direct 127.0.0.1:{port}: cannot listen there")
