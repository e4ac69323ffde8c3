"""CPU per request of the HTTP load generator: httpx (threads, one shared client) vs the standard
library's ``http.client`` (a thread and a connection per request), against one backbone node.

Why: bench/bench_throughput.py runs its load generator on the same 2 cores as the swarm it
measures, so every ms of client CPU per request is taken from the swarm. This measures what each
client costs per request, alternating the two (A B A B), with the backbone alone (no workers) on
the tiny model, N concurrent 8-token greedy requests:

    python bench/bench_load_client.py [--rounds 2] [--concurrency 1 --concurrency 16 --concurrency 64]
"""
from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import httpx
from bench_throughput import post_all, prompts, run_threads
from common import header
from wan_swarm import WanSwarm

from p2pswarm.model.synth import make_model


def post_all_httpx(http: httpx.Client, n: int, tokens: int) -> tuple[list[int], float]:
    """What bench_throughput did before 2026-12-02: one httpx.Client (a pool of n, made before the
    clock, as it was) shared by n threads."""
    done: list[int] = []

    def client(i: int) -> None:
        r = http.post("/v1/completions", json={"prompt": prompts(n)[i], "max_tokens": tokens, "temperature": 0})
        r.raise_for_status()
        done.append(r.json()["usage"]["completion_tokens"])

    wall = run_threads(client, n)
    if len(done) != n:
        raise RuntimeError(f"{n - len(done)} of {n} requests failed")
    return done, wall


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrency", type=int, action="append", default=None)
    ap.add_argument("--tokens", type=int, default=8)
    args = ap.parse_args()
    conc = args.concurrency or [1, 16, 64]
    work = Path(tempfile.mkdtemp(prefix="bench-client-"))
    model = work / "tiny-q8.gguf"
    make_model(model, preset="tiny", qtype="q8_0", seed=2, layers=4)
    rows = []
    with WanSwarm(model, ranges=[], rtt_ms=0, workdir=work / "alone", kernel="ggml", threads=None) as sw:
        post_all(sw.base_url, 2, 2)  # warm-up
        for rnd in range(args.rounds):
            for n in conc:
                for name in ("httpx (threads, shared client)", "http.client (thread + connection each)"):
                    if name.startswith("httpx"):
                        http = httpx.Client(base_url=sw.base_url, timeout=600,
                                            limits=httpx.Limits(max_connections=n, max_keepalive_connections=n))
                        c0 = os.times()
                        done, wall = post_all_httpx(http, n, args.tokens)
                        c1 = os.times()
                        http.close()
                    else:
                        c0 = os.times()
                        done, wall = post_all(sw.base_url, n, args.tokens)
                        c1 = os.times()
                    cpu = (c1.user - c0.user) + (c1.system - c0.system)
                    rows.append(f"| {rnd + 1} | {n} | {name} | {1000 * cpu / n:.2f} | {sum(done) / wall:.1f} |")
    text = header("Load generator CPU per request: httpx vs http.client",
                  "python bench/bench_load_client.py --rounds " + str(args.rounds)
                  + "".join(f" --concurrency {n}" for n in conc)) + (
        "The backbone node alone (tiny q8_0 model, ggml), N concurrent greedy 8-token requests; client CPU "
        "from os.times() of this process (10 ms ticks: a lone request's figure is coarse).\n\n"
        "| round | N | client | client CPU ms / request | tokens/s |\n|---|---|---|---|---|\n") + "\n".join(rows) + "\n"
    print(text)


if __name__ == "__main__":
    main()
