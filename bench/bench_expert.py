"""One Q4_K expert at 3072x1024 (the 122B's geometry) for 1, 8, 64, 256 rows.

    python bench/bench_expert.py

Per row count: the ExpertBank's first call (dequantise with gguf.quants + compute), its cached call,
and the baseline: a plain numpy SwiGLU on weights dequantised beforehand. The ratio cached/baseline
shows what the bank adds on top of the mat-muls (should be ~1.0).
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
from common import header, median_time

from p2pswarm.engine import ops
from p2pswarm.engine.experts.numpy_bank import ExpertBank
from p2pswarm.model.layout import ModelLayout
from p2pswarm.model.synth import make_model


def main() -> None:
    d = Path("/tmp/p2pswarm-bench")
    d.mkdir(parents=True, exist_ok=True)
    model = d / "geometry-122b-1l.gguf"
    if not model.exists():
        make_model(model, preset="geometry-122b", layers=1)
    layout = ModelLayout.open(model)
    types = {k: t.ggml_type.name for k, t in layout.expert_tensors[0].items()}
    rng = np.random.default_rng(0)
    text = header("One Q4_K expert, 3072x1024 (numpy kernel)", "python bench/bench_expert.py")
    text += (f"Expert types {types}, {layout.expert_bytes(0):,} bytes. ms per expert call; median of 5 "
             "(first call: once, fresh expert each time).\n\n"
             "| rows | first call (dequantise + compute) | cached | plain numpy on pre-dequantised | cached / plain | first / plain |\n"
             "|---|---|---|---|---|---|\n")
    for i, n in enumerate((1, 8, 64, 256)):
        x = rng.standard_normal((n, 3072)).astype(np.float32)
        bank = ExpertBank(layout)
        e = 10 + i
        t = time.perf_counter()
        bank.forward(0, e, x)
        first = time.perf_counter() - t
        cached = median_time(lambda: bank.forward(0, e, x))
        gate, up, down = (np.array(a) for a in bank._weights(0, e))
        plain = median_time(lambda: ops.swiglu_expert(x, gate, up, down))
        text += (f"| {n} | {first * 1e3:.2f} | {cached * 1e3:.2f} | {plain * 1e3:.2f} | {cached / plain:.2f} | "
                 f"{first / plain:.0f} |\n")
    print(text)


if __name__ == "__main__":
    main()
