"""What replay on ban costs the hot path: batched decode with taint tracking on vs off.

Every step of a backbone with remote workers records, per worker, which rows it computed from
outputs nobody checked (``Dispatcher.run_groups(..., taint)`` row masks, folded into each sequence's
state once per step), so that a later ban can rewind exactly the sequences that used them. This
measures what that bookkeeping costs while no one is banned: S concurrent requests through the
scheduler, two in-process workers (real ExpertWorker objects on real shards, no round trip: the
bookkeeping is then the largest share of a step it can be), verification at ``--verify-rate``.
``Backbone.replay_on_ban`` on (A) and off (B), alternating A B A B, median seconds per step; and,
precisely, the seconds spent inside the bookkeeping itself (timed around ``mark_unverified`` and
the per-step fold) as a share of the steps' time. Then one run with a liar banned mid-run: how
long the replay took the requests.

    python bench/bench_replay.py [--seqs 32] [--tokens 16] [--rounds 4] [--verify-rate 0.01] [--write]
"""
from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path

import trio
from common import header, publish, tiny_in_process_parts

import p2pswarm.backbone.dispatch.verify as dispatch_verify
import p2pswarm.backbone.serving.runner as runner
from p2pswarm.backbone.dispatch.dispatcher import Dispatcher, InProcessOwner
from p2pswarm.backbone.serving.runner import Backbone
from p2pswarm.backbone.serving.scheduler import Params, Scheduler
from p2pswarm.engine.kernels import make_bank
from p2pswarm.market.verify import Verifier

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from helpers.dishonest_worker import DishonestWorker

BOOKKEEPING = [0.0]


def _timed(fn):
    def wrapped(*a, **kw):
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            BOOKKEEPING[0] += time.perf_counter() - t
    return wrapped


# the per-owner row marking (p2pswarm.market.verify.mark_unverified, as the dispatcher's verify concern calls it)
dispatch_verify.mark_unverified = _timed(dispatch_verify.mark_unverified)
runner._fold_taint = _timed(runner._fold_taint)


async def _serve(bb: Backbone, prompts, tokens: int) -> tuple[float, int]:
    """Wall seconds of all requests served at once, and the scheduler's steps."""
    sched = Scheduler(bb, token_budget=256, prefill_chunk=32, micro_batches=1)
    reqs = [sched.submit(p, Params(max_tokens=tokens, stop_at_eos=False), rewinds=True) for p in prompts]

    async def drain(req):
        async with req:
            async for _ in req:
                pass

    t = time.perf_counter()
    async with trio.open_nursery() as nursery:
        async with trio.open_nursery() as clients:
            for r in reqs:
                clients.start_soon(drain, r)
            await nursery.start(sched.run)
        nursery.cancel_scope.cancel()
    return time.perf_counter() - t, sched.stats.steps


async def main(args) -> None:
    layout, shards, workers, dense = tiny_in_process_parts("bench-replay-")
    prompts = [[(7 * i + 3 * j) % 500 + 1 for j in range(4 + i % 5)] for i in range(args.seqs)]

    def backbone(on: bool, owners=None) -> Backbone:
        disp = Dispatcher(make_bank(layout, "numpy"), owners or [InProcessOwner(w, f"w{i}") for i, w in
                                                                 enumerate(workers)])
        if args.verify_rate > 0:
            disp.verifier = Verifier(args.verify_rate, seed=0)
        bb = Backbone(dense, disp)
        bb.replay_on_ban = on
        return bb

    await _serve(backbone(True), prompts[:4], 2)  # warm-up (probes, caches)
    per_step: dict[bool, list[float]] = {True: [], False: []}
    share = []
    for _ in range(args.rounds):
        for on in (True, False):  # A B A B: both see the same machine state, in turn
            BOOKKEEPING[0] = 0.0
            secs, steps = await _serve(backbone(on), prompts, args.tokens)
            per_step[on].append(secs / steps)
            if on:
                share.append(BOOKKEEPING[0] / secs)
    a, b = statistics.median(per_step[True]), statistics.median(per_step[False])
    # one run with a liar banned mid-run (no verification: an honoured ban record after half the tokens)
    liar = DishonestWorker(shards[1], kernel="numpy", fraction=0.01, delta=1.0, seed=2)
    bb = backbone(True, [InProcessOwner(workers[0], "w0"), InProcessOwner(liar, "liar")])
    bb.dispatcher.verifier = None
    clean_secs, _ = await _serve(backbone(True), prompts, args.tokens)

    async def ban_later():
        while bb.dispatcher.stats.layers < args.tokens // 2 * dense.n_layer:
            await trio.sleep(0.005)
        bb.dispatcher.bans.ban("liar", "bench")

    async with trio.open_nursery() as n:
        n.start_soon(ban_later)
        ban_secs, _ = await _serve(bb, prompts, args.tokens)
    r = bb.replays
    text = header("Replay on ban: the hot-path cost of taint tracking, and one replay",
                  f"python bench/bench_replay.py --seqs {args.seqs} --tokens {args.tokens} --rounds {args.rounds} "
                  f"--verify-rate {args.verify_rate:g}")
    text += ("| taint tracking | ms per step (median) | vs off | bookkeeping share of the steps' time |\n"
             "|---|---|---|---|\n"
             f"| on | {a * 1000:.2f} | {a / b:.3f}x | {statistics.median(share) * 100:.2f}% "
             f"(min {min(share) * 100:.2f}%, max {max(share) * 100:.2f}%) |\n"
             f"| off | {b * 1000:.2f} | 1.000x | - |\n\n"
             f"{args.seqs} requests x {args.tokens} tokens, a ban after half of them: {ban_secs:.2f} s vs "
             f"{clean_secs:.2f} s without ({ban_secs / clean_secs:.2f}x); {r.sequences} sequences rewound, "
             f"{r.rows} rows fed again, {r.tokens_withdrawn} tokens withdrawn, {r.finished_unfixable} unfixable.\n")
    publish(text, args.write)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", type=int, default=32)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--verify-rate", type=float, default=0.01)
    p.add_argument("--write", action="store_true", help="append the results to docs/benchmarks.md")
    logging.getLogger("p2pswarm").setLevel(logging.ERROR)  # one warning per replayed request otherwise
    trio.run(main, p.parse_args())
