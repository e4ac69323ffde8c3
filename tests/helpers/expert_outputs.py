"""Every expert of a model on fixed rows, written to an .npz: run the same on two machines, compare.

    python expert_outputs.py MODEL.gguf ROWS.npy OUT.npz --kernel portable [--impl c|numpy]

Used by the cross-ISA tests (this machine against the aarch64 root under qemu) and by
bench/bench_portable.py. Key ``L<layer>E<expert>`` holds the (n, n_embd) float32 output; the rows
are the first n_embd columns of ROWS.npy (so one file serves models of any width).
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("rows")
    ap.add_argument("out")
    ap.add_argument("--kernel", default="portable")
    ap.add_argument("--impl", choices=("c", "numpy"), default=None, help="portable kernel implementation")
    ap.add_argument("--experts", type=int, default=0, help="only the first N experts of each layer (0: all)")
    args = ap.parse_args(argv)

    from p2pswarm.engine.kernels import make_bank
    from p2pswarm.engine.experts.portable_kernel import PortableExpertBank
    from p2pswarm.model.layout import ModelLayout

    layout = ModelLayout.open(args.model)
    if args.kernel == "portable":
        bank = PortableExpertBank(layout, threads=1, implementation=args.impl)
    else:
        bank = make_bank(layout, args.kernel, threads=1)
    E = int(layout.hparam("embedding_length", required=True))
    rows = np.ascontiguousarray(np.load(args.rows)[:, :E], dtype=np.float32)
    out = {}
    t0 = time.perf_counter()
    n_exp = args.experts or (layout.expert_end - layout.expert_begin)
    for layer in layout.expert_layers:
        for e in range(layout.expert_begin, layout.expert_begin + n_exp):
            out[f"L{layer}E{e}"] = bank.forward(layer, e, rows)
    dt = time.perf_counter() - t0
    np.savez(args.out, **out)
    print(f"{bank.kernel} {getattr(bank, 'implementation', '')} {len(out)} experts x {rows.shape[0]} rows "
          f"in {dt:.2f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
