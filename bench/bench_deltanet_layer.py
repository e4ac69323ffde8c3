"""One qwen35moe DeltaNet layer's ``pre_moe_batch``: the one-graph layer against the per-piece path.

    python bench/bench_deltanet_layer.py --model M.gguf [--rounds 5] [--reps 20] [--threads 2]

Both paths in one process, on the same weights (the ggml kernel's dense path), alternating A B A B
per round: ``graph`` is :mod:`p2pswarm.engine.arch.qwen35moe.deltanet_graph` (one ggml graph for the whole layer),
``pieces`` the previous path (fused input projections, numpy conv / norms / gates, the delta-rule
op, the output projection). Shapes: one decode token, 16 sequences decoding together (one row
each), and a 128-token prefill. Prints per-round medians of the milliseconds per call, the
median ratio pieces / graph (above 1: the graph is faster) and the graph-build share: the time
of building and reading back the graph without running it, from ``deltanet_graph`` with compute
replaced by a no-op.
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

from p2pswarm.engine.ggml import runner as ggml_runner
from p2pswarm.engine.arch import load_dense
from p2pswarm.model.layout import ModelLayout

SHAPES = {"decode 1": [1], "16 seqs x 1": [1] * 16, "prefill 128": [128]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=20, help="calls per path per round (prefill: a quarter)")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    layout = ModelLayout.open(a.model)
    model = load_dense(layout, "ggml", threads=a.threads)
    il = model.recurrent.index(True)
    real_graph = model._layer_graph
    rng = np.random.default_rng(0)
    print(f"{a.model.name}: layer {il}, {a.threads} threads, {a.rounds} rounds alternating graph / pieces")
    print("| shape | graph ms | pieces ms | pieces / graph | graph build + read-back ms |\n|---|---|---|---|---|")
    for shape, sizes in SHAPES.items():
        h = rng.standard_normal((sum(sizes), model.n_embd)).astype(np.float32)
        states = [model.new_state() for _ in sizes]
        segs = [(s, 0, n) for s, n in zip(states, sizes)]
        reps = max(2, a.reps // 4) if sum(sizes) > 16 else a.reps

        def timed(path: str) -> float:
            model._layer_graph = real_graph if path == "graph" else (lambda il, segments: None)
            model.pre_moe_batch(il, h, segs)  # warm
            t = time.perf_counter()
            for _ in range(reps):
                model.pre_moe_batch(il, h, segs)
            return (time.perf_counter() - t) / reps * 1e3

        g, p = [], []
        for _ in range(a.rounds):
            g.append(timed("graph"))
            p.append(timed("pieces"))
        model._layer_graph = real_graph
        real_compute = ggml_runner.GgmlRunner.compute
        ggml_runner.GgmlRunner.compute = lambda self, graph, macs: None  # build + read back only
        try:
            model.pre_moe_batch(il, h, segs)
            t = time.perf_counter()
            for _ in range(reps):
                model.pre_moe_batch(il, h, segs)
            build = (time.perf_counter() - t) / reps * 1e3
        finally:
            ggml_runner.GgmlRunner.compute = real_compute
        ratio = statistics.median(pi / gi for pi, gi in zip(p, g))
        print(f"| {shape} | {statistics.median(g):.2f} | {statistics.median(p):.2f} | {ratio:.2f}x | {build:.2f} |",
              flush=True)


if __name__ == "__main__":
    main()
