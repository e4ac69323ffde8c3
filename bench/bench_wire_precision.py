"""How far ``--wire-precision f16|bf16`` moves our logits from llama.cpp's.

For synthetic models (``--type``: f32, q8_0, q4_k_m; tiny preset, 32 tokens), the backbone alone at
each precision against llama.cpp's all-position logits (tests/helpers/llama_ref.py: F32 KV cache,
flash attention off): max |difference| relative to max |logit|, RMS difference, and the share of
positions whose argmax (greedy token) agrees. The f32 row is today's distance (the kernel's own
rounding), the others what the 16-bit outputs add.

    python bench/bench_wire_precision.py [--type f32 --type q8_0 --type q4_k_m]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import trio
from common import header

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from helpers.llama_ref import llama_logits

from p2pswarm.backbone.sessions.local import open_backbone
from p2pswarm.model.synth import make_model
from p2pswarm.backbone.serving.generate import sequence_logits

TOKENS = [5, 211, 37, 90, 14, 14, 14, 302, 8, 66, 129, 3, 250, 77, 41, 19, 180, 222, 6, 51, 97, 140, 12, 260,
          33, 71, 2, 118, 199, 45, 88, 301]


async def ours(path: Path, precision: str | None) -> np.ndarray:
    async with open_backbone(path) as mono:
        mono.backbone.dispatcher.set_wire_precision(precision)
        return await sequence_logits(mono.backbone, TOKENS)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--type", action="append", default=None)
    args = ap.parse_args()
    lines = ["| model | wire precision | max abs diff / max abs logit | RMS diff | argmax agrees |",
             "|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory(prefix="wire-precision-") as d:
        for qtype in args.type or ["f32", "q8_0", "q4_k_m"]:
            path = Path(d) / f"tiny-{qtype}.gguf"
            make_model(path, preset="tiny", qtype=qtype, seed=11)
            ref = llama_logits(path, TOKENS)
            scale = float(np.abs(ref).max())
            for p in (None, "f16", "bf16"):
                got = trio.run(ours, path, p)
                diff = np.abs(got - ref)
                agree = float(np.mean(got.argmax(-1) == ref.argmax(-1)))
                lines.append(f"| tiny {qtype} | {p or 'f32 (default)'} | {diff.max() / scale:.2e} | "
                             f"{np.sqrt(np.mean(diff ** 2)):.2e} | {agree:.0%} |")
                print(lines[-1], flush=True)
    text = header("--wire-precision: distance to llama.cpp", "python bench/bench_wire_precision.py") + (
        f"Backbone alone at each precision vs llama.cpp's logits, {len(TOKENS)} positions, tiny synthetic models.\n\n"
    ) + "\n".join(lines) + "\n"
    print(text)


if __name__ == "__main__":
    main()
