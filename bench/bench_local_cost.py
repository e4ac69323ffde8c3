"""What the hot-expert path's cost model assumes: the backbone replica's seconds per (row, expert).

    python bench/bench_local_cost.py [--threads 1] [--append]

The hot-expert path (``Dispatcher._keep_hot_local``) prices an owner's share as rows x
``local_row_s``, one EWMA of the replica's measured seconds per (row, expert) pair, whatever the mix
of experts and rows. That is right if the cost is per pair, wrong if a large fixed cost per expert
(reading its weights) dominates: then a share of many experts with one row each costs more per
pair than one of few experts with many rows. This times ``forward_groups`` of the ggml kernel on
the 122B's routed-expert geometry (a synthetic 2-layer ``geometry-122b`` model, 5.3 MB Q4_K
experts, made in a temporary folder and removed) for 1-64 experts x 1-8 rows each, fresh experts
on every call (cold weights, as in decoding), and fits cost = a * experts + b * pairs: the per-pair
cost's spread and the fit say how far one per-pair rate can be off.
"""
from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
from common import header, publish

from p2pswarm.engine.kernels import make_bank
from p2pswarm.model.layout import ModelLayout
from p2pswarm.model.synth import make_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1, help="ggml threads (the swarm benches give every node 1)")
    ap.add_argument("--append", action="store_true", help="append the table to docs/benchmarks.md")
    args = ap.parse_args()
    if args.threads < 1:
        ap.error("--threads must be >= 1")
    work = Path(tempfile.mkdtemp(prefix="bench-local-cost-"))
    try:
        model = work / "geometry-122b.gguf"
        make_model(model, preset="geometry-122b", qtype="q8_0", seed=2)
        bank = make_bank(ModelLayout.open(model), "ggml", threads=args.threads)
        rng = np.random.default_rng(0)
        cur = rng.standard_normal((64, 3072)).astype(np.float32)

        def groups(e: int, r: int) -> list:
            return [(int(x), np.sort(rng.choice(64, r, replace=False)).astype(np.int64))
                    for x in rng.choice(256, e, replace=False)]

        rows = []
        for e in (1, 4, 16, 64):
            for r in (1, 2, 4, 8):
                bank.forward_groups(0, cur, groups(e, r))  # warm: the graph for this shape
                ts = []
                for _ in range(3):
                    g = groups(e, r)  # fresh experts each call
                    t0 = time.perf_counter()
                    bank.forward_groups(1, cur, g)
                    ts.append(time.perf_counter() - t0)
                rows.append((e, r, min(ts)))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    a = np.array([[e, e * r] for e, r, _ in rows], float)
    y = np.array([t for *_, t in rows])
    (per_expert, per_pair), *_ = np.linalg.lstsq(a, y, rcond=None)
    err = float(np.max(np.abs(a @ [per_expert, per_pair] - y) / y))
    per = y / a[:, 1]
    text = header("The replica's cost per (row, expert) at the 122B's expert geometry",
                  f"python bench/bench_local_cost.py --threads {args.threads}")
    text += (f"ggml kernel, {args.threads} thread(s), 5.3 MB Q4_K experts (3072 x 1024), fresh experts every call; "
             "best of 3.\n\n| experts | rows each | pairs | ms | ms per pair |\n|---|---|---|---|---|\n")
    text += "".join(f"| {e} | {r} | {e * r} | {t * 1e3:.2f} | {t / (e * r) * 1e3:.3f} |\n" for e, r, t in rows)
    text += (f"\nPer pair: {per.min() * 1e3:.3f}-{per.max() * 1e3:.3f} ms (max / min {per.max() / per.min():.2f}). "
             f"Fit: {per_expert * 1e3:.3f} ms per expert + {per_pair * 1e3:.3f} ms per pair "
             f"(largest error {100 * err:.0f}%).\n")
    publish(text, args.append)


if __name__ == "__main__":
    main()
