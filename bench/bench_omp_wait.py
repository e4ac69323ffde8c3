"""Our engine's decode under OpenMP wait policies, on an idle machine and beside busy processes.

    python bench/bench_omp_wait.py M.gguf [--rounds 6] [--busy 0 1 2] [--spins 2000 20000] [--write]

Why: libggml-cpu's threads are libgomp's team, and the gap between two of our graphs is a libgomp
wait. p2pswarm sets ``OMP_WAIT_POLICY=PASSIVE`` (sleep at once) unless the user chose a policy
(``p2pswarm.engine.ggml_kernel._passive_omp_waits``); llama.cpp leaves libgomp's default, a spin.
A spin wins when the cores are ours alone and loses when the thread we wait for needs the core we
spin on: this measures both, so the default can be judged. Each run is one fresh process of
``bench_vs_llama.py --child ours`` (an 8-token prompt, ``--decode`` tokens one at a time); the
policies alternate within each round (A B C A B C). ``--busy N`` starts N ``while True: pass``
processes for its rows: a co-tenant such as a worker on the same host.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from common import header, publish, warm_page_cache

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def decode_tps(model: Path, policy: str, decode: int, threads: int) -> float:
    env = dict(os.environ, PYTHONPATH=str(REPO), P2PSWARM_THREADS=str(threads))
    env.pop("OMP_WAIT_POLICY", None)
    env.pop("GOMP_SPINCOUNT", None)
    if policy == "passive":
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    else:
        env["GOMP_SPINCOUNT"] = policy
    cmd = [sys.executable, str(HERE / "bench_vs_llama.py"), "--child", "ours", "--model", str(model),
           "--threads", str(threads), "--decode", str(decode), "--prefill", "16", "--seqs", "1", "--batch-steps", "1"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    if p.returncode != 0:
        raise SystemExit(f"bench_omp_wait: the child failed: {(p.stderr.strip().splitlines() or [''])[-1][:200]}")
    return float(json.loads(p.stdout.strip().splitlines()[-1])["decode_tps"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--busy", type=int, nargs="+", default=[0, 1, 2], help="busy processes beside it, per row")
    ap.add_argument("--spins", nargs="+", default=["2000", "20000"], help="GOMP_SPINCOUNT values against passive")
    ap.add_argument("--decode", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--write", action="store_true", help="append the table to docs/benchmarks.md")
    a = ap.parse_args(argv)
    if not a.model.is_file():
        raise SystemExit(f"bench_omp_wait: {a.model}: no such file")
    warm_page_cache(a.model)
    policies = ["passive"] + a.spins
    rows = []
    for busy in a.busy:
        hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
        try:
            runs: dict[str, list[float]] = {p: [] for p in policies}
            for _ in range(a.rounds):
                for p in policies:
                    runs[p].append(decode_tps(a.model, p, a.decode, a.threads))
        finally:
            for h in hogs:
                h.kill()
                h.wait()
        base = statistics.median(runs["passive"])
        cells = [f"{statistics.median(runs[p]):.1f} ({statistics.median(runs[p]) / base:.2f}x)" for p in policies]
        rows.append(f"| {busy} | " + " | ".join(cells) + " |")
        print(rows[-1], {p: [round(v, 1) for v in r] for p, r in runs.items()}, flush=True)
    cmd = "python bench/bench_omp_wait.py " + " ".join(sys.argv[1:] if argv is None else argv)
    text = (header(f"OpenMP wait policy: decode tok/s, {a.model.name}", cmd)
            + f"{a.rounds} rounds alternating, medians, {a.threads} threads; ratio to passive in brackets.\n\n"
            + "| busy processes | " + " | ".join("passive" if p == "passive" else f"GOMP_SPINCOUNT={p}" for p in policies)
            + " |\n|---|" + "---|" * len(policies) + "\n" + "\n".join(rows) + "\n")
    publish(text, a.write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
