"""Kept graphs against graphs built every call: a qwen35moe layer's ``pre_moe_batch`` per decode step.

    python bench/bench_graph_cache.py --model M.gguf [--seqs 16] [--rounds 8] [--steps 6] [--threads 2]

One process, the ggml kernel's dense path, ``--seqs`` sequences decoding together (one row each,
after a 4-token prompt). Rounds alternate the dense runner's graph cache off (``graph_cache_bytes
= 0``: every call builds its graph through ctypes in the reset scratch context, as before) and on
(the default: the step's graphs kept from its second build on). Per layer kind it prints the
median milliseconds per call, and the part of it outside ``runner.compute`` (Python: building or
looking up the graph, filling its inputs, reading its outputs), off and on, and on / off.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from common import time_compute

from p2pswarm.engine.arch import load_dense
from p2pswarm.model.layout import ModelLayout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6, help="decode steps per round and mode (the first 2 not timed)")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    model = load_dense(ModelLayout.open(a.model), "ggml", threads=a.threads)
    runner = model.backend.runner
    cache_bytes = runner.graph_cache_bytes
    compute_s = time_compute(runner)
    rng = np.random.default_rng(0)
    E = model.n_embd
    states = [model.new_state() for _ in range(a.seqs)]
    for st in states:
        h = rng.standard_normal((4, E)).astype(np.float32)
        for il in range(model.n_layer):
            model.pre_moe_batch(il, h, [(st, 0, 4)])
        st.n_past = 4
    rows = [rng.standard_normal((a.seqs, E)).astype(np.float32) for _ in range(a.steps)]
    wall = {(il, on): [] for il in range(model.n_layer) for on in (False, True)}
    python = {k: [] for k in wall}
    for _ in range(a.rounds):
        for on in (False, True):
            runner.graph_cache_bytes = cache_bytes if on else 0
            if not on:
                runner.forget_graphs()
            for k in range(a.steps):
                for il in range(model.n_layer):
                    compute_s[0] = 0.0
                    t = time.perf_counter()
                    model.pre_moe_batch(il, rows[k], [(st, st.n_past, 1) for st in states])
                    dt = time.perf_counter() - t
                    if k >= 2:
                        wall[(il, on)].append(dt)
                        python[(il, on)].append(dt - compute_s[0])
                for st in states:
                    st.n_past += 1
    print(f"{a.seqs} sequences, {a.rounds} rounds x {a.steps - 2} timed steps per mode; ms per call, median")
    print("| layer | kind | off: call | off: Python | on: call | on: Python | call on/off | Python on/off |")
    print("|---|---|---|---|---|---|---|---|")
    for il in range(model.n_layer):
        w0, w1 = statistics.median(wall[(il, False)]), statistics.median(wall[(il, True)])
        p0, p1 = statistics.median(python[(il, False)]), statistics.median(python[(il, True)])
        kind = "DeltaNet" if model.recurrent[il] else "attention"
        print(f"| {il} | {kind} | {w0 * 1e3:.2f} | {p0 * 1e3:.3f} | {w1 * 1e3:.2f} | {p1 * 1e3:.3f} | "
              f"{w1 / w0:.3f} | {p1 / p0:.2f} |")
    print(f"graph stats: {runner.graph_stats}")


if __name__ == "__main__":
    main()
