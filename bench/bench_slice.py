"""Slicing throughput vs `cp` of the same number of bytes, on the geometry-122b model.

    python bench/bench_slice.py [--layers 2] [--experts 64] [--dir /tmp/p2pswarm-bench]

Both read from the page cache (warmed first), and every run starts after a `sync`, so no run pays
for the write-back of an earlier one. Our slicer (which also computes a sha256 per tensor) fsyncs
before its atomic rename, so it is compared with `cp` + `sync` (like for like) and, timed without
its fsync, with plain `cp`. Runs alternate; the median of each is reported.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import time
from pathlib import Path

from common import geometry_model, header

from p2pswarm.model.slicer import slice_experts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=64, help="experts per layer in the slice")
    ap.add_argument("--dir", default="/tmp/p2pswarm-bench")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    d = Path(args.dir)
    model = geometry_model(d, args.layers)
    shard = d / "bench-shard.gguf"
    res = slice_experts(model, shard, None, (0, args.experts))
    n = res.nbytes
    blob = d / "bench-blob"
    with open(model, "rb") as f, open(blob, "wb") as g:
        g.write(f.read(n))
    subprocess.run(["cat", str(blob)], stdout=subprocess.DEVNULL, check=True)
    runs: dict[str, list[float]] = {"slice": [], "slice (no fsync)": [], "cp": [], "cp + sync": []}
    out = d / "bench-copy"

    def timed(name, fn):
        # Start each run from a clean page cache state: no dirty pages of an earlier run being
        # written back (the kernel throttles writers while it flushes them), no old output file.
        for p in (shard, out):
            p.unlink(missing_ok=True)
        subprocess.run(["sync"], check=True)
        t = time.perf_counter()
        fn()
        runs[name].append(time.perf_counter() - t)

    for _ in range(args.repeat):
        timed("slice", lambda: slice_experts(model, shard, None, (0, args.experts)))
        timed("slice (no fsync)", lambda: slice_experts(model, shard, None, (0, args.experts), fsync=False))
        timed("cp", lambda: subprocess.run(["cp", str(blob), str(out)], check=True))
        timed("cp + sync", lambda: (subprocess.run(["cp", str(blob), str(out)], check=True),
                                    subprocess.run(["sync", str(out)], check=True)))
    out.unlink(missing_ok=True)
    med = {k: statistics.median(v) for k, v in runs.items()}
    text = header("Slicing throughput vs cp (geometry-122b)", "python bench/bench_slice.py " + f"--layers {args.layers} --experts {args.experts}")
    text += (f"Slice: experts 0-{args.experts - 1} of {args.layers} layers, {n / 1e6:.0f} MB of tensor data "
             f"(model {model.stat().st_size / 1e9:.2f} GB, one expert {res.nbytes // (args.experts * args.layers):,} bytes). "
             f"Median of {args.repeat}.\n\n| run | seconds | MB/s |\n|---|---|---|\n")
    for k, v in med.items():
        text += f"| {k} | {v:.3f} | {n / v / 1e6:.0f} |\n"
    text += (f"\nRatios (throughput, higher is better for the slicer): slice / (cp + sync) = "
             f"**{med['cp + sync'] / med['slice']:.2f}**, slice (no fsync) / cp = **{med['cp'] / med['slice (no fsync)']:.2f}**, "
             f"slice / cp = {med['cp'] / med['slice']:.2f}. Goal >= 0.8.\n")
    print(text)
    for p in (shard, blob):
        p.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
