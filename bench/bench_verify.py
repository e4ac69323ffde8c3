"""What sampled verification costs a step: decode time at --verify-rate r vs off.

A backbone decodes a token sequence with two in-process workers (real ExpertWorker objects on real
shards) behind a simulated round trip (``--rtt-ms``: the request waits that long before the worker
computes), with the dispatcher's Verifier at each rate. The check of a sampled group runs in a
thread beside the request, so while the local recomputation is shorter than the round trip it
should cost (almost) nothing; at r = 1 every group is recomputed. Rates are measured alternately
(r0 r1 r2 ... r0 r1 r2 ...) and reported as the median decode time per token and its ratio to
verification off, measured in the same run.

    python bench/bench_verify.py [--rates 0,0.01,0.1,1] [--rtt-ms 0 --rtt-ms 5] [--tokens 48] [--rounds 3] [--write]
"""
from __future__ import annotations

import argparse
import statistics
import time

import trio
from common import header, publish, tiny_in_process_parts

from p2pswarm.backbone.dispatch.dispatcher import Dispatcher, InProcessOwner
from p2pswarm.backbone.serving.runner import Backbone
from p2pswarm.engine.kernels import make_bank
from p2pswarm.market.verify import Verifier
from p2pswarm.backbone.serving.generate import sequence_logits


class RemoteOwner(InProcessOwner):
    """A worker ``rtt_s`` away (the wait happens before it computes, as over a link)."""

    def __init__(self, worker, name, rtt_s):
        super().__init__(worker, name)
        self.rtt_s_sim = rtt_s

    async def compute(self, layer, cur, groups):
        if self.rtt_s_sim:
            await trio.sleep(self.rtt_s_sim)
        return await super().compute(layer, cur, groups)


async def main(args) -> None:
    layout, shards, workers, dense = tiny_in_process_parts("bench-verify-")
    tokens = [(i * 37 + 11) % 500 for i in range(args.tokens)]
    rates = [float(r) for r in args.rates.split(",")]
    rows = []
    await sequence_logits(Backbone(dense, Dispatcher(make_bank(layout, "numpy"), [RemoteOwner(w, f"w{i}", 0) for i, w in
                                                                                    enumerate(workers)])),
                          tokens[:8], decode=True)
    for rtt_ms in args.rtt_ms:
        times: dict[float, list[float]] = {r: [] for r in rates}
        checked: dict[float, int] = {}
        for _ in range(args.rounds):
            for r in rates:  # alternating: every rate sees the same machine state, in turn
                disp = Dispatcher(make_bank(layout, "numpy"),
                                  [RemoteOwner(w, f"w{i}", rtt_ms / 1000) for i, w in enumerate(workers)])
                if r > 0:
                    disp.verifier = Verifier(r, seed=0)
                bb = Backbone(dense, disp)
                t = time.perf_counter()
                await sequence_logits(bb, tokens, decode=True)
                times[r].append((time.perf_counter() - t) / len(tokens))
                checked[r] = disp.stats.verified_groups * 100 // max(1, disp.stats.remote_groups)
        base = statistics.median(times[rates[0]])
        for r in rates:
            m = statistics.median(times[r])
            rows.append(f"| {rtt_ms:g} | {r:g} | {checked[r]}% | {m * 1000:.2f} | {m / base:.2f}x |")
    text = header("Sampled verification: decode time per token vs verification off",
                  f"python bench/bench_verify.py --rates {args.rates} "
                  + " ".join(f"--rtt-ms {x:g}" for x in args.rtt_ms)
                  + f" --tokens {args.tokens} --rounds {args.rounds}")
    text += ("| simulated RTT ms | verify rate | groups checked | ms per token (median) | vs off |\n"
             "|---|---|---|---|---|\n" + "\n".join(rows) + "\n")
    publish(text, args.write)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rates", default="0,0.01,0.1,1")
    p.add_argument("--rtt-ms", type=float, action="append", default=None)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--write", action="store_true", help="append the results to docs/benchmarks.md")
    a = p.parse_args()
    a.rtt_ms = a.rtt_ms or [0.0, 5.0]
    trio.run(main, a)
