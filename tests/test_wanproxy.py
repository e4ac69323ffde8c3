"""The WAN-emulating TCP proxy over real sockets: delay each way, jitter keeps order, bandwidth cap."""
from __future__ import annotations

import socket
import subprocess
import sys

import pytest
import trio

from p2pswarm.net.wire.wanproxy import SharedCap, open_wan_proxy

from helpers.procs import free_port


async def _echo_server(nursery) -> int:
    async def echo(stream):
        async with stream:
            while data := await stream.receive_some(65536):
                await stream.send_all(data)

    listeners = await nursery.start(trio.serve_tcp, echo, 0)
    return listeners[0].socket.getsockname()[1]


async def _round_trip(port: int, payload: bytes) -> tuple[float, bytes]:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        t0 = trio.current_time()
        await stream.send_all(payload)
        got = b""
        while len(got) < len(payload):
            got += await stream.receive_some(65536)
        return trio.current_time() - t0, got


@pytest.mark.slow
async def test_delay_jitter_and_bandwidth():
    async with trio.open_nursery() as nursery:
        target = await _echo_server(nursery)
        async with open_wan_proxy(("127.0.0.1", target), delay_s=0.025) as proxy:
            dt, got = await _round_trip(proxy.port, b"ping")
            assert got == b"ping" and 0.05 <= dt < 0.5, dt
            assert proxy.stats.connections == 1 and proxy.stats.bytes_up == 4 == proxy.stats.bytes_down
        async with open_wan_proxy(("127.0.0.1", target), delay_s=0.005, jitter_s=0.02, seed=1) as proxy:
            stream = await trio.open_tcp_stream("127.0.0.1", proxy.port)
            async with stream:
                want = b"".join(i.to_bytes(2, "big") for i in range(300))
                for i in range(300):  # many small writes, each with its own jitter: order must hold
                    await stream.send_all(want[2 * i : 2 * i + 2])
                    await trio.sleep(0.0005)
                got = b""
                while len(got) < len(want):
                    got += await stream.receive_some(65536)
                assert got == want
        async with open_wan_proxy(("127.0.0.1", target), bytes_per_s=2e6) as proxy:
            # 307 kB each way at 2 MB/s: 0.154 s per direction (the echo overlaps the two)
            dt, got = await _round_trip(proxy.port, bytes(range(256)) * 1200)
            assert len(got) == 307200 and dt >= 0.15, dt
        nursery.cancel_scope.cancel()


@pytest.mark.slow
async def test_per_direction_and_shared_caps():
    """A link capped 8 MB/s up and 1 MB/s down is as slow as its down side; two links sharing one
    2 MB/s card (the backbone's line) carry their bytes at 2 MB/s together, not each."""
    payload = bytes(range(256)) * 800  # 204.8 kB
    async with trio.open_nursery() as nursery:
        target = await _echo_server(nursery)
        async with open_wan_proxy(("127.0.0.1", target), up_bytes_per_s=8e6, down_bytes_per_s=1e6) as proxy:
            dt, got = await _round_trip(proxy.port, payload)
            assert got == payload and 0.2 <= dt < 0.6, dt  # 0.205 s down; 0.026 s up overlapped
        async with open_wan_proxy(("127.0.0.1", target), down_bytes_per_s=1e6, up_bytes_per_s=64e6) as proxy:
            dt_alone, _ = await _round_trip(proxy.port, payload)
        card = SharedCap(2e6)
        async with open_wan_proxy(("127.0.0.1", target), shared_down=card) as a, \
                open_wan_proxy(("127.0.0.1", target), shared_down=card) as b:
            took = {}

            async def one(name, port):
                took[name], got = await _round_trip(port, payload)
                assert got == payload

            t0 = trio.current_time()
            async with trio.open_nursery() as both:
                both.start_soon(one, "a", a.port)
                both.start_soon(one, "b", b.port)
            together = trio.current_time() - t0
            # 409.6 kB through one 2 MB/s card: >= 0.2 s, where independent 2 MB/s links take ~0.1 s
            assert together >= 0.2 and max(took.values()) >= 0.2, took
        nursery.cancel_scope.cancel()
    assert dt_alone >= 0.2


@pytest.mark.slow
def test_cli_refuses_bad_arguments():
    proc = subprocess.run([sys.executable, "-m", "p2pswarm.net.wire.wanproxy", "--target", "nohost", "--rtt-ms", "5"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "HOST:PORT" in proc.stderr and "Traceback" not in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "p2pswarm.net.wire.wanproxy", "--target", "127.0.0.1:1",
                           "--rtt-ms", "-5"], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and ">= 0" in proc.stderr and "Traceback" not in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "p2pswarm.net.wire.wanproxy", "--target", "127.0.0.1:1",
                           "--target", "127.0.0.1:2", "--listen", "127.0.0.1:4999"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "one --listen per target" in proc.stderr and "Traceback" not in proc.stderr
    with socket.socket() as taken:  # a link's port already in use: one line, exit 1
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "p2pswarm.net.wire.wanproxy", "--target", "127.0.0.1:1",
                               "--target", "127.0.0.1:2", "--listen", "127.0.0.1:0", "--listen", f"127.0.0.1:{port}"],
                              capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and proc.stderr.startswith("error:") and "in use" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.slow
async def test_one_process_emulates_a_link_per_target():
    """``--target A --target B``: one process, a port per target (READY lists them in order), each
    forwarding to its own target with the link's delay."""
    async with trio.open_nursery() as nursery:
        targets = [await _echo_server(nursery) for _ in range(2)]

        async def tagged(stream):  # a third server that says who it is: a link reaches its own target
            async with stream:
                await stream.send_all(b"third")

        third = (await nursery.start(trio.serve_tcp, tagged, 0))[0].socket.getsockname()[1]
        fixed = free_port()  # the third link on a port given (--listen once per target)
        proc = await trio.lowlevel.open_process(
            [sys.executable, "-m", "p2pswarm.net.wire.wanproxy", "--rtt-ms", "40",
             *[a for p in (*targets, third) for a in ("--target", f"127.0.0.1:{p}")],
             "--listen", "127.0.0.1:0", "--listen", "127.0.0.1:0", "--listen", f"127.0.0.1:{fixed}"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        try:
            with trio.fail_after(30):
                line = b""
                while not line.endswith(b"\n"):
                    line += await proc.stdout.receive_some(1024)
            words = line.decode().split()
            assert words[0] == "READY" and len(words) == 4, words
            ports = [int(w.rsplit(":", 1)[1]) for w in words[1:]]
            assert ports[2] == fixed
            for port in ports[:2]:
                dt, got = await _round_trip(port, b"ping")
                assert got == b"ping" and 0.04 <= dt < 1.0, dt
            stream = await trio.open_tcp_stream("127.0.0.1", ports[2])
            async with stream:
                with trio.fail_after(10):
                    assert await stream.receive_some(100) == b"third"
        finally:
            proc.kill()
            await proc.wait()
        nursery.cancel_scope.cancel()


async def test_a_zero_delay_link_forwards_everything_and_closes():
    """No delay, jitter or cap: the reader forwards inline (no timer, no channel); every byte still
    arrives in order, and the client's EOF reaches the target and comes back as the close."""
    async with trio.open_nursery() as nursery:
        target = await _echo_server(nursery)
        async with open_wan_proxy(("127.0.0.1", target)) as proxy:
            stream = await trio.open_tcp_stream("127.0.0.1", proxy.port)
            want = bytes(range(256)) * 2000  # 512 kB: many chunks, both ways at once
            got = bytearray()

            async def read_all() -> None:
                while data := await stream.receive_some(65536):
                    got.extend(data)

            with trio.fail_after(10):  # read_all ends only if the close comes back through the proxy
                async with trio.open_nursery() as inner:
                    inner.start_soon(read_all)
                    for i in range(0, len(want), 5000):
                        await stream.send_all(want[i:i + 5000])
                    await stream.send_eof()
            assert bytes(got) == want
            assert proxy.stats.bytes_up == len(want) == proxy.stats.bytes_down
        nursery.cancel_scope.cancel()


async def test_a_delayed_chunk_is_never_early():
    """The delivery timer wakes up to a grain early on the loop and sleeps the rest: never before
    the chunk's due time (a link shorter than its nominal RTT would flatter every benchmark)."""
    import random

    from p2pswarm.net.wire.wanproxy import sleep_until_precise

    rng = random.Random(3)
    for _ in range(30):
        due = trio.current_time() + rng.uniform(0.0, 0.004)
        await sleep_until_precise(due)
        assert trio.current_time() >= due
