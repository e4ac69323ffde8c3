"""Batch invariance: are a sequence's logits independent of what else is in its step?

For S sequences (random prompts, a prefill then decode steps), compare each sequence run alone with
the same sequence stepped together with all the others, in both backbone modes:

* ``--no-batch-invariant`` (one router / expert / lm-head mat-mul over the rows of all sequences)
* ``batch_invariant`` (the default: every batch-sensitive mat-mul sees one sequence's rows)

Reports max |delta logit| and greedy-token agreement, and the step time of both modes (ratio to the
invariant mode, measured alternately A B A B), for each kernel.

    python bench/bench_invariance.py [--sequences 100] [--steps 4] [--kernel numpy --kernel ggml]
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import trio
from common import header

from p2pswarm.backbone.sessions.local import open_backbone
from p2pswarm.model.synth import make_model


async def run(model: Path, kernel: str, n_seq: int, n_steps: int, prompt_len: int) -> dict:
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 500, size=int(rng.integers(2, prompt_len + 1))).tolist() for _ in range(n_seq)]
    async with open_backbone(model, workers=0, kernel=kernel) as mono:
        bb = mono.backbone

        async def batched(invariant: bool) -> tuple[list[list[np.ndarray]], float]:
            states = [bb.new_state() for _ in prompts]
            feed = [list(p) for p in prompts]
            out: list[list[np.ndarray]] = [[] for _ in prompts]
            t = 0.0
            for _ in range(n_steps):
                t0 = time.perf_counter()
                rows = await bb.forward_batch(list(zip(feed, states)), last_only=True, batch_invariant=invariant)
                t += time.perf_counter() - t0
                for i, r in enumerate(rows):
                    out[i].append(r[-1])
                feed = [[int(np.argmax(o[-1]))] for o in out]  # greedy, each from its own logits
            return out, t

        async def alone() -> list[list[np.ndarray]]:
            res = []
            for p in prompts:
                st, feed, rows = bb.new_state(), list(p), []
                for _ in range(n_steps):
                    r = (await bb.forward_batch([(feed, st)], last_only=True))[0][-1]
                    rows.append(r)
                    feed = [int(np.argmax(r))]
                res.append(rows)
            return res

        ref = await alone()
        times = {True: [], False: []}
        got = {}
        for inv in (True, False, True, False):  # A B A B
            got[inv], t = await batched(inv)
            times[inv].append(t)
    res = {}
    for inv in (False, True):
        d = max(float(np.max(np.abs(a - b))) for sa, sb in zip(ref, got[inv]) for a, b in zip(sa, sb))
        agree = np.mean([int(np.argmax(a)) == int(np.argmax(b)) for sa, sb in zip(ref, got[inv])
                         for a, b in zip(sa, sb)])
        res[inv] = (d, float(agree), min(times[inv]))
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sequences", type=int, default=100)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=12)
    ap.add_argument("--kernel", action="append", default=None)
    ap.add_argument("--model", help="GGUF (default: a synthetic tiny q8_0 model)")
    ap.add_argument("--out", help="append the markdown table here (e.g. docs/benchmarks.md)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        model = Path(args.model) if args.model else Path(d) / "tiny-q8.gguf"
        if not args.model:
            make_model(model, preset="tiny", qtype="q8_0", seed=2)
        lines = ["| kernel | mode | max abs delta logit vs alone | greedy tokens equal | step time (ratio to invariant) |",
                 "|---|---|---|---|---|"]
        for kernel in args.kernel or ["numpy", "ggml"]:
            res = trio.run(run, model, kernel, args.sequences, args.steps, args.prompt_len)
            t_inv = res[True][2]
            for inv in (False, True):
                d, agree, t = res[inv]
                lines.append(f"| {kernel} | {'batch_invariant' if inv else '--no-batch-invariant'} | {d:.3g} | "
                             f"{agree * 100:.1f}% | {t:.3f} s ({t / t_inv:.2f}x) |")
    text = header("Batch invariance: each sequence alone vs stepped with all the others",
                  f"python bench/bench_invariance.py --sequences {args.sequences} --steps {args.steps}") + \
        f"{args.sequences} sequences, prompts of 2-{args.prompt_len} tokens, then {args.steps - 1} greedy decode steps; " \
        "monolithic backbone (the swarm computes the same bits).\n\n" + "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text)


if __name__ == "__main__":
    main()
