"""Worker processes on local sockets: framing, hostile input, dying and hanging workers.

Every worker here is a real `p2pswarm worker` OS process; every byte crosses a real TCP socket.
"""
from __future__ import annotations

import os
import signal
import socket
import struct

import msgpack
import numpy as np
import pytest
import trio

from p2pswarm.backbone.sessions.local import WorkerProcess, ensure_shards, open_backbone
from p2pswarm.backbone.owners.socket_owner import SocketOwner
from p2pswarm.errors import WorkerError
from p2pswarm.model.layout import ModelLayout
from p2pswarm.model.manifest import model_fingerprint
from p2pswarm.net.wire.framing import FrameReader, send_frame
from p2pswarm.worker.expert_worker import ExpertWorker
from p2pswarm.backbone.serving.generate import sequence_logits

SIZES = [0, 1, 65535, 65536, 65537, 16 << 20]
TOKENS = list(range(3, 27))


@pytest.fixture
def shard(tiny_f32, tmp_path):
    layout = ModelLayout.open(tiny_f32)
    return ensure_shards(layout, model_fingerprint(layout), 2, tmp_path)[0]


def _owner(wp: WorkerProcess, shard, **kw) -> SocketOwner:
    info = ExpertWorker.describe_shard(shard)
    kw.setdefault("model_fingerprint", info.model_fingerprint)
    return SocketOwner("w", wp.host, wp.port, kernel=info.kernel, layers=(info.layer_begin, info.layer_end),
                       experts=(info.expert_begin, info.expert_end), **kw)


async def test_raw_frames_cross_a_tcp_socket_intact():
    """The framing layer alone, exact frame sizes, over loopback TCP."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    payloads = [os.urandom(n) for n in SIZES]
    got = []

    async def server(stream):
        reader = FrameReader(stream, max_frame=32 << 20)
        while (frame := await reader.read_frame()) is not None:
            got.append(frame)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.serve_listeners, server, listeners)
        client = await trio.open_tcp_stream("127.0.0.1", port)
        for p in payloads:
            await send_frame(client, p)
        await client.aclose()
        with trio.fail_after(30):
            while len(got) < len(payloads):
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    assert [len(g) for g in got] == SIZES
    assert all(a == b for a, b in zip(got, payloads))


@pytest.mark.slow
async def test_frames_cross_a_worker_process_intact(shard):
    wp = WorkerProcess.start(shard)
    try:
        owner = _owner(wp, shard)
        for n in SIZES:
            payload = os.urandom(n)
            assert await owner.echo(payload) == payload
        await owner.aclose()
    finally:
        wp.stop()


@pytest.mark.slow
async def test_oversize_frames_refused_both_ways(shard):
    wp = WorkerProcess.start(shard, extra_args=["--max-frame", "100000"])
    try:
        # our side refuses to send more than its own maximum
        small = _owner(wp, shard, max_frame=1000)
        with pytest.raises(WorkerError, match="refusing to send a frame of 5024 bytes: the maximum is 1000"):
            await small.echo(b"x" * 5000)
        # the worker refuses a frame over its maximum with a reason, then closes that connection
        big = _owner(wp, shard)
        with pytest.raises(WorkerError, match="exceeds the maximum of 100000"):
            await big.echo(b"x" * 200000)
        # ... and keeps serving everyone else
        ok = _owner(wp, shard)
        assert await ok.echo(b"still here") == b"still here"
        for o in (small, big, ok):
            await o.aclose()
    finally:
        wp.stop()


def _raw_exchange(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


@pytest.mark.parametrize("frame", [
    struct.pack("!Q", 5) + b"\xc1\xc1\xc1\xc1\xc1",  # never-used msgpack byte
    struct.pack("!Q", 3) + msgpack.packb([1, 2]),  # not a map
    struct.pack("!Q", 1 << 62) + b"x",  # absurd length: refused before reading
    struct.pack("!Q", 10) + b"short",  # closed mid-frame
])
@pytest.mark.slow
async def test_malformed_frames_close_only_that_connection(shard, frame):
    wp = WorkerProcess.start(shard)
    try:
        reply = await trio.to_thread.run_sync(_raw_exchange, wp.port, frame)
        if reply:  # an error frame, then the connection is closed
            (n,) = struct.unpack("!Q", reply[:8])
            msg = msgpack.unpackb(reply[8 : 8 + n])
            assert msg["op"] == "error" and msg["error"]
        owner = _owner(wp, shard)
        assert await owner.echo(b"ping") == b"ping"
        await owner.aclose()
        assert wp.proc.poll() is None
    finally:
        wp.stop()


@pytest.mark.slow
async def test_bad_compute_requests_get_error_replies(shard):
    wp = WorkerProcess.start(shard)
    try:
        owner = _owner(wp, shard)
        rows = np.ones((2, 256), np.float32)
        # an expert this worker does not hold
        with pytest.raises(WorkerError, match="not in this shard"):
            await owner.compute(0, rows, [(15, np.array([0, 1]))])
        # rows of the wrong width
        with pytest.raises(WorkerError, match="expected"):
            await owner.compute(0, np.ones((2, 7), np.float32), [(0, np.array([0]))])
        out = await owner.compute(0, rows, [(0, np.array([0, 1]))])
        assert out[0].shape == (2, 256)
        await owner.aclose()
    finally:
        wp.stop()


@pytest.mark.slow
async def test_wrong_model_refused_at_handshake(shard, tiny_q8, tmp_path, caplog):
    other_layout = ModelLayout.open(tiny_q8)
    other = ensure_shards(other_layout, model_fingerprint(other_layout), 2, tmp_path / "other")[0]
    wp = WorkerProcess.start(other)
    try:
        owner = _owner(wp, other, model_fingerprint=ExpertWorker.describe_shard(shard).model_fingerprint)
        with pytest.raises(WorkerError, match="refused the handshake: model mismatch"):
            await owner.echo(b"x")
    finally:
        wp.stop()


async def _kill_during(swarm, victim: int, sig: int, decode: bool = True):
    """Run a decode pass and send `sig` to one worker once the first layers have gone through."""
    results = {}

    async def run():
        try:
            results["logits"] = await sequence_logits(swarm.backbone, TOKENS, decode=decode)
        except WorkerError as exc:  # re-raised below, outside the nursery's exception group
            results["error"] = exc

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run)
        with trio.fail_after(60):
            while swarm.backbone.dispatcher.stats.requests < 12:
                await trio.sleep(0.001)
        os.kill(swarm.workers[victim].proc.pid, sig)
    if "error" in results:
        raise results["error"]
    return results["logits"]


@pytest.mark.slow
async def test_worker_killed_mid_generation_falls_back_exactly(tiny_f32, caplog):
    async with open_backbone(tiny_f32, workers=0) as mono:
        want = await sequence_logits(mono.backbone, TOKENS, decode=True)
    async with open_backbone(tiny_f32, workers=3, transport="socket") as swarm:
        with trio.fail_after(120):
            got = await _kill_during(swarm, 1, signal.SIGKILL)
        assert swarm.backbone.dispatcher.stats.fallbacks >= 1
    assert np.array_equal(got, want)
    assert any("fell back to the local replica" in r.getMessage() for r in caplog.records)


@pytest.mark.slow
async def test_worker_killed_without_fallback_is_a_clear_error(tiny_f32):
    async with open_backbone(tiny_f32, workers=3, transport="socket", fallback=False) as swarm:
        with trio.fail_after(120), pytest.raises(WorkerError, match="worker1"):
            await _kill_during(swarm, 1, signal.SIGKILL)


@pytest.mark.slow
async def test_hung_worker_times_out_and_falls_back(tiny_f32):
    async with open_backbone(tiny_f32, workers=0) as mono:
        want = await sequence_logits(mono.backbone, TOKENS, decode=True)
    async with open_backbone(tiny_f32, workers=2, transport="socket", timeout_s=1.0) as swarm:
        try:
            with trio.fail_after(120):
                got = await _kill_during(swarm, 0, signal.SIGSTOP)
        finally:
            os.kill(swarm.workers[0].proc.pid, signal.SIGCONT)
        assert swarm.backbone.dispatcher.stats.fallbacks >= 1
    assert np.array_equal(got, want)


def test_the_learnt_deadline_is_3x_the_p99_of_the_last_64_round_trips():
    """deadline_s keeps its window sorted as it moves (no sort per request): the same numbers as
    sorting the last 64 round trips each time, over a long random sequence."""
    import collections
    import random

    from p2pswarm.backbone.owners.socket_owner import (DEADLINE_FACTOR, DEADLINE_MARGIN_S, DEADLINE_MIN_S,
                                                DEADLINE_SAMPLES, LATENCY_WINDOW, SocketOwner)

    owner = SocketOwner("w", "127.0.0.1", 1, model_fingerprint="x", kernel="numpy", layers=(0, 1), experts=(0, 1))
    window: collections.deque = collections.deque(maxlen=LATENCY_WINDOW)
    rnd = random.Random(1)
    for i in range(1000):
        seconds, rows = rnd.choice([rnd.random(), 0.25, 0.5]), rnd.randint(1, 100)  # ties too
        owner._record(seconds, rows)
        window.append((seconds, rows))
        if len(window) < DEADLINE_SAMPLES:
            assert owner.deadline_s(50) == owner.timeout_s
            continue
        times = sorted(t for t, _ in window)
        p99 = times[min(len(times) - 1, int(0.99 * len(times)))]
        scale = max(1.0, 50 / max(n for _, n in window))
        want = min(owner.timeout_s, max(DEADLINE_MIN_S, DEADLINE_FACTOR * p99 * scale + DEADLINE_MARGIN_S))
        assert owner.deadline_s(50) == want, i
