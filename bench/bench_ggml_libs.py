"""Which libggml: llama.cpp's (llama-cpp-python's lib/) vs another build, same kernel code, same files.

    pip install --target /tmp/ggmlpy ggml-python        # builds its bundled ggml from the sdist
    python bench/bench_ggml_libs.py --lib /tmp/ggmlpy/ggml/lib [--threads 1] [--rounds 3]

Times :class:`GgmlExpertBank` (our kernel) on the expert files bench_kernels.py writes, once per
library in child processes (two libggml builds cannot share one process), alternating A, B, A, B,
... ``--rounds`` times so both see the same background load; reports the fastest per library.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from bench_kernels import Q4_K, Q6_K, ROWS, write_expert_file
from common import header

CHILD = r"""
import json, sys, time
import numpy as np
from p2pswarm.engine.ggml import lib as gk
from p2pswarm.engine.experts import ggml_bank as ggml_experts
from p2pswarm.model.layout import ModelLayout
path, threads, repeat = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
lib = gk.load_libggml()
layout = ModelLayout.open(path)
bank = ggml_experts.GgmlExpertBank(layout, threads=threads)
experts = list(range(layout.n_expert))
out = {"kernel": lib.kernel_id}
rng = np.random.default_rng(1)
for n in (1, 8, 64, 256):
    x = rng.standard_normal((n, 3072)).astype(np.float32)
    for e in experts[:4]:
        bank.forward(0, e, x)
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        for e in experts:
            bank.forward(0, e, x)
        best = min(best, (time.perf_counter() - t) / len(experts))
    out[str(n)] = best
print(json.dumps(out))
"""


def run_child(lib_dir: str | None, path: Path, threads: int, repeat: int) -> dict:
    env = dict(os.environ)
    env.pop("P2PSWARM_GGML_LIB", None)
    if lib_dir:
        env["P2PSWARM_GGML_LIB"] = lib_dir
    repo = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = repo + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", CHILD, str(path), str(threads), str(repeat)],
                          capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"child failed ({lib_dir or 'llama-cpp-python'}):\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True, help="directory with the other build's libggml-base/libggml-cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--dir", default="/tmp/p2pswarm-bench")
    args = ap.parse_args()
    d = Path(args.dir)
    d.mkdir(parents=True, exist_ok=True)
    text = header("Which libggml: llama.cpp's vs another build (our ggml kernel on both)",
                  f"python bench/bench_ggml_libs.py --lib {args.lib} --threads {args.threads}")
    for label, down in (("Q4_K gate/up/down", Q4_K), ("Q4_K gate/up, Q6_K down", Q6_K)):
        path = write_expert_file(d / f"kernels-{args.experts}x-down{down}.gguf", down, args.experts)
        best: dict[str, dict] = {}
        for _ in range(args.rounds):
            for key, lib in (("a", None), ("b", args.lib)):
                got = run_child(lib, path, args.threads, args.repeat)
                prev = best.setdefault(key, got)
                for n in ROWS:
                    prev[str(n)] = min(prev[str(n)], got[str(n)])
        a, b = best["a"], best["b"]
        text += (f"\n### {label}, {args.experts} experts cycled (cold), {args.threads} threads\n\n"
                 f"A = `{a['kernel']}` (llama-cpp-python's lib/), B = `{b['kernel']}` ({args.lib})\n\n"
                 "| rows | A ms/expert | B ms/expert | B / A |\n|---|---|---|---|\n")
        for n in ROWS:
            text += f"| {n} | {a[str(n)] * 1e3:.3f} | {b[str(n)] * 1e3:.3f} | {b[str(n)] / a[str(n)]:.2f}x |\n"
    print(text)


if __name__ == "__main__":
    main()
