"""Tiny model decode: tokens/s monolithic vs N socket workers (separate OS processes).

    python bench/bench_decode.py [--arch qwen3moe|qwen35moe] [--workers 4] [--tokens 33] [--rounds 3]

Both runs decode the same tokens one at a time through the KV cache, in the same process, one
after the other; the ratio is what dispatching every layer's experts over local sockets costs (the
dense path - attention, DeltaNet, shared expert - stays on the backbone either way).
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import trio
from common import header

from p2pswarm.backbone.session import open_backbone
from p2pswarm.model.synth import make_model


async def decode_rate(model, workers, tokens, transport="socket") -> tuple[float, object]:
    async with open_backbone(model, workers=workers, transport=transport) as swarm:
        b = swarm.backbone
        state = b.new_state()
        await b.forward(tokens[:1], state)  # warm: caches, connections
        t = time.perf_counter()
        for tok in tokens[1:]:
            await b.forward([tok], state)
        dt = time.perf_counter() - t
        return (len(tokens) - 1) / dt, b.dispatcher.stats


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", choices=("qwen3moe", "qwen35moe"), default="qwen3moe")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=33)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / f"tiny-{args.arch}.gguf"
        make_model(model, arch=args.arch, preset="tiny")
        tokens = [(7 * i + 3) % 500 for i in range(args.tokens)]
        rows = []
        for _ in range(args.rounds):
            mono, _ = trio.run(decode_rate, model, 0, tokens)
            split, stats = trio.run(decode_rate, model, args.workers, tokens)
            inproc, _ = trio.run(decode_rate, model, args.workers, tokens, "inproc")
            rows.append((mono, split, inproc, stats))
    text = header(f"Tiny {args.arch} decode, monolithic vs {args.workers} socket workers",
                  f"python bench/bench_decode.py --arch {args.arch} --workers {args.workers} --tokens {args.tokens}")
    text += ("Tiny preset (4 layers, 16 experts top-4, n_embd 256). tokens/s over "
             f"{args.tokens - 1} decode steps.\n\n| round | monolithic | {args.workers} socket workers | "
             f"{args.workers} in-process workers | socket / monolithic |\n|---|---|---|---|---|\n")
    for i, (mono, split, inproc, _) in enumerate(rows):
        text += f"| {i + 1} | {mono:.1f} | {split:.1f} | {inproc:.1f} | {split / mono:.2f} |\n"
    st = rows[-1][3]
    text += (f"\nPer decode step with {args.workers} workers: {st.requests / (args.tokens):.1f} requests "
             f"({st.requests / max(st.layers, 1):.1f} per layer), one round trip per owner per layer.\n")
    print(text)


if __name__ == "__main__":
    main()
