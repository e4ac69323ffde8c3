"""The backbone's decode step under two source trees, alternating processes: CPU and wall seconds per token.

    python bench/decode_ab.py --model M.gguf --trees BEFORE AFTER [--rounds 4] [--steps 64] [--threads 2]

Each round runs one process per tree (``PYTHONPATH=TREE``), A B A B: the model opened as a monolithic
backbone on the ggml kernel, an 8-token prompt and 8 warm-up tokens, then ``--steps`` tokens one
``Backbone.forward`` each, timed (process CPU seconds and wall seconds per token, ggml graphs a
step, and the wall time a step spends outside ``GgmlRunner.compute``: Python, numpy, ctypes and
the hand-offs between graphs, steadier than the wall time on a shared machine; and the sleeps a
step: voluntary context switches of all the process's threads, libgomp's futex waits and the thread
hop, what a longer OpenMP spin would save). Prints each round
and the medians. What a refactoring of the layer loop that claims "no slower" is checked with
when the whole ``bench_vs_llama.py`` run is too noisy (its decode is 12 steps, beside llama.cpp).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def sleeps() -> int:
    """Voluntary context switches of every thread of this process so far (Linux; 0 elsewhere)."""
    n = 0
    try:
        for t in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{t}/status") as f:
                n += sum(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))
    except OSError:
        return 0
    return n


async def child(model: str, steps: int, threads: int) -> None:
    from p2pswarm.backbone.sessions.local import open_backbone
    from p2pswarm.engine.ggml.runner import GgmlRunner

    seen = {"graphs": 0, "in_compute": 0.0}  # graphs a step, and the wall time inside them
    compute = GgmlRunner.compute

    def counted(self, graph, macs):
        t = time.perf_counter()
        try:
            return compute(self, graph, macs)
        finally:
            seen["graphs"] += 1
            seen["in_compute"] += time.perf_counter() - t

    GgmlRunner.compute = counted  # type: ignore[method-assign]

    async with open_backbone(model, workers=0, kernel="ggml", threads=threads) as local:
        bb = local.backbone
        st = bb.new_state()
        await bb.forward(list(range(8)), st)
        for i in range(8):
            await bb.forward([100 + i], st)
        V = bb.model.n_vocab
        seen.update(graphs=0, in_compute=0.0)
        s0, c0, t0 = sleeps(), time.process_time(), time.perf_counter()
        for i in range(steps):
            await bb.forward([(7919 * i + 3) % V], st)
        wall = (time.perf_counter() - t0) / steps
        print(json.dumps({"cpu": (time.process_time() - c0) / steps, "wall": wall, "graphs": seen["graphs"] / steps,
                          "outside": wall - seen["in_compute"] / steps, "sleeps": (sleeps() - s0) / steps}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--trees", nargs=2, type=Path, required=True, metavar=("BEFORE", "AFTER"))
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        import trio

        trio.run(child, a.model, a.steps, a.threads)
        return
    got: dict[Path, list[dict]] = {t: [] for t in a.trees}
    for r in range(a.rounds):
        for tree in a.trees:
            env = dict(os.environ, PYTHONPATH=str(tree))
            p = subprocess.run([sys.executable, __file__, "--child", "--model", a.model, "--steps", str(a.steps),
                                "--threads", str(a.threads), "--trees", *map(str, a.trees)],
                               capture_output=True, text=True, env=env, timeout=900)
            if p.returncode != 0:
                sys.exit(f"error: {tree}: {(p.stderr.strip().splitlines() or ['?'])[-1]}")
            res = json.loads(p.stdout.strip().splitlines()[-1])
            got[tree].append(res)
            print(f"round {r + 1} {tree}: CPU {res['cpu']:.4f} s/token, wall {res['wall']:.4f} s/token, "
                  f"{res['graphs']:.1f} graphs a step, {1e3 * res['outside']:.2f} ms a step outside them, "
                  f"{res['sleeps']:.1f} sleeps a step", flush=True)
    for tree, rs in got.items():
        print(f"median {tree}: CPU {statistics.median(x['cpu'] for x in rs):.4f} s/token, "
              f"wall {statistics.median(x['wall'] for x in rs):.4f} s/token, "
              f"{statistics.median(x['graphs'] for x in rs):.1f} graphs a step, "
              f"{1e3 * statistics.median(x['outside'] for x in rs):.2f} ms a step outside them, "
              f"{statistics.median(x['sleeps'] for x in rs):.1f} sleeps a step")


if __name__ == "__main__":
    main()
