"""Tiny qwen35moe decode: tokens/s monolithic vs N socket workers (separate OS processes).

    python bench/bench_qwen35_decode.py [--workers 4] [--tokens 33] [--rounds 3]

Same method as bench_decode.py (qwen3moe), on the seed's own architecture: both runs decode the
same tokens one at a time (DeltaNet layers carry conv rows and S, the attention layer its KV
cache), in the same process, one after the other. The ratio is what dispatching every layer's
routed experts over local sockets costs; the dense path (DeltaNet, attention, shared expert) stays
on the backbone either way.
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
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=33)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "tiny-qwen35moe.gguf"
        make_model(model, arch="qwen35moe", preset="tiny")
        tokens = [(7 * i + 3) % 500 for i in range(args.tokens)]
        rows = []
        for _ in range(args.rounds):
            mono, _ = trio.run(decode_rate, model, 0, tokens)
            split, stats = trio.run(decode_rate, model, args.workers, tokens)
            inproc, _ = trio.run(decode_rate, model, args.workers, tokens, "inproc")
            rows.append((mono, split, inproc, stats))
    text = header(f"Tiny qwen35moe decode, monolithic vs {args.workers} socket workers",
                  f"python bench/bench_qwen35_decode.py --workers {args.workers} --tokens {args.tokens}")
    text += ("Tiny qwen35moe preset (3 Gated DeltaNet layers + 1 gated-attention layer, 16 experts top-4 "
             f"+ shared expert, n_embd 256). tokens/s over {args.tokens - 1} decode steps.\n\n"
             f"| round | monolithic | {args.workers} socket workers | {args.workers} in-process workers "
             "| socket / monolithic |\n|---|---|---|---|---|\n")
    for i, (mono, split, inproc, _) in enumerate(rows):
        text += f"| {i + 1} | {mono:.1f} | {split:.1f} | {inproc:.1f} | {split / mono:.2f} |\n"
    st = rows[-1][3]
    text += (f"\nPer decode step with {args.workers} workers: {st.requests / args.tokens:.1f} requests "
             f"({st.requests / max(st.layers, 1):.1f} per layer), one round trip per owner per layer.\n")
    print(text)


if __name__ == "__main__":
    main()
