"""Relay scale-out: W relayed workers at 10 requests/s each, spread over N relay processes.

    python bench/bench_relay_scaleout.py [--workers 200] [--relays 1,2,4] [--helpers 4] [--seconds 10]
                                         [--kill] [--write]

For each N: N `p2pswarm relay --open` processes (relay i > 0 bootstraps from relay 0: they share
nothing but the DHT), ``--helpers`` processes holding W/helpers relayed echo workers each (every
worker given all N relay addresses: :class:`p2pswarm.net.libp2p.relay_client.RelayKeeper` picks one at random and moves
when it dies), and as many load processes, each sending 10 requests/s of 6 KB to each of its
workers over its circuit. Reported: requests/s achieved vs offered, p50/p99, the relays' CPU per
relayed request, and "sustained" (>= 95 % of offered, p99 < 250 ms). ``--kill``: relay 0 is killed
with SIGKILL halfway; its workers move to the others and the load processes follow them (the new
circuit address each moved worker reports), counting the requests lost and the time until every
moved worker answered again.

Everything shares this machine's cores: relays, workers and load generators compete, so the
machine, not the relays, may be what saturates -- the per-request CPU column says what a relay costs.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import trio
from bench_relay import ECHO, MAX, PAYLOAD, cpu_seconds, echo
from common import REPO, header, publish

from p2pswarm.net.wire.framing import FrameReader, send_frame
from p2pswarm.net.libp2p.addrs import circuit_addr
from p2pswarm.net.libp2p.host import open_host
from p2pswarm.net.signed.identity import Identity

RATE = 10.0


def start_relay(tmp: Path, i: int, bootstrap: str | None) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, P2PSWARM_HOME=str(tmp / f"home{i}"), P2PSWARM_LOG_LEVEL="WARNING")
    args = [sys.executable, "-m", "p2pswarm.cli", "relay", "--open", "--listen", "/ip4/127.0.0.1/tcp/0/ws",
            "--identity", str(tmp / f"relay{i}.key"), *(["--bootstrap", bootstrap] if bootstrap else [])]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env, cwd=REPO)
    line = proc.stdout.readline()
    if not line.startswith("READY "):
        proc.kill()
        raise SystemExit(f"relay {i} did not start")
    return proc, line.split()[1]


# -- helper process: relayed echo workers ----------------------------------------------------------
async def workers_main(relays: list[str], n: int, moves_file: str) -> None:
    """n relayed echo workers, each keeping a reservation on one of ``relays``; prints one line
    ``ID RELAY_ADDR`` per worker, appends ``ID CIRCUIT`` to ``moves_file`` when one moves, and
    runs until stdin closes."""
    from contextlib import AsyncExitStack

    from p2pswarm.net.libp2p.relay_client import RelayKeeper

    async with trio.open_nursery() as nursery, AsyncExitStack() as stack:  # hosts close before the nursery
        lines = []
        for _ in range(n):
            w = await stack.enter_async_context(open_host(Identity.generate()))
            w.set_handler(ECHO, echo)
            keeper = RelayKeeper(w, relays, None)
            await keeper.start()

            async def moved(keeper=keeper, w=w) -> None:
                with open(moves_file, "a") as f:
                    f.write(f"{w.peer_id_str} {keeper.relay_addr}\n")

            keeper.on_reserved = moved
            nursery.start_soon(keeper.keep)
            lines.append(f"{w.peer_id_str} {keeper.relay_addr}")
        print("\n".join(lines), flush=True)
        print("END", flush=True)
        await trio.to_thread.run_sync(sys.stdin.read)
        nursery.cancel_scope.cancel()


# -- load process ------------------------------------------------------------------------------------
async def load_main(spec: str) -> None:
    """Drive the workers in ``spec`` (JSON: {"workers": [[id, relay]], "seconds", "moves",
    "start_at"}); prints one JSON line of results."""
    cfg = json.loads(spec)
    where = {wid: relay for wid, relay in cfg["workers"]}
    lat: list[float] = []
    lost = [0]
    back_after: list[float] = []
    cpu0 = cpu_seconds(os.getpid())
    async with open_host(Identity.generate()) as backbone:
        await trio.sleep(max(0.0, cfg["start_at"] - time.time()))
        t0 = time.perf_counter()
        end = t0 + cfg["seconds"]

        def current(wid: str) -> str:
            try:
                for line in Path(cfg["moves"]).read_text().splitlines():
                    pid, relay = line.split()
                    if pid == wid:
                        where[wid] = relay
            except OSError:
                pass
            return where[wid]

        async def one(wid: str, offset: float) -> None:
            stream = reader = None
            nxt = t0 + offset
            down_since = None
            while nxt < end:
                await trio.sleep(max(0.0, nxt - time.perf_counter()))
                nxt += 1.0 / RATE
                t = time.perf_counter()
                try:
                    with trio.fail_after(5):
                        if stream is None:
                            stream = await backbone.open_stream(circuit_addr(current(wid), wid), ECHO, timeout_s=5)
                            reader = FrameReader(stream, MAX)
                        await send_frame(stream, PAYLOAD, MAX)
                        await reader.read_frame()
                except Exception:
                    lost[0] += 1
                    down_since = down_since or t
                    stream = None
                    continue
                if down_since is not None:
                    back_after.append(time.perf_counter() - down_since)
                    down_since = None
                lat.append(time.perf_counter() - t)

        async with trio.open_nursery() as nursery:
            for i, (wid, _) in enumerate(cfg["workers"]):
                nursery.start_soon(one, wid, (i / len(cfg["workers"])) / RATE)
        wall = time.perf_counter() - t0
    print(json.dumps({"lat": lat, "lost": lost[0], "wall": wall, "back_after": back_after,
                      "cpu": cpu_seconds(os.getpid()) - cpu0}), flush=True)


def _read_lines_until_end(proc, timeout: float) -> list[str]:
    out: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            if line.strip() == "END":
                return
            out.append(line.strip())

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(timeout)
    return out


def run_one(tmp: Path, n_relays: int, args) -> dict:
    relays, addrs = [], []
    for i in range(n_relays):
        proc, addr = start_relay(tmp, i, addrs[0] if addrs else None)
        relays.append(proc)
        addrs.append(addr)
    moves = tmp / f"moves-{n_relays}.txt"
    moves.write_text("")
    helpers, workers = [], []
    env = dict(os.environ, P2PSWARM_LOG_LEVEL="WARNING")
    try:
        per = [args.workers // args.helpers + (1 if i < args.workers % args.helpers else 0) for i in range(args.helpers)]
        for n in per:
            h = subprocess.Popen([sys.executable, __file__, "--workers-proc", json.dumps(addrs), str(n), str(moves)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO, env=env)
            helpers.append(h)
        for h, n in zip(helpers, per):
            lines = _read_lines_until_end(h, 600)
            if len(lines) != n:
                raise SystemExit(f"a helper brought up {len(lines)} of {n} relayed workers")
            workers.append([ln.split() for ln in lines])
        spread = {a: sum(1 for ws in workers for _, r in ws if r == a) for a in addrs}
        start_at = time.time() + 5
        loads = [subprocess.Popen([sys.executable, __file__, "--load-proc",
                                   json.dumps({"workers": ws, "seconds": args.seconds, "moves": str(moves),
                                               "start_at": start_at})],
                                  stdout=subprocess.PIPE, text=True, cwd=REPO, env=env) for ws in workers]
        time.sleep(max(0.0, start_at - time.time()))
        cpu0 = [cpu_seconds(r.pid) for r in relays]
        t0 = time.perf_counter()
        killed = False
        if args.kill and n_relays > 1:
            time.sleep(args.seconds / 2)
            cpu0[0] = cpu_seconds(relays[0].pid) - cpu0[0]  # what relay 0 used until it died
            relays[0].send_signal(signal.SIGKILL)
            relays[0].wait()
            killed = True
        results = [json.loads(p.communicate(timeout=args.seconds + 600)[0].strip().splitlines()[-1]) for p in loads]
        wall = time.perf_counter() - t0
        cpu = sum(cpu_seconds(r.pid) - c for r, c in zip(relays, cpu0) if r.poll() is None)
        if killed:
            cpu += cpu0[0]
    finally:
        for h in helpers:
            if h.stdin:
                h.stdin.close()
        for h in helpers:
            try:
                h.wait(60)
            except subprocess.TimeoutExpired:
                h.kill()
        for r in relays:
            if r.poll() is None:
                r.send_signal(signal.SIGTERM)
                r.wait(30)
    lat = sorted(x for r in results for x in r["lat"])
    n_req = len(lat)
    moved = len({ln.split()[0] for ln in moves.read_text().splitlines()}) if killed else 0
    back = [x for r in results for x in r["back_after"]]
    offered = args.workers * RATE
    row = {"relays": n_relays, "workers": args.workers, "spread": list(spread.values()), "offered": offered,
           "achieved": n_req / max(wall, 1e-9), "p50": lat[n_req // 2] * 1e3 if lat else float("nan"),
           "p99": lat[int(n_req * 0.99) - 1] * 1e3 if lat else float("nan"),
           "relay_cpu_ms_per_req": 1e3 * cpu / max(n_req, 1), "lost": sum(r["lost"] for r in results),
           "killed": killed, "moved": moved, "back_max_s": max(back) if back else None}
    row["sustained"] = row["achieved"] >= 0.95 * offered and row["p99"] < 250
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=200)
    ap.add_argument("--relays", default="1,2,4", help="relay counts to try, comma-separated")
    ap.add_argument("--helpers", type=int, default=4, help="processes holding the workers (and as many load processes)")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--kill", action="store_true", help="kill relay 0 halfway (with more than one relay)")
    ap.add_argument("--write", action="store_true", help="append the results to docs/benchmarks.md")
    ap.add_argument("--workers-proc", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument("--load-proc", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.workers_proc:
        trio.run(workers_main, json.loads(args.workers_proc[0]), int(args.workers_proc[1]), args.workers_proc[2])
        return
    if args.load_proc:
        trio.run(load_main, args.load_proc)
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in [int(x) for x in args.relays.split(",")]:
            r = run_one(Path(tmp), n, args)
            rows.append(r)
            print(json.dumps(r), flush=True)
    text = header("Relay scale-out: relayed workers over N relay processes",
                  "python bench/bench_relay_scaleout.py " + " ".join(sys.argv[1:]))
    text += ("| relays | workers (per relay) | offered req/s | achieved req/s | p50 ms | p99 ms | relay CPU ms per "
             "request | sustained | relay 0 killed: lost requests, workers moved, longest outage |\n"
             "|---|---|---|---|---|---|---|---|---|\n")
    for r in rows:
        kill = (f"{r['lost']} lost, {r['moved']} moved, {r['back_max_s']:.1f} s" if r["killed"] and r["back_max_s"]
                else (f"{r['lost']} lost, {r['moved']} moved" if r["killed"] else "-"))
        text += (f"| {r['relays']} | {r['workers']} ({'/'.join(map(str, r['spread']))}) | {r['offered']:.0f} | "
                 f"{r['achieved']:.0f} | {r['p50']:.1f} | {r['p99']:.1f} | {r['relay_cpu_ms_per_req']:.2f} | "
                 f"{'yes' if r['sustained'] else 'no'} | {kill} |\n")
    publish(text, args.write)


if __name__ == "__main__":
    main()
