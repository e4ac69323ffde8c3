"""CPU and wall seconds of one deepseek2 MLA layer (``pre_moe`` of a MoE layer) on the ggml kernel:
a 128-row prefill, then 8 one-row decode steps after it, medians over rounds.

Why: the whole-model bench (bench_vs_llama.py) runs on a shared machine whose load moves wall
clock by several x; the process CPU time of the attention layer alone says what a change to it
did. Run it from each tree (``PYTHONPATH=tree``) for before/after, alternating:

    python bench/bench_mla_layer.py g671.gguf --rounds 2
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from p2pswarm.engine.arch import load_dense
from p2pswarm.model.layout import ModelLayout


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a deepseek2 GGUF (e.g. make-model --preset geometry-671b --layers 2)")
    ap.add_argument("--layer", type=int, default=None, help="the layer (default: the first MoE layer)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prefill", type=int, default=128)
    ap.add_argument("--decode", type=int, default=8)
    a = ap.parse_args(argv)
    model = load_dense(ModelLayout.open(a.model), "ggml")
    if getattr(model, "arch", "") != "deepseek2":
        print(f"{a.model}: not a deepseek2 model", file=sys.stderr)
        return 2
    il = model.n_dense_lead if a.layer is None else a.layer
    n = a.prefill + a.decode
    h = np.random.default_rng(0).standard_normal((n, model.n_embd)).astype(np.float32) * 0.1
    model.pre_moe(il, h[:a.prefill], model.new_state(), 0)  # page the weights in
    res = []
    for _ in range(a.rounds):
        st = model.new_state()
        c0, w0 = time.process_time(), time.perf_counter()
        model.pre_moe(il, h[:a.prefill], st, 0)
        c1, w1 = time.process_time(), time.perf_counter()
        for i in range(a.prefill, n):
            model.pre_moe(il, h[i:i + 1], st, i)
        c2, w2 = time.process_time(), time.perf_counter()
        res.append((c1 - c0, w1 - w0, (c2 - c1) / a.decode, (w2 - w1) / a.decode))
    m = np.median(np.array(res), axis=0)
    print(f"layer {il}: prefill-{a.prefill} CPU {m[0]:.3f} s wall {m[1]:.3f} s | decode step CPU {m[2]:.4f} s "
          f"wall {m[3]:.4f} s | one-graph layer {model._ggml_core()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
