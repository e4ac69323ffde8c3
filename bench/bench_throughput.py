"""Aggregate tokens/s of the swarm's HTTP API as concurrency grows, under emulated WAN latency.

Per RTT: a bootstrap node, 4 worker processes each behind an emulated WAN link (``python -m
p2pswarm.net.wire.wanproxy``, one process for every link unless ``--proxies per-link``; the worker
``--announce`` s its link; at 0 ms no link unless ``--proxy-at-0``: loopback), and a backbone node
serving ``/v1/completions``. For N = 1, 4, 16,
64 concurrent greedy requests (short prompts, ``--tokens`` generated each) it measures

* aggregate generated tokens/s (all tokens / wall time from the first request to the last reply);
* the ratio to the bound min(compute bound(N), N / (L * RTT)) (the issue's yardstick) and to the
  no-overlap bound 1 / (1 / compute bound(N) + L * RTT / N): where the two terms are close, one
  cohort of sequences in one phase runs its dense work, round trips and remote work in series, and
  the min() cannot be reached without hiding one behind the other (docs/benchmarks.md,
  2026-12-03). The compute bound is the same N requests, from the same client, to the backbone
  node *alone* (no workers: its replica computes
  every expert, with all cores), measured in this run: like for like, the swarm's HTTP serving and
  the load generator's CPU are in both. The earlier bound, the same requests through an in-process
  scheduler (no HTTP, no client), is reported beside it;
* expert requests per generated token (from the backbone's /health counters), and the requests
  that fell back to the backbone's replica (0: the workers computed every group);
* CPU seconds per generated token of the backbone process, of one worker, of the WAN proxies, and
  of everything the run uses (all its processes and the load generator; from /proc).

``--hot-experts`` runs the backbone with the hot-expert path: an owner whose
measured round trip is longer than computing its groups on the backbone's replica gets no request,
so the N / (L * RTT) term no longer bounds anything; read its ratios against the compute bound (the
backbone alone), and the "local groups" column for how much the backbone computed itself.

Every node of the swarm runs one kernel thread (on 2 cores ten processes share them);
``--backbone-threads N`` gives the swarm's backbone N, for a strong backbone on a machine with
cores to spare. The backbone-alone bound always runs with the default (the CPUs, at most 8).

Rounds alternate the concurrencies (1 4 16 64 1 4 16 64 ...) and keep the best of ``--rounds``;
the ratios N=16 / N=1 and N=64 / N=1 at one RTT are the issue's goals (>= 12x and >= 40x at 50 ms).
This machine is shared (2 cores, other jobs): absolute numbers are noisy, the ratios less so.

The model is synthetic (random weights, Q8_0): ``--preset tiny`` (the default; 4 layers, 256 wide,
16 experts of 0.2 MB: an expert row costs ~15 us, so per-request overhead dominates at low RTT) or
``--preset geometry-122b`` (2 layers with Qwen3.5-122B-A10B's routed-expert geometry: 256
experts of 5.3 MB Q4_K, top-8, so its experts cost what the 122B's do; plain qwen3moe attention of
32 query / 2 KV heads of 128; ~7 ms a layer for one decoding sequence here; 2.8 GB written to a temporary folder, 2.7 GB more of worker slices per RTT,
all removed after).

    python bench/bench_throughput.py [--rtt 0 --rtt 25 --rtt 50 --rtt 100] [--tokens 8] [--rounds 2]
        [--direct] [--hot-experts] [--preset tiny|geometry-122b] [--out docs/benchmarks.md --plot docs/throughput.png]
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import resource
import shutil
import tempfile
import threading
import time
from pathlib import Path

import trio
from common import header
from wan_swarm import WanSwarm, cpu_seconds

from p2pswarm.model.synth import make_model
from p2pswarm.model.synth_qwen3moe import PRESETS

CONCURRENCY = (1, 4, 16, 64)


def worker_ranges(n_expert: int, workers: int = 4) -> list[tuple[int, int]]:
    """``workers`` contiguous, equal expert ranges covering ``n_expert``."""
    at = [n_expert * i // workers for i in range(workers + 1)]
    return list(zip(at[:-1], at[1:]))


RANGES = worker_ranges(PRESETS["tiny"].n_expert)  # the tiny preset's 16 experts over 4 workers


def prompts(n: int) -> list[str]:
    return [f"client {i} asks" for i in range(n)]


PROMPT_TOKENS: list[int] = []  # the prompt tokens of each request of the last post_all


def post_all(base_url: str, n: int, tokens: int) -> tuple[list[int], float]:
    """n concurrent greedy ``/v1/completions`` requests, one thread and connection each (the
    standard library's ``http.client``): completion tokens of each, and the wall time from the
    first request to the last reply. Why not httpx: on this 2-core machine the load generator's
    CPU is taken from the swarm it measures; httpx (one shared client, threads) costs 1.9-2.2 ms
    of CPU per request here, ``http.client`` 0.6 ms (``python bench/bench_load_client.py``,
    2026-12-02, docs/benchmarks.md)."""
    host = base_url.split("://", 1)[-1]
    bodies = [json.dumps({"prompt": p, "max_tokens": tokens, "temperature": 0}) for p in prompts(n)]
    done: list[int] = []
    errors: list[str] = []
    PROMPT_TOKENS.clear()

    def client(i: int) -> None:
        try:
            c = http.client.HTTPConnection(host, timeout=600)
            try:
                c.request("POST", "/v1/completions", bodies[i], {"Content-Type": "application/json"})
                r = c.getresponse()
                body = r.read()
                if r.status != 200:
                    raise RuntimeError(f"HTTP {r.status}: {body[:200]!r}")
                usage = json.loads(body)["usage"]
                done.append(usage["completion_tokens"])
                PROMPT_TOKENS.append(usage["prompt_tokens"])
            finally:
                c.close()
        except Exception as exc:  # reported
            errors.append(repr(exc))

    wall = run_threads(client, n)
    if errors:
        raise RuntimeError(f"{len(errors)} of {n} requests failed: {errors[0]}")
    return done, wall


def run_threads(client, n: int) -> float:
    """``client(i)`` for i in 0..n-1, each in its own thread, all at once: the wall time from the
    first start to the last join."""
    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def measure(sw: WanSwarm, n: int, tokens: int, layers: int = 4) -> dict:
    """n concurrent requests against the running swarm: tokens/s, requests/token, CPU/token, and
    how many expert groups the backbone computed itself (fallbacks, or all of them when alone)."""
    h0 = sw.get("/health")
    d0 = sw.swarm()["dispatch"]
    cpu0 = cpu_split(sw)
    done, wall = post_all(sw.base_url, n, tokens)
    h1 = sw.get("/health")
    d1 = sw.swarm()["dispatch"]
    cpu1 = cpu_split(sw)
    gen = sum(done)
    layer_steps = max(1, (h1["steps"] - h0["steps"]) * layers)
    return {"tps": gen / wall, "wall": wall, "tokens": gen,
            # the backbone's dense time per layer of a step (all micro-batches), and its dispatch
            # wait per layer of a step summed over micro-batches: what the micro-batch rule reads
            "dense_ms_layer": 1000 * (h1["dense_s"] - h0["dense_s"]) / layer_steps,
            "wait_ms_layer": 1000 * (h1["dispatch_wait_s"] - h0["dispatch_wait_s"]) / layer_steps,
            "req_per_tok": (h1["expert_requests"] - h0["expert_requests"]) / gen,
            # the backbone's expert-RPC bytes per generated token, both directions (/health "wire")
            "bytes_per_tok": wire_total(h1, h0) / gen,
            # per token through the model (prompt + generated): what the per-layer formula counts
            "bytes_per_fed": wire_total(h1, h0) / (gen + sum(PROMPT_TOKENS)),
            "sent_per_tok": wire_total(h1, h0, ("sent",)) / gen,
            "received_per_tok": wire_total(h1, h0, ("received",)) / gen,
            "busiest_worker_per_tok": busiest_upload(h1, h0) / gen,
            "fallbacks": d1["fallbacks"] - d0["fallbacks"],
            "local_groups": d1["local_groups"] - d0["local_groups"],
            "remote_groups": d1["remote_groups"] - d0["remote_groups"],
            "probes": d1.get("probes", 0) - d0.get("probes", 0),  # the hot-expert path's (--hot-experts)
            "steps": h1["steps"] - h0["steps"], "micro_batches": h1["micro_batches"],
            "cpu_backbone": (cpu1[0] - cpu0[0]) / gen, "cpu_worker": (cpu1[1] - cpu0[1]) / gen,
            "cpu_proxies": (cpu1[2] - cpu0[2]) / gen, "cpu_total": (cpu1[3] - cpu0[3]) / gen}


def wire_total(h1: dict, h0: dict, ways: tuple[str, ...] = ("sent", "received")) -> int:
    """Bytes the backbone sent to and/or received from its workers between two /health reads."""
    w1, w0 = h1.get("wire") or {}, h0.get("wire") or {}
    return sum(w1.get(k, 0) - w0.get(k, 0) for k in ways)


def busiest_upload(h1: dict, h0: dict) -> int:
    """The most bytes one worker sent the backbone between two /health reads."""
    o1, o0 = (h1.get("wire") or {}).get("owners", {}), (h0.get("wire") or {}).get("owners", {})
    return max((w["received"] - o0.get(name, {}).get("received", 0) for name, w in o1.items()), default=0)


def bandwidth_bound(r: dict, args) -> float:
    """Tokens/s the capped links allow at this run's measured bytes per token: the backbone's line
    (``--backbone-mbps``, each direction) and the busiest worker's upload (``--worker-up-mbps``:
    routing is not uniform, so one worker sends more than its share); inf without caps."""
    bounds = [float("inf")]
    if args.backbone_mbps:
        line = args.backbone_mbps * 1e6 / 8
        bounds += [line / r[k] for k in ("sent_per_tok", "received_per_tok") if r[k]]
    if args.worker_up_mbps and r["busiest_worker_per_tok"]:
        bounds.append(args.worker_up_mbps * 1e6 / 8 / r["busiest_worker_per_tok"])
    return min(bounds)


def local_share(r: dict) -> str:
    """The share of the expert groups the backbone computed itself (its replica: the hot-expert
    path's choices and any fallbacks), as a percentage."""
    total = r["local_groups"] + r["remote_groups"]
    return f"{100 * r['local_groups'] / total:.0f}%" if total else "-"


def cpu_split(sw: WanSwarm) -> tuple[float, float, float, float]:
    """CPU seconds so far of the backbone, of one worker, of all WAN proxies, and of everything the
    run uses (every process of the swarm plus this load generator): on 2 shared cores the total
    per token is what caps the swarm's tokens/s, whichever process spends it."""
    backbone = cpu_seconds(sw.backbone.pid)
    worker = cpu_seconds(sw.workers[0].pid) if sw.workers else 0.0
    proxies = sum(cpu_seconds(p.pid) for p in sw.proxies)
    ru = resource.getrusage(resource.RUSAGE_SELF)
    total = sum(cpu_seconds(p.pid) for p in sw.procs) + ru.ru_utime + ru.ru_stime
    return backbone, worker, proxies, total


async def compute_bound(model: Path, kernel: str, n: int, tokens: int) -> float:
    """Tokens/s of n concurrent requests through a monolithic backbone's scheduler (no network)."""
    from p2pswarm.backbone.serving.scheduler import Params, Scheduler
    from p2pswarm.backbone.sessions.local import open_backbone
    from p2pswarm.engine.text.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(model)
    async with open_backbone(model, workers=0, kernel=kernel) as mono:
        sched = Scheduler(mono.backbone, tok)
        async with trio.open_nursery() as nursery:
            await nursery.start(sched.run)

            async def one(p):
                async with sched.submit(tok.encode(p), Params(max_tokens=tokens, stop_at_eos=False)) as req:
                    async for _ in req:
                        pass

            t0 = time.perf_counter()
            async with trio.open_nursery() as clients:
                for p in prompts(n):
                    clients.start_soon(one, p)
            dt = time.perf_counter() - t0
            nursery.cancel_scope.cancel()
    return n * tokens / dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rtt", type=float, action="append", default=None, help="ms (repeatable)")
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--kernel", default="ggml")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny",
                    help="the synthetic model's shape: tiny (the default: 256 wide, 16 experts of 0.2 MB) or "
                         "geometry-122b (Qwen3.5-122B-A10B's routed-expert geometry, 2 layers, 2.8 GB)")
    ap.add_argument("--layers", type=int, default=None, help="layers of the model (default: the preset's)")
    ap.add_argument("--micro-batches", default="auto", help="the backbone's --micro-batches")
    ap.add_argument("--token-budget", default="auto", help="the backbone's --token-budget")
    ap.add_argument("--concurrency", type=int, action="append", default=None)
    ap.add_argument("--out")
    ap.add_argument("--plot")
    ap.add_argument("--json")
    ap.add_argument("--no-bound", action="store_true", help="skip the compute-bound measurement (quick runs)")
    ap.add_argument("--direct", action="store_true",
                    help="workers offer direct lanes (--direct, each behind its own proxy of the same RTT): "
                         "expert requests skip py-libp2p")
    ap.add_argument("--proxies", choices=["shared", "per-link"], default="shared",
                    help="the WAN links in one proxy process (default) or one process per link")
    ap.add_argument("--hot-experts", action="store_true",
                    help="the backbone's --hot-experts (issue 11 item 3): an owner whose measured round trip is "
                         "longer than computing its groups on the backbone's replica gets no request; the "
                         "table's 'local groups' column says how much the backbone then computed itself")
    ap.add_argument("--backbone-threads", type=int, default=1,
                    help="kernel threads of the swarm's backbone (default 1, as every node of the swarm: on "
                         "2 cores ten processes share them); more for a strong backbone on a machine with "
                         "cores to spare (the backbone-alone bound always uses the default: the CPUs, at most 8)")
    ap.add_argument("--backbone-mbps", type=float, default=0.0,
                    help="cap the backbone's own line at this many Mbit/s each way: every worker's links "
                         "(libp2p and direct) through one limit (wanproxy --shared-up/down-mbps); 0: none")
    ap.add_argument("--worker-up-mbps", type=float, default=0.0,
                    help="cap each worker's upload (its link's worker -> backbone direction) in Mbit/s; 0: none")
    ap.add_argument("--wire-precision", choices=("f32", "f16", "bf16"), default="f32",
                    help="the backbone's --wire-precision (expert outputs in 16 bits; default f32)")
    ap.add_argument("--wire-inputs", choices=("on", "off"), default="on",
                    help="P2PSWARM_WIRE_INPUTS: expert inputs in the workers' own quantised form (on, the "
                         "default) or float32 (off: the wire before issue 32)")
    ap.add_argument("--wire-codec", choices=("on", "off"), default="on",
                    help="P2PSWARM_WIRE_CODEC: lossless coding of float32 outputs and Q8_K inputs (on, the "
                         "default, where both ends can) or none (off)")
    ap.add_argument("--proxy-at-0", action="store_true",
                    help="a WAN proxy in front of each worker at 0 ms RTT too (by default a 0 ms link is "
                         "loopback, no proxy: bench/wan_swarm.py)")
    args = ap.parse_args()
    if args.backbone_threads < 1:
        ap.error("--backbone-threads must be >= 1")
    if args.layers is not None and args.layers < 1:
        ap.error("--layers must be >= 1")
    if args.plot:
        try:  # checked before the runs: finding out after twenty minutes of measuring loses them
            import matplotlib  # noqa: F401
        except ImportError:
            ap.error("--plot needs matplotlib (pip install matplotlib)")
    if args.backbone_mbps and args.proxies != "shared":
        ap.error("--backbone-mbps needs --proxies shared (one proxy process: one shared cap)")
    os.environ["P2PSWARM_WIRE_INPUTS"] = args.wire_inputs  # the nodes inherit them
    os.environ["P2PSWARM_WIRE_CODEC"] = args.wire_codec
    rtts = args.rtt or [0.0, 25.0, 50.0, 100.0]
    conc = args.concurrency or list(CONCURRENCY)
    work = Path(tempfile.mkdtemp(prefix="bench-throughput-"))
    try:
        run(args, work, rtts, conc)
    finally:  # the model and the workers' slices: 5.5 GB at geometry-122b
        shutil.rmtree(work, ignore_errors=True)


def run(args, work: Path, rtts: list[float], conc: list[int]) -> None:
    shape = PRESETS[args.preset]
    L = args.layers or shape.n_layer
    ranges = worker_ranges(shape.n_expert)
    model = work / f"{args.preset}-q8.gguf"
    make_model(model, preset=args.preset, qtype="q8_0", seed=2, layers=L)
    bound: dict[int, float] = {}  # the backbone alone through its HTTP API: the ratios' bound
    inproc: dict[int, float] = {}  # the same N requests through an in-process scheduler (no HTTP)
    if not args.no_bound:
        with WanSwarm(model, ranges=[], rtt_ms=0, workdir=work / "alone", kernel=args.kernel, timeout_s=30,
                      threads=None, backbone_args=["--token-budget", args.token_budget]) as alone:
            measure(alone, 2, 2)  # warm-up
            for _ in range(args.rounds):
                for n in conc:
                    r = measure(alone, n, args.tokens, L)
                    if r["remote_groups"]:
                        raise RuntimeError("the backbone-alone baseline sent expert work to a worker")
                    bound[n] = max(bound.get(n, 0.0), r["tps"])
                    inproc[n] = max(inproc.get(n, 0.0), trio.run(compute_bound, model, args.kernel, n, args.tokens))
    else:
        bound = inproc = {n: float("inf") for n in conc}
    print("backbone alone (HTTP)", {n: round(v, 1) for n, v in bound.items()},
          "in-process", {n: round(v, 1) for n, v in inproc.items()}, flush=True)
    results: dict[float, dict[int, dict]] = {}
    for rtt in rtts:
        with WanSwarm(model, ranges=ranges, rtt_ms=rtt, workdir=work / f"rtt{rtt:g}", kernel=args.kernel,
                      timeout_s=30, direct=args.direct, proxy_at_zero=args.proxy_at_0, proxies=args.proxies,
                      proxy_args=[*(["--shared-up-mbps", str(args.backbone_mbps), "--shared-down-mbps",
                                     str(args.backbone_mbps)] if args.backbone_mbps else []),
                                  *(["--down-mbps", str(args.worker_up_mbps)] if args.worker_up_mbps else [])],
                      backbone_args=["--micro-batches", args.micro_batches, "--token-budget", args.token_budget,
                                    "--threads", str(args.backbone_threads), "--wire-precision", args.wire_precision,
                                    *(["--hot-experts"] if args.hot_experts else [])]) as sw:
            sw.wait_covered()
            measure(sw, 2, 2)  # warm-up: connections, caches
            lanes = sw.backbone.log.read_text().count("direct lane to worker")
            if args.direct and lanes < len(ranges):
                raise RuntimeError(f"only {lanes} of {len(ranges)} workers' direct lanes were taken")
            best: dict[int, dict] = {}
            for _ in range(args.rounds):
                for n in conc:
                    r = measure(sw, n, args.tokens, L)
                    if n not in best or r["tps"] > best[n]["tps"]:
                        best[n] = r
            results[rtt] = best
            print(rtt, {n: (round(r["tps"], 1), r["micro_batches"], f'dense {r["dense_ms_layer"]:.2f} ms',
                            f'wait {r["wait_ms_layer"]:.2f} ms', f'fallbacks {r["fallbacks"]}', f'local {local_share(r)}', f'probes {r["probes"]}')
                        for n, r in best.items()}, flush=True)
        shutil.rmtree(work / f"rtt{rtt:g}", ignore_errors=True)  # its workers' slices (2.7 GB at geometry-122b)
    if args.json:
        Path(args.json).write_text(json.dumps({"bound": bound, "inproc": inproc,
                                               "results": {str(k): v for k, v in results.items()}}))
    lines = ["| RTT | N | tokens/s | vs N=1 | bound | ratio to bound | ratio, in-process bound | "
             "ratio, no-overlap bound | expert requests / token | wire kB / token | wire kB / token fed | bandwidth bound | ratio to min(latency, bandwidth) | fallback requests | local groups | steps / micro-batches | "
             "backbone CPU ms / token | worker CPU ms / token | proxies CPU ms / token | all CPU ms / token |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for rtt, best in results.items():
        for n, r in best.items():
            net = n / (L * rtt / 1000) if rtt > 0 else float("inf")
            bw = bandwidth_bound(r, args)
            b, bi = min(bound[n], net, bw), min(inproc[n], net, bw)
            inv = 1 / bound[n] + 1 / net  # compute, then the round trips, never overlapped
            serial = 1 / inv if inv else float("inf")  # (--no-bound at 0 ms: no bound at all)
            lines.append(f"| {rtt:g} ms | {n} | {r['tps']:.1f} | {r['tps'] / best[min(best)]['tps']:.1f}x | {b:.1f} | "
                         f"{r['tps'] / b:.2f} | {r['tps'] / bi:.2f} | {r['tps'] / serial:.2f} | "
                         f"{r['req_per_tok']:.2f} | {r['bytes_per_tok'] / 1000:.1f} | {r['bytes_per_fed'] / 1000:.1f} | {bw:.1f} | "
                         f"{r['tps'] / min(net, bw):.2f} | {r['fallbacks']} | {local_share(r)} | "
                         f"{r['steps']} / {r['micro_batches']} | "
                         f"{r['cpu_backbone'] * 1000:.1f} | {r['cpu_worker'] * 1000:.1f} | "
                         f"{r['cpu_proxies'] * 1000:.1f} | {r['cpu_total'] * 1000:.1f} |")
    text = header("Throughput: continuous batching under WAN latency",
                  f"python bench/bench_throughput.py --tokens {args.tokens} --rounds {args.rounds} "
                  + " ".join(f"--rtt {r:g}" for r in rtts) + (" --direct" if args.direct else "")
                  + (f" --preset {args.preset}" if args.preset != "tiny" else "")
                  + (f" --layers {args.layers}" if args.layers else "")
                  + (" --proxy-at-0" if args.proxy_at_0 else "")
                  + (" --hot-experts" if args.hot_experts else "")
                  + (" --proxies per-link" if args.proxies == "per-link" else "")
                  + (f" --backbone-threads {args.backbone_threads}" if args.backbone_threads != 1 else "")
                  + (f" --backbone-mbps {args.backbone_mbps:g}" if args.backbone_mbps else "")
                  + (f" --worker-up-mbps {args.worker_up_mbps:g}" if args.worker_up_mbps else "")
                  + (f" --wire-precision {args.wire_precision}" if args.wire_precision != "f32" else "")
                  + (" --wire-inputs off" if args.wire_inputs == "off" else "")
                  + "".join(f" --concurrency {n}" for n in conc if args.concurrency)
                  + (" --no-bound" if args.no_bound else "")) + (
        f"Synthetic {args.preset} q8_0 model ({L} layers, {shape.n_embd} wide, {shape.n_expert} experts of "
        f"{shape.n_ff_exp} ({shape.expert_qtype or 'q8_0'}), top-{shape.n_expert_used}), kernel {args.kernel}, "
        f"bootstrap + {len(ranges)} worker processes ({shape.n_expert // len(ranges)} experts each) behind emulated WAN links ({'one proxy process for all' if args.proxies == 'shared' else 'a proxy process each'}"
        f"{'; at 0 ms too' if args.proxy_at_0 else '; none at 0 ms: loopback'}) + backbone HTTP API, all on this "
        f"{len(os.sched_getaffinity(0))}-core machine (every node one kernel thread"
        f"{f', the backbone {args.backbone_threads}' if args.backbone_threads != 1 else ''})"
        f"{'; expert requests on the workers direct lanes (each behind a link of the same RTT)' if args.direct else ''}. "
        f"N concurrent greedy requests, {args.tokens} tokens each; best of {args.rounds} alternating rounds. "
        f"Bandwidth bound = the tokens/s the capped links carry at the row's measured bytes per token "
        f"(the backbone's line each way, and the upload of the worker that sent the most; "
        f"inf uncapped); wire kB / token: the backbone's expert-RPC bytes both ways per generated token "
        f"(/health's wire counters), and per token fed (prompt + generated: what the per-layer formula counts). "
        f"Bound = min(compute bound, N/(L*RTT), bandwidth bound) (the issue's; the no-overlap bound 1 / (1/compute + "
        f"L*RTT/N) is what a step of dense work, round trips and remote work in series allows: above 1, "
        f"some of them overlapped); compute bound = the same N requests, same client, to the "
        f"backbone node alone (no workers: it computes every expert; all cores): "
        f"{', '.join(f'N={n}: {v:.1f}' for n, v in bound.items())} tokens/s; through an in-process scheduler "
        f"(no HTTP, the bound of earlier runs): {', '.join(f'N={n}: {v:.1f}' for n, v in inproc.items())} tokens/s.\n\n"
    ) + "\n".join(lines) + "\n"
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for rtt, best in results.items():
            ax.plot(list(best), [r["tps"] for r in best.values()], marker="o", label=f"{rtt:g} ms RTT")
        ax.plot(list(bound), list(bound.values()), "k--", label="compute bound (backbone alone)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel("aggregate generated tokens/s")
        ax.legend()
        ax.grid(True, which="both", alpha=0.3)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=100)
        text += f"\n![throughput]({Path(args.plot).name})\n"
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text)


if __name__ == "__main__":
    main()
