"""One qwen35moe gated-attention layer under the ggml kernel: the one-graph layer against the
per-piece path (ggml projections, numpy norms / IMROPE / attention / gate between them).

    python bench/bench_attention_layer.py --model M.gguf [--rounds 3] [--context 64] [--seqs 16]
                                          [--prefill 128] [--threads 2]

In one process, the two alternate A B A B (``Qwen35MoE.attention_graph`` off / on) for
``--rounds`` rounds on the first attention layer of the file; each round times, per path:

* decode, 1 sequence: one row at a time after a ``--context``-token prefill;
* decode, ``--seqs`` sequences: one ``pre_moe_batch`` of one row each (every sequence with
  ``--context`` tokens in its cache) — what the scheduler's batched step runs;
* prefill: ``--prefill`` rows of a fresh sequence in one call.

It prints milliseconds per call (medians over rounds, and every round) and the ratio per-piece /
one graph (above 1: the graph is faster), plus the share of a one-graph call spent outside
``runner.compute`` (building the graph, copying in and out): what caching graphs could save.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import time_compute

from p2pswarm.engine.arch import load_dense
from p2pswarm.model.layout import ModelLayout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--context", type=int, default=64, help="tokens in each sequence's cache before decoding (64)")
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--prefill", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    if not a.model.is_file():
        sys.exit(f"error: no such model file: {a.model}")
    model = load_dense(ModelLayout.open(a.model), "ggml", threads=a.threads)
    if getattr(model, "arch", "") != "qwen35moe":
        sys.exit(f"error: {a.model} is not a qwen35moe model")
    il = next(i for i in range(model.n_layer) if not model.recurrent[i])
    runner = model.backend.runner
    in_compute = time_compute(runner)
    rng = np.random.default_rng(0)
    E = model.n_embd

    def rows(n):
        return rng.standard_normal((n, E)).astype(np.float32)

    def primed(n_seqs):
        sts = [model.new_state() for _ in range(n_seqs)]
        for st in sts:
            model.pre_moe(il, rows(a.context), st, 0)
        return sts

    def decode(n_seqs, steps):
        sts, h = primed(n_seqs), rows(n_seqs)
        in_compute[0] = 0.0
        t = time.perf_counter()
        for i in range(steps):
            model.pre_moe_batch(il, h, [(st, a.context + i, 1) for st in sts])
        wall = time.perf_counter() - t
        return wall / steps, 1.0 - in_compute[0] / wall

    def prefill(steps):
        h = rows(a.prefill)
        in_compute[0] = 0.0
        t = time.perf_counter()
        for _ in range(steps):
            model.pre_moe(il, h, model.new_state(), 0)
        wall = time.perf_counter() - t
        return wall / steps, 1.0 - in_compute[0] / wall

    cases = {"decode, 1 sequence": lambda: decode(1, 32), f"decode, {a.seqs} sequences": lambda: decode(a.seqs, 16),
             f"prefill {a.prefill}": lambda: prefill(4)}
    print(f"layer {il} of {a.model.name}: E {E}, H {model.n_head}, Hkv {model.n_head_kv}, hd {model.head_dim}; "
          f"{a.threads} threads; context {a.context}; {a.rounds} rounds, per-piece and one graph alternating\n")
    print("| call | per-piece ms | one graph ms | per-piece / one graph | one graph: outside compute |")
    print("|---|---|---|---|---|")
    for name, fn in cases.items():
        got: dict[bool, list[float]] = {False: [], True: []}
        outside = []
        for _ in range(a.rounds):
            for graph in (False, True):
                model.attention_graph = graph
                dt, out_share = fn()
                got[graph].append(dt)
                if graph:
                    outside.append(out_share)
        p, g = float(np.median(got[False])), float(np.median(got[True]))
        per_round = ", ".join(f"{x / y:.2f}" for x, y in zip(got[False], got[True]))
        print(f"| {name} | {p * 1e3:.2f} | {g * 1e3:.2f} | {p / g:.2f}x (rounds {per_round}) | "
              f"{100 * float(np.median(outside)):.0f}% |")


if __name__ == "__main__":
    main()
