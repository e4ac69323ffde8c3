"""Does adding a worker add tokens/s? Each node in its own CPU cgroup, as separate weak devices.

On one machine every process shares the same cores, so a worker's compute is taken from the
backbone's: adding workers cannot show the design's M4 line (tokens/s that grow with the number of
workers). Here the backbone and every worker run in a CPU cgroup of their own with a quota
(bench/cpu_groups.py: cgroup v1 ``cpu.cfs_quota_us`` or v2 ``cpu.max``; needs root), so each gets
at most its fraction of a core whatever the others do: ``--backbone-cpu 0.3 --worker-cpu 0.12``
emulates a backbone of 0.3 of a core and workers of 0.12 each. The bootstrap, the WAN proxies
(``--rtt``, or ``--worker-rtt-ms`` one RTT per worker; ``--worker-up-mbps``: a cap on each
worker's upload, one value for all or one per worker, cycled, a capped link gets a proxy even at
0 ms; bench/wan_swarm.py) and this
load generator stay outside the groups: they stand for the network and the clients.

Per configuration (the backbone alone: every expert local; then 1, 2, 4, 8 workers each holding an
equal share of the experts; ``--replicas 2``: each share held by two of them) it runs N = 16 and
64 concurrent greedy ``/v1/completions`` (alternating, best of ``--rounds``, after ``--warm`` untimed
rounds at each N: the swarm's cold start is not measured) and reports aggregate
generated tokens/s, the ratio to the backbone alone, and the bounds:

* Amdahl: the share f of the backbone-alone step spent on routed experts (``/v1/swarm``
  ``dispatch.seconds`` over ``/health`` ``dense_busy_s``, summed over every timed round of both
  backbone-alone runs, first and last): offloading every expert for free gives
  at most alone / (1 - f);
* the workers' compute: W workers of q cores do the alone run's expert work (its expert
  seconds per token at the backbone's quota b) at most W q / b times as fast: W q / (b * expert
  seconds per token) tokens/s;
* the link: N / (L * RTT) at an RTT, and the busiest worker's upload cap at its measured bytes.

``--unequal 0.1,0.2,0.4`` adds the issue's unequal-devices run: one worker per quota, each holding
every expert (replicas of the same units), against the same total CPU split evenly over as many
workers: tokens/s and the (expert, row) pairs each worker got (``dispatch.owner_rows``: requests
follow measured speed, docs/architecture.md).

Every configuration's texts are compared with the backbone-alone run's (same prompts, greedy).
Cgroups are removed on exit (errors and Ctrl-C too); where they cannot be made (not root, no cpu
controller) the script says so in one line and exits 2.

    python bench/device_swarm.py [--preset geometry-122b --layers 2] [--backbone-cpu 0.3]
        [--worker-cpu 0.12] [--workers 1 --workers 2 ...] [--replicas 1 --replicas 2]
        [--concurrency 16 --concurrency 64] [--tokens 4] [--rounds 1] [--warm 1] [--rtt 0 | --worker-rtt-ms 0,25,50]
        [--worker-up-mbps 0 | --worker-up-mbps 20,0,100] [--unequal 0.1,0.2,0.4] [--plot docs/device_scaling.png] [--out docs/benchmarks.md]
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import header
from cpu_groups import CgroupError, CpuGroups
from wan_swarm import WanSwarm, cpu_seconds

from p2pswarm.model.synth import make_model
from p2pswarm.model.synth_qwen3moe import PRESETS
from p2pswarm.net.signed.identity import load_or_create_identity


def worker_ranges(n_expert: int, shares: int) -> list[tuple[int, int]]:
    at = [n_expert * i // shares for i in range(shares + 1)]
    return list(zip(at[:-1], at[1:]))


def post(base_url: str, n: int, tokens: int) -> tuple[list[str], int, float]:
    """n concurrent greedy completions (one thread and connection each): their texts in prompt
    order, the generated tokens, and the wall time from the first request to the last reply."""
    host = base_url.split("://", 1)[-1]
    texts: list[str | None] = [None] * n
    used = [0] * n
    errors: list[str] = []

    def client(i: int) -> None:
        try:
            c = http.client.HTTPConnection(host, timeout=900)
            try:
                c.request("POST", "/v1/completions", json.dumps({"prompt": f"client {i} asks", "max_tokens": tokens,
                                                                 "temperature": 0}),
                          {"Content-Type": "application/json"})
                r = c.getresponse()
                body = r.read()
                if r.status != 200:
                    raise RuntimeError(f"HTTP {r.status}: {body[:200]!r}")
                msg = json.loads(body)
                texts[i] = msg["choices"][0]["text"]
                used[i] = msg["usage"]["completion_tokens"]
            finally:
                c.close()
        except Exception as exc:  # reported
            errors.append(repr(exc))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{len(errors)} of {n} requests failed: {errors[0]}")
    return [t or "" for t in texts], sum(used), wall


def measure(sw: WanSwarm, n: int, tokens: int) -> dict:
    s0 = sw.swarm()
    h0, d0 = sw.get("/health"), s0["dispatch"]
    cpu0 = {name: cpu_seconds(p.pid) for name, p in sw.named.items()}
    texts, gen, wall = post(sw.base_url, n, tokens)
    s1 = sw.swarm()
    h1, d1 = sw.get("/health"), s1["dispatch"]
    cpu1 = {name: cpu_seconds(p.pid) for name, p in sw.named.items()}
    at = getattr(sw, "owner_index", {})
    rows = {at.get(k, k): v - d0.get("owner_rows", {}).get(k, 0) for k, v in d1.get("owner_rows", {}).items()}
    got0 = {w["name"]: (w.get("wire") or {}).get("received", 0) for w in s0["workers"]}
    received = {at.get(w["name"], w["name"]): (w.get("wire") or {}).get("received", 0) - got0.get(w["name"], 0)
                for w in s1["workers"]}  # worker index -> bytes it sent the backbone (its upload)
    return {"tps": gen / wall, "tokens": gen, "wall": wall, "texts": texts,
            "expert_s": d1["seconds"] - d0["seconds"], "busy_s": h1["dense_busy_s"] - h0["dense_busy_s"],
            "fallbacks": d1["fallbacks"] - d0["fallbacks"], "local_groups": d1["local_groups"] - d0["local_groups"],
            "remote_groups": d1["remote_groups"] - d0["remote_groups"], "owner_rows": rows,
            "cpu": {k: (cpu1[k] - cpu0[k]) for k in cpu1},
            "steps": h1["steps"] - h0["steps"], "requests": h1["expert_requests"] - h0["expert_requests"],
            "micro_batches": h1["micro_batches"], "coded_replies": coded(s1) - coded(s0), "received": received,
            "refreshes": refreshes(s1) - refreshes(s0)}


def refreshes(swarm: dict) -> int:
    """The backbone's coverage-map refreshes so far (``/v1/swarm`` ``resolver``; 0 without one).
    Why count them in a measurement: a refresh's DHT look-ups are ~0.2 s of a 0.3-core backbone's
    CPU every ``--refresh`` (30) s, which in a 2-second N=16 round is ~3 ms a token."""
    return int((swarm.get("resolver") or {}).get("refreshes", 0))


def coded(swarm: dict) -> int:
    """Replies that came coded from every worker the backbone sees (``/v1/swarm``)."""
    return sum((w.get("wire") or {}).get("coded_replies", 0) for w in swarm["workers"])


def per_token(r: dict) -> str:
    """The backbone's and the workers' CPU per generated token (ms; /proc, less load-sensitive
    than tokens/s; the workers' summed, and the busiest one's), the replies that came coded, the
    steps and expert requests per token and the last step's micro-batches: one line."""
    tok = max(1, r["tokens"])
    workers = [v for k, v in r["cpu"].items() if k != "backbone"]
    replies = f"{r['coded_replies']} of {r['requests']} replies coded, " if "coded_replies" in r else ""
    return (f"backbone CPU {1000 * r['cpu'].get('backbone', 0.0) / tok:.2f} ms/token, "
            + (f"workers CPU {1000 * sum(workers) / tok:.2f} ms/token (busiest {1000 * max(workers) / tok:.2f}), "
               if workers else "") + replies +
            f"{r['steps'] / tok:.3f} steps/token, {r['requests'] / tok:.2f} expert requests/token, "
            f"micro-batches {r['micro_batches']}"
            + (f", {r['refreshes']} coverage refresh(es) in the window" if r.get("refreshes") else ""))


def run_config(model: Path, work: Path, groups: CpuGroups, *, label: str, quotas: list[float],
               ranges: list[tuple[int, int]], args, conc: list[int]) -> dict:
    """One swarm: the backbone in a group of ``--backbone-cpu``, worker i in one of ``quotas[i]``;
    alternating concurrencies, best of ``--rounds``."""
    made = []

    def place(name: str, proc) -> None:
        sw_named[name] = proc
        if name == "boot":
            return
        q = args.backbone_cpu if name == "backbone" else quotas[int(name[1:])]
        g = groups.make(f"{label}-{name}", q)
        g.add(proc.pid)
        made.append(g)

    sw_named: dict = {}
    d = work / label
    try:
        with WanSwarm(model, ranges=ranges, rtt_ms=args.rtt, workdir=d, kernel=args.kernel, timeout_s=60,
                      threads=1, proxies="per-link", on_start=place, direct=args.direct,
                      worker_rtt_ms=args.worker_rtt, worker_up_mbps=args.worker_up,
                      backbone_args=["--micro-batches", args.micro_batches]) as sw:
            sw.named = {k: v for k, v in sw_named.items() if k != "boot"}
            if ranges:
                sw.wait_covered(timeout_s=300)
            measure(sw, 2, 2)  # warm-up: connections, caches, every owner measured once
            warm_up(sw, conc, args)
            # owner name -> worker index (its peer id, from the identity file WanSwarm gave it)
            index = {load_or_create_identity(d / f"w{i}.key").peer_id_str: i for i in range(len(ranges))}
            sw.owner_index = {w["name"]: index.get(w["peer"], -1) for w in sw.swarm()["workers"]}
            spy = start_py_spy(args, sw, label)
            best: dict[int, dict] = {}
            timed: dict[int, list[dict]] = {n: [] for n in conc}
            for _ in range(args.rounds):
                for n in conc:
                    r = measure(sw, n, args.tokens)
                    if not ranges and r["remote_groups"]:
                        raise RuntimeError("the backbone-alone run sent expert work to a worker")
                    timed[n].append(r)
                    if n not in best or r["tps"] > best[n]["tps"]:
                        best[n] = r
            for n, r in best.items():
                r["pooled"] = pooled(timed[n])
            if spy is not None:
                spy.wait()
                print(label, "backbone profile:", profile_summary(Path(args.py_spy) / f"{label}.txt"), flush=True)
            r_throttled = {g.path.name.rsplit("-", 1)[-1]: g.throttled() for g in made}
            for r in best.values():
                r["throttled"] = r_throttled
            print(label, {n: (round(r["tps"], 2), f"fallbacks {r['fallbacks']}", f"local {r['local_groups']}",
                              r["owner_rows"]) for n, r in best.items()}, flush=True)
            for n, r in best.items():
                print(f"{label} N={n}: {r['tps']:.2f} tokens/s, {per_token(r)}", flush=True)
            return best
    finally:
        for g in made:  # the swarm's processes are stopped by now
            groups.remove(g)
        shutil.rmtree(d, ignore_errors=True)


def pooled(rounds: list[dict]) -> dict:
    """Every timed round's expert seconds, dense-busy seconds and tokens, summed.

    Why: f (the alone step's share on routed experts) comes from wall-time counters under a CPU
    quota, where a throttled period lands in whichever part of the step is running; one round's f
    moved 0.69-0.77 between runs of the same tree (i46f, 2026-12-08), and the goal's ratio with it.
    The bounds are made from every timed round of both backbone-alone runs instead."""
    return {k: sum(r[k] for r in rounds) for k in ("expert_s", "busy_s", "tokens")}


def amdahl_share(*runs: dict) -> tuple[float, float]:
    """(f, expert seconds per token) over the pooled rounds of ``runs`` (the backbone-alone runs'
    entries for one N; ``pooled`` absent: the entry's own round)."""
    parts = [r.get("pooled", r) for r in runs]
    expert, busy, tokens = (sum(p[k] for p in parts) for k in ("expert_s", "busy_s", "tokens"))
    return (expert / busy if busy else 0.0), expert / max(1, tokens)


def warm_up(sw: WanSwarm, conc: list[int], args) -> list[dict]:
    """``--warm`` untimed rounds at every measured N, before the timed ones.

    Why: the one small warm-up (2 requests of 2 tokens) touches a few experts and gives no link a
    rate. The first timed round then carried the swarm's cold start: every node faulting in the
    expert pages it had not read yet (the workers' CPU per token was twice a later round's), and
    each link's first replies zstd-coded until its rate is measured (p2pswarm.net.wire.link_rate).
    With ``--rounds 1`` that round was the first N's only one, so N=16 (measured first) showed
    the start-up and N=64 the steady state (docs/benchmarks.md, 2026-12-07, i46c)."""
    return [measure(sw, n, args.tokens) for _ in range(args.warm) for n in conc]


def start_py_spy(args, sw: WanSwarm, label: str):
    """``--py-spy DIR``: py-spy samples the backbone's Python (``--gil``: the work the GIL
    serialises, which is what a 0.3-core backbone runs out of; ``--py-spy-all``: every running
    thread) for ``--py-spy-s`` seconds from the start of the measurements; raw stacks to DIR/LABEL.txt."""
    if not args.py_spy:
        return None
    Path(args.py_spy).mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([str(Path(sys.executable).with_name("py-spy")), "record", "--pid", str(sw.backbone.pid),
                             "-d", str(args.py_spy_s), "-r", str(args.py_spy_rate), *(["--gil"] if args.py_spy_gil else []),
                             "-f", "raw", "--nonblocking",
                             "-o", str(Path(args.py_spy) / f"{label}.txt")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


BUCKETS = (("ggml compute (dense + experts)", "ggml"), ("noise/libp2p", "libp2p/"),
           ("cryptography", "cryptography/"), ("msgpack", "msgpack"), ("wire framing", "p2pswarm/net/"),
           ("expert inputs/outputs", "socket_owner"), ("dispatch", "backbone/dispatch/"),
           ("dense path (numpy)", "p2pswarm/engine/"), ("scheduler/runner", "p2pswarm/backbone/"),
           ("HTTP", "starlette"), ("trio", "trio/"), ("numpy", "numpy/"))


def profile_summary(path: Path) -> str:
    """The samples by activity: the first bucket that matches a frame, from the leaf up."""
    if not path.exists():
        return "no samples (py-spy needs ptrace)"
    counts: dict[str, int] = {}
    total = 0
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        frames = stack.split(";")[::-1]
        label = next((b for f in frames for b, key in BUCKETS if key in f), "other")
        counts[label] = counts.get(label, 0) + int(n)
        total += int(n)
    return ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in sorted(counts.items(), key=lambda kv: -kv[1])) or "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="geometry-122b")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--kernel", default="ggml")
    ap.add_argument("--backbone-cpu", type=float, default=0.3, help="the backbone's CPU quota in cores (default 0.3)")
    ap.add_argument("--worker-cpu", type=float, default=0.12, help="each worker's CPU quota in cores (default 0.12)")
    ap.add_argument("--workers", type=int, action="append", default=None, help="worker counts (repeatable; default 1 2 4 8)")
    ap.add_argument("--replicas", type=int, action="append", default=None,
                    help="replicas of each share (repeatable; default 1; 2: W workers hold W/2 shares twice)")
    ap.add_argument("--concurrency", type=int, action="append", default=None, help="default 16 and 64")
    ap.add_argument("--tokens", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--warm", type=int, default=1,
                    help="untimed rounds at every N before the timed ones (default 1; 0: only the small "
                         "warm-up, so the first timed round carries the cold start)")
    ap.add_argument("--rtt", type=float, default=0.0, help="each worker's link RTT in ms (WAN proxy; 0: loopback)")
    ap.add_argument("--worker-rtt-ms", default=None, metavar="MS,MS,...",
                    help="worker i's link RTT is the i-th of these (cycled; e.g. 0,25,50: one WAN proxy per link, "
                         "none at 0), instead of --rtt for all")
    ap.add_argument("--worker-up-mbps", default=None, metavar="MBPS,MBPS,...",
                    help="cap worker i's upload at the i-th of these Mbit/s (cycled; one value: every worker; 0: none; "
                         "a WAN proxy per capped link, even at 0 ms)")
    ap.add_argument("--micro-batches", default="auto")
    ap.add_argument("--direct", action="store_true",
                    help="workers offer direct lanes (--direct): expert requests skip py-libp2p's noise and yamux")
    ap.add_argument("--unequal", default=None,
                    help="comma-separated worker quotas (e.g. 0.1,0.2,0.4): replicas of every expert on unequal "
                         "devices, against the same total split evenly")
    ap.add_argument("--no-curve", action="store_true", help="only the --unequal run (and the backbone alone)")
    ap.add_argument("--py-spy", metavar="DIR", help="py-spy the backbone in each configuration (raw stacks to DIR)")
    ap.add_argument("--py-spy-s", type=int, default=20, help="seconds of each --py-spy recording (default 20)")
    ap.add_argument("--py-spy-all", dest="py_spy_gil", action="store_false",
                    help="--py-spy samples every running thread, not only the one holding the GIL (ggml's and "
                         "zstd's work release it: this shows the whole CPU)")
    ap.add_argument("--py-spy-rate", type=int, default=50, help="samples a second of --py-spy (default 50)")
    ap.add_argument("--plot")
    ap.add_argument("--out")
    ap.add_argument("--json")
    args = ap.parse_args()
    for name in ("backbone_cpu", "worker_cpu"):
        if not getattr(args, name) > 0:
            ap.error(f"--{name.replace('_', '-')} must be > 0 cores")
    workers = args.workers or [1, 2, 4, 8]
    replicas = args.replicas or [1]
    if any(w < 1 for w in workers) or any(r < 1 for r in replicas):
        ap.error("--workers and --replicas must be >= 1")
    unequal = None
    if args.unequal:
        try:
            unequal = [float(x) for x in args.unequal.split(",")]
        except ValueError:
            ap.error(f"--unequal {args.unequal!r}: comma-separated numbers of cores, e.g. 0.1,0.2,0.4")
        if len(unequal) < 2 or not all(q > 0 for q in unequal):
            ap.error("--unequal needs two or more quotas > 0")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            ap.error("--plot needs matplotlib (pip install matplotlib)")
    args.worker_rtt = per_worker(ap, "--worker-rtt-ms", args.worker_rtt_ms, "milliseconds, e.g. 0,25,50")
    if args.worker_rtt and args.rtt:
        ap.error("--worker-rtt-ms needs no --rtt")
    args.worker_up = per_worker(ap, "--worker-up-mbps", args.worker_up_mbps, "Mbit/s, e.g. 20 or 20,0,100")
    conc = args.concurrency or [16, 64]
    try:
        groups = CpuGroups()
    except CgroupError as exc:
        print(f"device_swarm: {exc}", file=sys.stderr)
        sys.exit(2)
    work = Path(tempfile.mkdtemp(prefix="device-swarm-"))
    try:
        with groups:
            run(args, work, groups, workers, replicas, unequal, conc)
    except KeyboardInterrupt:
        print("device_swarm: interrupted (cgroups and files removed)", file=sys.stderr)
        sys.exit(130)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(args, work: Path, groups: CpuGroups, workers: list[int], replicas: list[int],
        unequal: list[float] | None, conc: list[int]) -> None:
    shape = PRESETS[args.preset]
    L = args.layers
    model = work / f"{args.preset}.gguf"
    make_model(model, preset=args.preset, qtype="q8_0", seed=2, layers=L)
    load = [os.getloadavg()]
    cfg = dict(model=model, work=work, groups=groups, args=args, conc=conc)
    results: dict[str, dict[int, dict]] = {}
    results["alone"] = run_config(label="alone", quotas=[], ranges=[], **cfg)
    if not args.no_curve:
        for r in replicas:
            for w in workers:
                if w % r:
                    continue
                ranges = worker_ranges(shape.n_expert, w // r) * r
                results[f"{w}w-r{r}"] = run_config(label=f"{w}w-r{r}", quotas=[args.worker_cpu] * w,
                                                   ranges=ranges, **cfg)
    if unequal:
        full = [(0, shape.n_expert)] * len(unequal)
        even = [sum(unequal) / len(unequal)] * len(unequal)
        for label, quotas in (("unequal", unequal), ("even", even), ("unequal2", unequal), ("even2", even)):
            results[label] = run_config(label=label, quotas=quotas, ranges=full, **cfg)
    results["alone2"] = run_config(label="alone2", quotas=[], ranges=[], **cfg)  # the drift: A ... A
    load.append(os.getloadavg())
    report(args, shape, L, results, conc, unequal, load)


def report(args, shape, L, results, conc, unequal, load) -> None:
    alone = {n: max(results["alone"][n]["tps"], results["alone2"][n]["tps"]) for n in conc}
    lines = ["| configuration | worker quotas (cores) | N | tokens/s | vs backbone alone | Amdahl bound | workers' compute "
             "bound | link bound | ratio to min(Amdahl, link) | backbone CPU ms/token | texts equal alone's | fallbacks | "
             "local groups | pairs per worker |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # pairs per worker: in worker order (quotas' order)
    bounds: dict[int, dict] = {}
    for n in conc:
        # f and the seconds of expert work per token at the backbone's quota: every timed round of
        # both alone runs (one round's f is noisy under a quota: see ``pooled``)
        f, e_per_tok = amdahl_share(results["alone"][n], results["alone2"][n])
        each = [amdahl_share(results[k][n])[0] for k in ("alone", "alone2")]
        bounds[n] = {"f": f, "amdahl": alone[n] / (1 - f) if f < 1 else float("inf"), "e_per_tok": e_per_tok,
                     "f_each": each}
    for label, best in results.items():
        for n, r in best.items():
            b = bounds[n]
            quotas = args_quotas(args, label, unequal)
            work_bound = (sum(quotas) / args.backbone_cpu) / b["e_per_tok"] if quotas else float("nan")
            rtt = link_rtt_ms(args, len(quotas))
            link = min(n / (L * rtt / 1000) if rtt > 0 else float("inf"), upload_bound(args, r))
            lim = min(b["amdahl"], link)
            same = sum(t == u for t, u in zip(r["texts"], results["alone"][n]["texts"]))
            rows = r["owner_rows"]
            lines.append(f"| {label} | {','.join(f'{q:g}' for q in quotas) or '-'} | {n} | {r['tps']:.2f} | "
                         f"{r['tps'] / alone[n]:.2f}x | {b['amdahl']:.2f} | {work_bound:.2f} | "
                         f"{'inf' if link == float('inf') else f'{link:.1f}'} | {r['tps'] / lim:.2f} | "
                         f"{1000 * r['cpu'].get('backbone', 0.0) / max(1, r['tokens']):.2f} | "
                         f"{same}/{len(r['texts'])} | {r['fallbacks']} | {r['local_groups']} | "
                         f"{' '.join(str(rows[k]) for k in sorted(rows, key=str)) or '-'} |")
    cmd = ("python bench/device_swarm.py" + (f" --preset {args.preset}" if args.preset != "geometry-122b" else "")
           + f" --layers {L} --backbone-cpu {args.backbone_cpu:g} --worker-cpu {args.worker_cpu:g}"
           + "".join(f" --workers {w}" for w in (args.workers or []))
           + "".join(f" --replicas {r}" for r in (args.replicas or []))
           + "".join(f" --concurrency {n}" for n in (args.concurrency or []))
           + f" --tokens {args.tokens} --rounds {args.rounds}"
           + (f" --rtt {args.rtt:g}" if args.rtt else "")
           + (f" --worker-rtt-ms {args.worker_rtt_ms}" if args.worker_rtt_ms else "")
           + (f" --worker-up-mbps {args.worker_up_mbps}" if args.worker_up_mbps else "")
           + (f" --unequal {args.unequal}" if args.unequal else "") + (" --direct" if args.direct else "") + (" --no-curve" if args.no_curve else ""))
    text = header("Devices in CPU cgroups: tokens/s against the number of workers", cmd) + (
        f"Synthetic {args.preset} q8_0 model ({L} layers, {shape.n_embd} wide, {shape.n_expert} experts of "
        f"{shape.n_ff_exp} ({shape.expert_qtype or 'q8_0'}), top-{shape.n_expert_used}), kernel {args.kernel}; "
        f"the backbone in a CPU cgroup of {args.backbone_cpu:g} of a core, each worker in its own "
        f"(bench/cpu_groups.py), every node one kernel thread; bootstrap, "
        f"{'WAN proxies (' + format(args.rtt, 'g') + ' ms RTT) and ' if args.rtt else ''}"
        f"{'WAN proxies (worker RTTs ' + args.worker_rtt_ms + ' ms) and ' if args.worker_rtt_ms else ''}the load generator outside "
        f"the groups. N concurrent greedy requests of {args.tokens} tokens, best of {args.rounds} "
        f"(N alternating) after {args.warm} untimed round(s) at each N; the backbone alone ran first and last (its best is the baseline: "
        + ", ".join(f"N={n}: {results['alone'][n]['tps']:.2f} then {results['alone2'][n]['tps']:.2f}" for n in conc)
        + " tokens/s). Amdahl bound = alone / (1 - f), f = the alone step's share on routed experts over "
        "every timed round of both alone runs ("
        + ", ".join(f"N={n}: {bounds[n]['f']:.2f}, the two runs {bounds[n]['f_each'][0]:.2f} and "
                    f"{bounds[n]['f_each'][1]:.2f}" for n in conc)
        + "); workers' compute bound = the workers' total quota / the backbone's, over the alone run's "
        f"expert seconds per token; link bound = N / (L RTT), the largest worker RTT (inf at 0 ms), and with "
        f"--worker-up-mbps each capped worker's cap over the bytes it sent per token (the smallest). Load average "
        f"{load[0][0]:.2f} before, {load[1][0]:.2f} after (2 cores, shared with other jobs: a quota is a "
        f"ceiling, not a guarantee).\n\n") + "\n".join(lines) + "\n"
    if args.plot:
        plot(args, results, conc, alone, bounds)
        text += f"\n![device scaling]({Path(args.plot).name})\n"
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps({k: {n: {kk: vv for kk, vv in r.items() if kk != "texts"}
                                                  for n, r in v.items()} for k, v in results.items()}, default=str))
    if args.out:
        with open(args.out, "a") as f:
            f.write(text)


def upload_bound(args, r: dict) -> float:
    """The tokens/s the capped workers' uploads carry at the bytes each sent the backbone per
    token in this run (the smallest; inf without ``--worker-up-mbps``)."""
    best = float("inf")
    for i, sent in r.get("received", {}).items():
        if args.worker_up and isinstance(i, int) and i >= 0 and sent > 0:
            cap = args.worker_up[i % len(args.worker_up)]
            if cap:
                best = min(best, cap * 1e6 / 8 / (sent / max(1, r["tokens"])))
    return best


def per_worker(ap, flag: str, text: str | None, unit: str) -> list[float] | None:
    """A per-worker option's values (comma-separated, >= 0; worker i takes the i-th, cycled), or
    None when not given; a malformed one ends the script with argparse's message."""
    if not text:
        return None
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        ap.error(f"{flag} {text!r}: comma-separated {unit}")
    if not all(v >= 0 for v in values):
        ap.error(f"{flag} needs values >= 0")
    return values


def link_rtt_ms(args, workers: int) -> float:
    """The RTT that bounds a step: every layer waits for its slowest owner's link (with
    ``--worker-rtt-ms``, the largest RTT among the configuration's workers)."""
    if args.worker_rtt and workers:
        return max(args.worker_rtt[i % len(args.worker_rtt)] for i in range(workers))
    return args.rtt


def args_quotas(args, label: str, unequal: list[float] | None) -> list[float]:
    if label.startswith("alone"):
        return []
    if label.startswith("unequal"):
        return list(unequal)
    if label.startswith("even"):
        return [sum(unequal) / len(unequal)] * len(unequal)
    return [args.worker_cpu] * int(label.split("w")[0])


def plot(args, results, conc, alone, bounds) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for n in conc:
        for r in sorted({int(k.split("-r")[1]) for k in results if "-r" in k}):
            pts = sorted((int(k.split("w")[0]), v[n]["tps"]) for k, v in results.items() if k.endswith(f"-r{r}"))
            xs, ys = [0] + [p[0] for p in pts], [alone[n]] + [p[1] for p in pts]
            ax.plot(xs, ys, marker="o", label=f"N={n}, {r} replica{'s' if r > 1 else ''} per share")
        ax.axhline(bounds[n]["amdahl"], linestyle="--", linewidth=1, color="gray")
        ax.text(0, bounds[n]["amdahl"], f" Amdahl bound N={n}", va="bottom", fontsize=8, color="gray")
    ax.set_xlabel("workers (0: the backbone alone computes every expert)")
    ax.set_ylabel("aggregate generated tokens/s")
    ax.set_title(f"backbone {args.backbone_cpu:g} core, workers {args.worker_cpu:g} core each (CPU cgroups)", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=100)


if __name__ == "__main__":
    main()
