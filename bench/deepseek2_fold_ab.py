"""deepseek2's layer graph with its FFN side folded in, against the same layer as pieces, in ONE process.

    python bench/deepseek2_fold_ab.py --model M.gguf [--threads 2] [--blocks 10] [--steps 4] [--prefill 16]

One monolithic backbone on the ggml kernel; ``DeepSeek2.ggml_ffn`` switches between the two ways of
running a layer (True: ``ffn_norm``, the router and the dense FFN / shared expert in the MLA
layer's graph; False: a graph each, numpy between), alternating A B B A over ``--blocks`` blocks:
``--steps`` decode steps of a sequence per way (two sequences, one per way), then with
``--prefill N`` the same for prefills of N tokens (last row only, a fresh sequence each). Prints
process CPU and wall milliseconds per step / prefill, medians, and the median of the blocks'
CPU ratios. Why in one process: between processes the same code's decode CPU moves by ~10% on this
shared machine (how the model's pages are mapped, what the neighbours run), more than the change.
"""
from __future__ import annotations

import argparse
import statistics
import time

import trio
from common import warm_page_cache

from p2pswarm.backbone.sessions.local import open_backbone


async def run(a) -> None:
    async with open_backbone(a.model, workers=0, kernel="ggml", threads=a.threads) as swarm:
        b, m = swarm.backbone, swarm.backbone.model
        vocab = min(500, m.n_vocab)

        def tokens(n: int, seed: int) -> list[int]:
            return [(seed * 131 + 7 * i) % vocab for i in range(n)]

        ways = {"folded": True, "pieces": False}
        states = {w: b.new_state() for w in ways}
        for w, st in states.items():
            m.ggml_ffn = ways[w]
            await b.forward(tokens(8, 1), st)
            await b.forward(tokens(1, 2), st)

        async def decode(w: str, r: int) -> None:
            for t in tokens(a.steps, 10 + r):
                await b.forward([t], states[w])

        async def prefill(w: str, r: int) -> None:
            await b.forward_batch([(tokens(a.prefill, 3 + r), b.new_state())], last_only=True)

        for what, fn, per in (("decode step", decode, a.steps), (f"prefill-{a.prefill}", prefill, 1)):
            if what.startswith("prefill") and not a.prefill:
                continue
            cpu: dict[str, list[float]] = {w: [] for w in ways}
            wall: dict[str, list[float]] = {w: [] for w in ways}
            for r in range(a.blocks + 1):  # block 0 warms each way's graphs, untimed
                for w in (tuple(ways) if r % 2 == 0 else tuple(reversed(ways))):
                    m.ggml_ffn = ways[w]
                    c0, w0 = time.process_time(), time.perf_counter()
                    await fn(w, r)
                    if r:
                        cpu[w].append(1e3 * (time.process_time() - c0) / per)
                        wall[w].append(1e3 * (time.perf_counter() - w0) / per)
            for w in ways:
                print(f"{what}, {w}: CPU ms median {statistics.median(cpu[w]):.2f} (min {min(cpu[w]):.2f}), "
                      f"wall ms median {statistics.median(wall[w]):.2f}")
            ratios = [f / p for f, p in zip(cpu["folded"], cpu["pieces"])]
            print(f"{what}: folded / pieces CPU, median of {a.blocks} blocks {statistics.median(ratios):.3f} "
                  f"({min(ratios):.3f}-{max(ratios):.3f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--blocks", type=int, default=10)
    ap.add_argument("--steps", type=int, default=4, help="decode steps per block and way")
    ap.add_argument("--prefill", type=int, default=0, help="also prefills of this many tokens (0: none)")
    a = ap.parse_args()
    warm_page_cache(a.model)
    trio.run(run, a)


if __name__ == "__main__":
    main()
