"""Where a batched layer's time goes: per-hop timestamps of every expert request at N sequences.

    python bench/trace_layer.py --rtt 50 --n 64 [--micro-batches auto] [--tokens 8] [--rounds 2] [--direct]

The swarm of bench/bench_throughput.py (bootstrap, 4 workers each behind a WAN proxy, backbone with
the HTTP API), every process run through bench/trace_entry.py, which logs CLOCK_MONOTONIC
timestamps per hop. For each expert request of the measured rounds it splits the round trip into

  bb send     backbone: the frame's send_all (msgpack done; yamux + Noise + socket write)
  up          backbone wrote it -> the worker's frame reader returned it, less the proxy's one-way delay
              (proxy lateness + the worker's event loop, yamux, Noise, read-ahead)
  w queue     the worker read it -> its compute thread started (earlier requests on the stream, thread hop)
  w compute   the expert math
  w reply     compute done -> the reply frame sent (result msgpack, thread hop back, yamux + Noise write)
  down        the worker wrote it -> the backbone's frame reader returned it, less the one-way delay
  bb wait     the backbone's reader returned it -> run_groups returned (other owners, unpacking)

and per layer (run_groups of one micro-batch) its wall time, and the backbone's dense path per layer.
The proxies' own lateness (when a chunk went out vs when it was due) is reported separately.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from bench_throughput import RANGES, measure
from wan_swarm import WanSwarm

from p2pswarm.model.synth import make_model

HERE = Path(__file__).resolve().parent


def load(tdir: Path) -> dict[str, list[tuple[str, list[list[str]]]]]:
    out: dict[str, list] = defaultdict(list)
    for f in sorted(tdir.glob("*.tsv")):
        role = f.name.split("-")[0]
        rows = [line.rstrip("\n").split("\t") for line in f.open()]
        out[role].append((f.name, rows))
    return out


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def analyse(tdir: Path, t0: float, t1: float, one_way_s: float) -> str:
    tr = load(tdir)
    (_, bb), = tr["backbone"]
    sent, sent0, got = {}, {}, {}
    rg_open: dict[tuple, list[float]] = defaultdict(list)
    layers, dense = [], defaultdict(float)
    dense_open: dict[tuple, float] = {}
    for r in bb:
        t, ev = float(r[0]), r[1]
        if not t0 <= t <= t1:
            continue
        if ev in ("bb_out0", "bb_out", "bb_in") and r[3] in ("compute", "result"):
            key = (r[2], r[4])
            {"bb_out0": sent0, "bb_out": sent, "bb_in": got}[ev][key] = t
        elif ev == "rg0":
            rg_open[tuple(r[2:])].append(t)
        elif ev == "rg1" and rg_open[tuple(r[2:])]:
            layers.append((t - rg_open[tuple(r[2:])].pop(0), int(r[3])))
        elif ev.endswith("0") and ev.startswith("_"):
            dense_open[(ev[:-1], r[2])] = t
        elif ev.endswith("1") and ev.startswith("_") and (ev[:-1], r[2]) in dense_open:
            dense[ev[:-1]] += t - dense_open.pop((ev[:-1], r[2]))
    parts = defaultdict(list)
    for _, rows in tr["worker"]:
        me = next(r[2] for r in rows if r[1] == "self")
        ins, c0, c1, out0, out = [], [], [], {}, {}
        for r in rows:
            t, ev = float(r[0]), r[1]
            if ev == "w_in" and r[3] == "compute":
                ins.append((t, r[4]))
            elif ev == "w_c0":
                c0.append(t)
            elif ev == "w_c1":
                c1.append(t)
            elif ev in ("w_out0", "w_out") and r[3] == "result":
                (out0 if ev == "w_out0" else out)[r[4]] = t
        for (t_in, rid), a, b in zip(ins, c0, c1):
            key = (me, rid)
            if key not in sent or key not in got or rid not in out:
                continue
            parts["bb send"].append(sent[key] - sent0[key])
            parts["up"].append(t_in - sent[key] - one_way_s)
            parts["w queue"].append(a - t_in)
            parts["w compute"].append(b - a)
            parts["w reply"].append(out[rid] - b)
            parts["down"].append(got[key] - out[rid] - one_way_s)
            parts["round trip"].append(got[key] - sent0[key])
    lines = [f"{len(parts['round trip'])} expert requests, {len(layers)} layer dispatches "
             f"(one micro-batch's run_groups); ms: median / p90", "",
             "| hop | median ms | p90 ms |", "|---|---|---|"]
    for k in ("bb send", "up", "w queue", "w compute", "w reply", "down", "round trip"):
        lines.append(f"| {k} | {statistics.median(parts[k]) * 1e3:.1f} | {pct(parts[k], 0.9) * 1e3:.1f} |")
    rg = [d for d, _ in layers]
    lines.append(f"| layer dispatch (run_groups) | {statistics.median(rg) * 1e3:.1f} | {pct(rg, 0.9) * 1e3:.1f} |")
    lat_up = []
    for _, rows in tr["proxy"]:
        for r in rows:
            if r[1] == "p_out" and r[4] and t0 <= float(r[0]) <= t1:
                lat_up.append(float(r[4]))
    if lat_up:  # (no proxies at 0 ms)
        lines.append(f"| proxy lateness per chunk (sent - due) | {statistics.median(lat_up) * 1e3:.2f} | "
                     f"{pct(lat_up, 0.9) * 1e3:.2f} |")
    wall = t1 - t0
    lines += ["", "backbone dense path in the window: " + ", ".join(f"{k} {v:.2f} s" for k, v in dense.items())
              + f" of {wall:.2f} s wall"]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rtt", type=float, default=50.0)
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--micro-batches", default="auto")
    ap.add_argument("--kernel", default="ggml")
    ap.add_argument("--direct", action="store_true", help="expert requests on the workers' direct lanes")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="trace-layer-"))
    tdir = work / "trace"
    tdir.mkdir()
    model = work / "tiny-q8.gguf"
    make_model(model, preset="tiny", qtype="q8_0", seed=2, layers=4)
    sw = WanSwarm(model, ranges=RANGES, rtt_ms=args.rtt, workdir=work / "swarm", kernel=args.kernel, timeout_s=30,
                  backbone_args=["--micro-batches", args.micro_batches], wrapper=str(HERE / "trace_entry.py"),
                  direct=args.direct)
    sw.env["TRACE_DIR"] = str(tdir)
    with sw:
        sw.wait_covered()
        measure(sw, 2, 2)
        t0 = time.monotonic()
        res = [measure(sw, args.n, args.tokens) for _ in range(args.rounds)]
        t1 = time.monotonic()
    print(f"RTT {args.rtt:g} ms, N={args.n}, micro-batches {args.micro_batches}: tokens/s "
          + ", ".join(f"{r['tps']:.1f}" for r in res) + f"; steps {res[-1]['steps']}, "
          f"last micro-batches {res[-1]['micro_batches']}")
    print(analyse(tdir, t0, t1, args.rtt / 2000))


if __name__ == "__main__":
    main()
