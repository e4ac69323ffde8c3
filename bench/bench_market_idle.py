"""What an idle swarm of ``node --role worker --auto`` processes costs, workers as DHT clients
(the default) vs DHT servers (``--dht server``), alternating A B A B in one run.

Why: tests/test_market_swarm.py is too short to show a steady state, and on 2 cores the cost of 30
interpreters decides whether it can pass at all. This starts what the test starts - a bootstrap,
a backbone serving shard downloads, N workers of 1-3 units of the tiny model in waves of ten -
waits until every worker is READY, lets it settle, then reads each process's CPU time from /proc
over a window (bench/proc_cpu.py) and stops everything.

    python bench/bench_market_idle.py [--workers 30] [--block 4] [--window 60] [--rounds 2] [--write]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, header, publish

sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "tests"))
from helpers.procs import read_first_lines as _ready, spawn_cli as _spawn, stop_all
from proc_cpu import sample

from p2pswarm.model.layout import ModelLayout
from p2pswarm.model.manifest import source_fingerprint
from p2pswarm.model.synth import make_model
from p2pswarm.net.signed.identity import load_or_create_identity
from p2pswarm.net.signed.tokens import issue_token


def one(mode: str, model: Path, n: int, block: int, window: float, settle: float, root: Path) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix=f"idle-{mode}-", dir=root))
    env = dict(os.environ, P2PSWARM_KERNEL="numpy", P2PSWARM_HOME=str(tmp / "home"), P2PSWARM_THREADS="1",
               OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", PYTHONPATH=str(REPO))
    issuer = load_or_create_identity(tmp / "issuer.key")
    fp = source_fingerprint(ModelLayout.open(model))
    manifest = tmp / "m.manifest"
    subprocess.run([sys.executable, "-m", "p2pswarm.cli", "manifest", "--model", str(model), "--key",
                    str(tmp / "issuer.key"), "--out", str(manifest)], env=env, check=True, capture_output=True)
    unit_mb = ModelLayout.open(model).expert_bytes(0) * block / 1e6
    memories = [f"{unit_mb * k + 0.5:.1f}MB" for k in (1, 2, 3)]
    procs: list[subprocess.Popen] = []
    try:
        boot = _spawn(["bootstrap", "--listen", "/ip4/127.0.0.1/tcp/0", "--identity", str(tmp / "boot.key")],
                      tmp / "boot.log", env)
        procs.append(boot)
        addr = _ready([boot], 90)[0].split()[1]
        bb = _spawn(["node", "--role", "backbone", "--model", str(model), "--manifest", str(manifest), "--bootstrap",
                     addr, "--http", "off", "--block-size", str(block), "--identity", str(tmp / "bb.key")],
                    tmp / "backbone.log", env)
        procs.append(bb)
        assert _ready([bb], 120)[0].startswith("READY"), (tmp / "backbone.log").read_text()[-2000:]
        t0 = time.monotonic()
        for wave in range(0, n, 10):
            batch = []
            for i in range(wave, min(n, wave + 10)):
                ident = load_or_create_identity(tmp / f"w{i}.key")
                token = issue_token(issuer, ident.peer_id_str, [f"shard:{fp}"], 3600).encode()
                batch.append(_spawn(["node", "--role", "worker", "--auto", "--memory", memories[i % 3], "--token",
                                     token, "--trust-issuer", issuer.peer_id_str, "--bootstrap", addr, "--identity",
                                     str(tmp / f"w{i}.key"), "--ttl", "30", "--enrol-period", "10", "--dht", mode],
                                    tmp / f"w{i}.log", env))
            procs += batch
            bad = [i for i, line in enumerate(_ready(batch, 300)) if not line.startswith("READY")]
            assert not bad, f"{mode}: workers {bad} of wave {wave} not ready"
        ready_s = time.monotonic() - t0
        time.sleep(settle)
        a, la = sample(str(tmp)), os.getloadavg()[0]
        time.sleep(window)
        b = sample(str(tmp))
        dt = b["t"] - a["t"]
        roles: dict[str, list[float]] = {}
        for pid, (role, cpu) in b["p"].items():
            if pid in a["p"]:
                roles.setdefault(role, []).append(100 * (cpu - a["p"][pid][1]) / dt)
        return {"mode": mode, "ready_s": ready_s, "roles": roles, "load": (la + os.getloadavg()[0]) / 2}
    finally:
        stop_all(procs[::-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=30)
    ap.add_argument("--block", type=int, default=4)
    ap.add_argument("--window", type=float, default=60.0)
    ap.add_argument("--settle", type=float, default=30.0, help="seconds after the last READY before measuring")
    ap.add_argument("--rounds", type=int, default=2, help="A B pairs (client, server)")
    ap.add_argument("--write", action="store_true", help="append the table to docs/benchmarks.md")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="market-idle-") as d:
        root = Path(d)
        model = root / "tiny-f32.gguf"
        make_model(model, preset="tiny", qtype="f32", seed=1)
        rows = []
        for r in range(args.rounds):
            for mode in ("client", "server"):
                res = one(mode, model, args.workers, args.block, args.window, args.settle, root)
                w = sorted(res["roles"].get("auto-worker", [0.0]))
                print(f"round {r + 1} {mode}: ready {res['ready_s']:.0f} s, worker median {statistics.median(w):.1f} %, "
                      f"sum {sum(w):.0f} %, bootstrap {sum(res['roles'].get('bootstrap', [0])):.0f} %, backbone "
                      f"{sum(res['roles'].get('backbone', [0])):.0f} %, load {res['load']:.1f}", flush=True)
                rows.append(res)
    cmd = (f"python bench/bench_market_idle.py --workers {args.workers} --block {args.block} --window "
           f"{args.window:.0f} --rounds {args.rounds}")
    text = header(f"Idle --auto swarm: workers as DHT clients vs servers ({args.workers} workers)", cmd)
    text += ("| round | worker DHT | all READY | idle worker CPU, median (max) | all workers | bootstrap | backbone "
             "| load avg |\n|---|---|---|---|---|---|---|---|\n")
    for i, res in enumerate(rows):
        w = sorted(res["roles"].get("auto-worker", [0.0]))
        text += (f"| {i // 2 + 1} | {res['mode']} | {res['ready_s']:.0f} s | {statistics.median(w):.1f} % ({w[-1]:.1f} %) "
                 f"| {sum(w):.0f} % | {sum(res['roles'].get('bootstrap', [0])):.0f} % | "
                 f"{sum(res['roles'].get('backbone', [0])):.0f} % | {res['load']:.1f} |\n")
    publish(text, args.write)


if __name__ == "__main__":
    main()
