"""What a thread hop costs, and a backbone decode step's CPU with small compute inline or in threads.

    python bench/bench_inline.py [--steps 20] [--concurrency 1 --concurrency 64]

1. ``trio.to_thread.run_sync`` of a no-op, against ``trio.lowlevel.checkpoint``: wall and CPU per
   call (the price p2pswarm.offload avoids for short compute).
2. The bench_throughput model (synthetic tiny q8_0, 4 layers, ggml kernel) behind a backbone with
   two in-process workers (``InProcessOwner``: the worker's own ``compute_async``, no network), N
   sequences: wall and process CPU per decode step, and the median time of the dense pieces.
   PYTHONPATH picks the code under test; a tree without p2pswarm.offload is measured too (main
   before the change), and ``P2PSWARM_INLINE_MS=0`` turns inlining off in a tree that has it.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import trio

from p2pswarm.backbone.serving import runner
from p2pswarm.backbone.sessions.local import open_backbone
from p2pswarm.model.synth import make_model


async def hop_cost(n: int = 3000) -> None:
    for label, fn in (("to_thread.run_sync(no-op)", lambda: trio.to_thread.run_sync(lambda: None)),
                      ("lowlevel.checkpoint()", trio.lowlevel.checkpoint)):
        t, c = time.perf_counter(), time.process_time()
        for _ in range(n):
            await fn()
        print(f"{label}: wall {1e6 * (time.perf_counter() - t) / n:.1f} us, CPU {1e6 * (time.process_time() - c) / n:.1f} us"
              " per call", flush=True)


async def steps(model: Path, concurrency: list[int], n_steps: int) -> None:
    times: dict[str, list[float]] = {}
    orig = {n: getattr(runner.Backbone, n) for n in ("_pre_batch", "_post_batch", "_output_batch")}

    def timed(name):
        def f(self, *a, **k):
            t = time.perf_counter()
            try:
                return orig[name](self, *a, **k)
            finally:
                times.setdefault(name, []).append(time.perf_counter() - t)
        return f

    for name in orig:
        setattr(runner.Backbone, name, timed(name))
    async with open_backbone(model, workers=2, transport="inproc", kernel="ggml") as sw:
        bb = sw.backbone
        for n in concurrency:
            states = [bb.new_state() for _ in range(n)]
            await bb.forward_batch([([3, 4, 5, 6], st) for st in states], last_only=True)  # the prompts
            await bb.forward_batch([([7], st) for st in states], last_only=True)  # measured once, in threads
            times.clear()
            off = getattr(bb, "offload", None)
            before = (off.inline_calls, off.thread_calls) if off else None
            t, c = time.perf_counter(), time.process_time()
            for i in range(n_steps):
                await bb.forward_batch([([8 + i], st) for st in states], last_only=True)
            wall, cpu = (time.perf_counter() - t) / n_steps, (time.process_time() - c) / n_steps
            pieces = ", ".join(f"{k.strip('_')} {1000 * statistics.median(v):.3f} ms" for k, v in times.items())
            where = (f"; backbone pieces inline {off.inline_calls - before[0]}, in a thread {off.thread_calls - before[1]}"
                     if off else "; (no p2pswarm.offload in this tree: every piece in a thread)")
            print(f"N={n}: decode step {1000 * wall:.2f} ms wall, {1000 * cpu:.2f} ms CPU; {pieces}{where}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--concurrency", type=int, action="append", default=None)
    args = ap.parse_args()
    trio.run(hop_cost)
    model = Path(tempfile.mkdtemp(prefix="bench-inline-")) / "tiny-q8.gguf"
    make_model(model, preset="tiny", qtype="q8_0", seed=2, layers=4)
    trio.run(steps, model, args.concurrency or [1, 64], args.steps)


if __name__ == "__main__":
    main()
