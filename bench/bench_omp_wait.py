"""Our engine's decode under OpenMP wait policies, on an idle machine and beside busy processes.

    python bench/bench_omp_wait.py M.gguf [--rounds 6] [--busy 0 1 2] [--spins 2000 20000] [--write]

Why: libggml-cpu's threads are libgomp's team, and the gap between two of our graphs is a libgomp
wait. p2pswarm sets ``GOMP_SPINCOUNT=1000`` (a ~25 us spin, then sleep) unless the user chose a
policy (``p2pswarm.engine.ggml.lib._short_omp_waits``), and runs each graph on the CPUs other
processes leave free (``p2pswarm.engine.ggml.cpu_share``); llama.cpp leaves libgomp's default, a long spin.
A spin wins when the cores are ours alone and loses when the thread we wait for needs the core we
spin on: this measures both, so the default can be judged. Each run is one fresh process of
``bench_vs_llama.py --child ours`` (an 8-token prompt, ``--decode`` tokens one at a time); the
policies alternate within each round (A B C A B C). ``--busy N`` starts N ``while True: pass``
processes for its rows: a co-tenant such as a worker on the same host.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

from bench_vs_llama import run_side
from common import header, publish

def decode_tps(a, policy: str) -> float:
    """One fresh ``bench_vs_llama.py --child ours`` process (its ``run_side``) under ``policy``."""
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        os.environ.pop(name, None)
    if policy == "passive":
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    else:
        os.environ["GOMP_SPINCOUNT"] = policy
    got = run_side(a, "ours")
    if isinstance(got, str):
        raise SystemExit(f"bench_omp_wait: the child failed: {got}")
    return float(got["decode_tps"])


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
    # what run_side reads: one sequence, a short prefill, no batch
    a.prefill, a.seqs, a.batch_steps, a.cold_prefill, a.ours_tree, a.timeout = 16, 1, 1, False, None, 600
    a.last_row = False  # (bench_vs_llama --last-row: only the prefill, not timed here)
    policies = ["passive"] + a.spins
    rows = []
    for busy in a.busy:
        hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
        try:
            runs: dict[str, list[float]] = {p: [] for p in policies}
            for _ in range(a.rounds):
                for p in policies:
                    runs[p].append(decode_tps(a, p))
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
