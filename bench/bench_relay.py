"""relay-443 cost: relayed vs direct, and how many relayed workers one relay process carries.

    python bench/bench_relay.py [--rounds 300] [--loads 10,50,100,200] [--seconds 10] [--write]

All on 127.0.0.1, a `p2pswarm relay --open` process in the middle (WebSocket listener):

1. 6 KB round trip (one decode step's request for one owner, echoed back) and bulk MB/s (32 MiB
   frames, acknowledged), direct (TCP, Noise + yamux) vs through the relay (the same, end to end,
   over a circuit on WebSocket): medians and the ratios, in the same run.
2. Load: N relayed "workers" (libp2p hosts in a helper process, each holding a reservation and
   echoing 6 KB) and one backbone sending each of them 10 requests/s over its circuit. For each N:
   requests/s achieved vs offered, p50/p99 round trip, and the relay process's CPU use (from
   /proc/PID/stat over the window). "Sustained" = >= 95 % of the offered rate with p99 < 250 ms.
   The load generator shares the machine's cores with the relay, so at high N it, not the relay,
   may be what saturates: the relay's CPU column says how much headroom the relay itself had.
"""
from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import trio
from common import REPO, header, publish

from p2pswarm.net.wire.framing import FrameReader, send_frame
from p2pswarm.net.libp2p.addrs import circuit_addr
from p2pswarm.net.libp2p.host import open_host
from p2pswarm.net.signed.identity import Identity

ECHO = "/bench/echo/1.0.0"
SINK = "/bench/sink/1.0.0"
MAX = 1 << 26
PAYLOAD = os.urandom(6 * 1024)
CLK = os.sysconf("SC_CLK_TCK")


async def echo(stream) -> None:
    reader = FrameReader(stream, MAX)
    while (frame := await reader.read_frame()) is not None:
        await send_frame(stream, frame, MAX)


async def sink(stream) -> None:
    reader = FrameReader(stream, MAX)
    while (frame := await reader.read_frame()) is not None:
        await send_frame(stream, len(frame).to_bytes(8, "big"), MAX)


def start_relay(tmp: str, listen: str = "/ip4/127.0.0.1/tcp/0/ws") -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, P2PSWARM_HOME=tmp, P2PSWARM_LOG_LEVEL="WARNING")
    proc = subprocess.Popen([sys.executable, "-m", "p2pswarm.cli", "relay", "--open", "--listen",
                             listen, "--identity", f"{tmp}/relay.key"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env, cwd=REPO)
    line = proc.stdout.readline()
    if not line.startswith("READY "):
        proc.kill()
        raise SystemExit("relay did not start")
    return proc, line.split()[1]


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK


async def rtt(stream, payload: bytes, rounds: int) -> float:
    reader = FrameReader(stream, MAX)
    for _ in range(5):
        await send_frame(stream, payload, MAX)
        await reader.read_frame()
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        await send_frame(stream, payload, MAX)
        await reader.read_frame()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


async def mbps(stream, size: int = 32 << 20, rounds: int = 3) -> float:
    reader = FrameReader(stream, MAX)
    data = os.urandom(size)
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        await send_frame(stream, data, MAX)
        await reader.read_frame()
        best = min(best, time.perf_counter() - t)
    return size / best / 1e6


async def part1(relay_addr: str, rounds: int) -> dict:
    async with open_host(Identity.generate()) as worker, open_host(Identity.generate()) as backbone:
        from p2pswarm.net.libp2p.relay_client import RelayKeeper

        await RelayKeeper(worker, relay_addr, None, relay_only=False).start()
        worker.set_handler(ECHO, echo)
        worker.set_handler(SINK, sink)
        direct = f"{worker.transport_addrs()[0]}/p2p/{worker.peer_id_str}"
        out = {}
        s = await backbone.open_stream(direct, ECHO)
        out["rtt_direct"] = await rtt(s, PAYLOAD, rounds)
        s2 = await backbone.open_stream(direct, SINK)
        out["mbps_direct"] = await mbps(s2)
        await backbone.host.get_network().close_peer(worker.peer_id)
        await trio.sleep(0.2)
        relayed = circuit_addr(relay_addr, worker.peer_id_str)
        # only the circuit address: the backbone must go through the relay
        s = await backbone.open_stream(relayed, ECHO)
        conn = backbone.host.get_network().connections[worker.peer_id]
        conn = conn[0] if isinstance(conn, list) else conn
        assert "p2p-circuit" in str(conn.get_transport_addresses()), "not relayed"
        out["rtt_relay"] = await rtt(s, PAYLOAD, rounds)
        s2 = await backbone.open_stream(relayed, SINK)
        out["mbps_relay"] = await mbps(s2)
        return out


# -- load ------------------------------------------------------------------------------------------
async def workers_main(relay_addr: str, n: int) -> None:
    """Helper process: n relayed echo workers; prints their ids, then waits for stdin to close."""
    from contextlib import AsyncExitStack

    from p2pswarm.net.libp2p.relay_client import RelayKeeper

    async with AsyncExitStack() as stack:
        ids = []
        for _ in range(n):
            w = await stack.enter_async_context(open_host(Identity.generate()))
            await RelayKeeper(w, relay_addr, None).start()
            w.set_handler(ECHO, echo)
            ids.append(w.peer_id_str)
        print(" ".join(ids), flush=True)
        await trio.to_thread.run_sync(sys.stdin.read)


async def load(relay_addr: str, relay_pid: int, helper_pid: int, ids: list[str], seconds: float,
               rate: float = 10.0) -> dict:
    lat: list[float] = []
    sent = [0]
    async with open_host(Identity.generate()) as backbone:
        streams = []
        for wid in ids:
            streams.append(await backbone.open_stream(circuit_addr(relay_addr, wid), ECHO, timeout_s=30))
        cpu0, t0 = cpu_seconds(relay_pid), time.perf_counter()
        hcpu0, bcpu0 = cpu_seconds(helper_pid), cpu_seconds(os.getpid())
        end = t0 + seconds

        async def one(stream, offset: float) -> None:
            reader = FrameReader(stream, MAX)
            nxt = t0 + offset
            while nxt < end:
                await trio.sleep(max(0.0, nxt - time.perf_counter()))
                t = time.perf_counter()
                sent[0] += 1
                await send_frame(stream, PAYLOAD, MAX)
                await reader.read_frame()
                lat.append(time.perf_counter() - t)
                nxt += 1.0 / rate

        async with trio.open_nursery() as nursery:
            for i, s in enumerate(streams):
                nursery.start_soon(one, s, (i / len(streams)) / rate)
        wall = time.perf_counter() - t0
        cpu = cpu_seconds(relay_pid) - cpu0
        hcpu, bcpu = cpu_seconds(helper_pid) - hcpu0, cpu_seconds(os.getpid()) - bcpu0
    lat.sort()
    return {"n": len(ids), "offered": len(ids) * rate, "achieved": len(lat) / wall,
            "p50": lat[len(lat) // 2] * 1e3, "p99": lat[int(len(lat) * 0.99) - 1] * 1e3,
            "relay_cpu": 100 * cpu / wall, "workers_cpu": 100 * hcpu / wall, "backbone_cpu": 100 * bcpu / wall}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--loads", default="10,50,100,200")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--relay-listen", default="/ip4/127.0.0.1/tcp/0/ws,/ip4/127.0.0.1/tcp/0",
                    help="relay listen addresses to measure the load with, comma-separated (first: part 1)")
    ap.add_argument("--write", action="store_true", help="append the results to docs/benchmarks.md")
    ap.add_argument("--workers-proc", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.workers_proc:
        trio.run(workers_main, args.workers_proc[0], int(args.workers_proc[1]))
        return
    with tempfile.TemporaryDirectory() as tmp:
        rows = []
        for i, listen in enumerate(args.relay_listen.split(",")):
            relay, addr = start_relay(tmp, listen)
            try:
                if i == 0:
                    p1 = trio.run(part1, addr, args.rounds)
                load_rows(args, relay, addr, listen, rows)
            finally:
                relay.send_signal(signal.SIGTERM)
                relay.wait(30)
    report(args, p1, rows)


def load_rows(args, relay, addr: str, listen: str, rows: list) -> None:
    kind = "WebSocket" if "/ws" in listen else "TCP"
    if True:
        if True:
            for n in [int(x) for x in args.loads.split(",")]:
                helper = subprocess.Popen([sys.executable, __file__, "--workers-proc", addr, str(n)],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO,
                                          env=dict(os.environ, P2PSWARM_LOG_LEVEL="WARNING"))
                ids_line: list[str] = []
                t = threading.Thread(target=lambda out=ids_line, h=helper: out.append(h.stdout.readline()),
                                     daemon=True)
                t.start()
                t.join(300)
                ids = ids_line[0].split() if ids_line else []
                if len(ids) != n:
                    helper.kill()
                    raise SystemExit(f"helper did not bring up {n} relayed workers")
                r = trio.run(load, addr, relay.pid, helper.pid, ids, args.seconds)
                r["kind"] = kind
                helper.stdin.close()
                helper.wait(60)
                r["sustained"] = r["achieved"] >= 0.95 * r["offered"] and r["p99"] < 250
                rows.append(r)
                print(f"{kind} N={n}: {r['achieved']:.0f}/{r['offered']:.0f} req/s, p50 {r['p50']:.1f} ms, "
                      f"p99 {r['p99']:.1f} ms, CPU relay {r['relay_cpu']:.0f}% workers {r['workers_cpu']:.0f}% "
                      f"backbone {r['backbone_cpu']:.0f}%", flush=True)


def report(args, p1: dict, rows: list) -> None:
    text = header("Relay: relayed vs direct, and relayed workers per relay process",
                  "python bench/bench_relay.py " + " ".join(sys.argv[1:]))
    text += ("| path (127.0.0.1) | 6 KB round trip, median | bulk MB/s (32 MiB frames) |\n|---|---|---|\n"
             f"| direct (TCP, Noise + yamux) | {p1['rtt_direct'] * 1e3:.2f} ms | {p1['mbps_direct']:.0f} |\n"
             f"| through the relay (WebSocket + circuit, Noise + yamux end to end) | {p1['rtt_relay'] * 1e3:.2f} ms | "
             f"{p1['mbps_relay']:.0f} |\n"
             f"| **relayed / direct** | **{p1['rtt_relay'] / p1['rtt_direct']:.2f}x** time | "
             f"**{p1['mbps_relay'] / p1['mbps_direct']:.2f}x** throughput |\n\n")
    text += ("| relay listens on | relayed workers | offered req/s (10 each) | achieved req/s | p50 ms | p99 ms "
             "| CPU % of one core: relay / workers' process / backbone | sustained |\n|---|---|---|---|---|---|---|---|\n")
    for r in rows:
        text += (f"| {r['kind']} | {r['n']} | {r['offered']:.0f} | {r['achieved']:.0f} | {r['p50']:.1f} | {r['p99']:.1f} | "
                 f"{r['relay_cpu']:.0f} / {r['workers_cpu']:.0f} / {r['backbone_cpu']:.0f} | "
                 f"{'yes' if r['sustained'] else 'no'} |\n")
    publish(text, args.write)


if __name__ == "__main__":
    main()
