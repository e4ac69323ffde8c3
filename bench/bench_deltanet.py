"""Gated DeltaNet prefill: the chunked form vs the recurrent form, tokens/s.

    python bench/bench_deltanet.py [--tokens 64,256,1024] [--geometry tiny,122b] [--blas-threads 1]

Times the delta-rule core of one linear-attention layer (what differs between the two forms; the
projections, conv and norms around it are the same code either way) on random l2-normalised q/k,
for the tiny qwen35moe preset's heads (Hv 4, d 32) and the 122B's (Hv 64, d 128). The recurrent
form is what decode runs (one token per call); the chunked form is what prefill runs. The last
column checks that both computed the same thing.

The chunked form is batched small mat-muls (64 heads x 64 x 128), where OpenBLAS's worker threads
spin; on a busy 2-core machine that made it erratic (0.4x-3x of the recurrent form from one run to
the next). ``--blas-threads`` (default 1) pins the BLAS thread count before numpy loads, so the
numbers are reproducible; ``--blas-threads 0`` leaves the environment as it is.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from common import header, median_time


def _blas_threads_from_argv() -> str | None:
    """--blas-threads must act before numpy is imported, so read it ahead of argparse."""
    for i, a in enumerate(sys.argv):
        if a == "--blas-threads" and i + 1 < len(sys.argv):
            return sys.argv[i + 1]
        if a.startswith("--blas-threads="):
            return a.split("=", 1)[1]
    return "1"


_THREADS = _blas_threads_from_argv()
if _THREADS and _THREADS != "0":
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = _THREADS

import numpy as np

from p2pswarm.engine.arch.qwen35moe import deltanet

GEOMETRIES = {"tiny": (4, 32), "122b": (64, 128)}  # (Hv, d)


def inputs(T: int, H: int, d: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    q = deltanet.l2_norm(rng.standard_normal((T, H, d)).astype(np.float32), 1e-6)
    k = deltanet.l2_norm(rng.standard_normal((T, H, d)).astype(np.float32), 1e-6)
    v = rng.standard_normal((T, H, d)).astype(np.float32)
    a = -np.exp(rng.uniform(np.log(0.02), np.log(0.5), (1, H))).astype(np.float32)
    g = deltanet.softplus(rng.standard_normal((T, H)).astype(np.float32)) * a
    beta = (1 / (1 + np.exp(-rng.standard_normal((T, H))))).astype(np.float32)
    return q, k, v, g, beta, np.zeros((H, d, d))


def timed(fn, budget_s: float = 3.0) -> float:
    """Median of a few runs; fewer when one run is slow (keeps the benchmark to a minute or so)."""
    t = time.perf_counter()
    fn()
    once = time.perf_counter() - t
    repeat = max(3, min(7, int(budget_s / max(once, 1e-6))))
    return median_time(fn, repeat=repeat, warmup=0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="64,256,1024")
    ap.add_argument("--geometry", default="tiny,122b")
    ap.add_argument("--blas-threads", default="1", help="BLAS threads (0: leave the environment alone)")
    args = ap.parse_args()
    lengths = [int(x) for x in args.tokens.split(",")]
    text = header("Gated DeltaNet prefill: chunked vs recurrent",
                  f"python bench/bench_deltanet.py --tokens {args.tokens} --geometry {args.geometry} "
                  f"--blas-threads {args.blas_threads}")
    blas = os.environ.get("OPENBLAS_NUM_THREADS", "unset")
    text += (f"OPENBLAS_NUM_THREADS={blas}. "
             "Delta-rule core of one linear-attention layer (float64 inside, chunks of 64), tokens/s; "
             "relative diff = max |chunked - recurrent| / max |recurrent| of the outputs.\n\n"
             "| heads (Hv x d) | tokens | recurrent tok/s | chunked tok/s | chunked / recurrent | relative diff |\n"
             "|---|---|---|---|---|---|\n")
    for geo in args.geometry.split(","):
        H, d = GEOMETRIES[geo]
        for T in lengths:
            x = inputs(T, H, d)
            rec_s = timed(lambda: deltanet.delta_rule_recurrent(*x))
            chk_s = timed(lambda: deltanet.delta_rule_chunked(*x))
            o_r, _ = deltanet.delta_rule_recurrent(*x)
            o_c, _ = deltanet.delta_rule_chunked(*x)
            rel = float(np.abs(o_c - o_r).max() / np.abs(o_r).max())
            text += (f"| {geo} ({H} x {d}) | {T} | {T / rec_s:,.0f} | {T / chk_s:,.0f} | {rec_s / chk_s:.1f}x "
                     f"| {rel:.1e} |\n")
    print(text)


if __name__ == "__main__":
    main()
