"""What one wait of ggml's OpenMP threads costs under each wait policy: per graph start, per node.

    python bench/bench_omp_barrier.py [--rounds 2] [--spins 300 1000 3000] [--write]

Why: every node of a ggml graph ends in a barrier and every graph starts the thread team again;
under ``OMP_WAIT_POLICY=PASSIVE`` each is a sleep and a kernel wake-up, under a spin a few
microseconds. This times a 2-thread graph of 1 node and of 101 ``rms_norm`` nodes (one row of 4,096
floats: next to no work, so the time is the waits), back to back with a graph call between, in a
fresh process per policy (libgomp reads its policy once), policies alternating within each round.
It also counts the voluntary context switches per node: a wait that slept. Medians over rounds.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

from common import header, publish

WIDTH, NODES, CALLS = 4096, 101, 2000


def child() -> None:
    import numpy as np

    from p2pswarm.engine.ggml.lib import GGML_TYPE_F32, load_libggml
    from p2pswarm.engine.ggml.runner import GgmlRunner, f32_view

    lib = load_libggml()
    r = GgmlRunner(lib, 2, graph_cache_bytes=64 << 20)

    def build_of(n):
        def build(g):
            x = lib.new_tensor_1d(g.ctx, GGML_TYPE_F32, WIDTH)
            y = x
            for _ in range(n):
                y = lib.rms_norm(g.ctx, y, 1e-5)
            lib.build_forward_expand(g.graph, y)
            return f32_view(lib, x, (WIDTH,)), f32_view(lib, y, (WIDTH,))
        return build

    out = {}
    for n in (1, NODES):
        with r.lock:  # built and kept before timing
            for _ in range(2):
                g = r.graph(("b", n), 4 * WIDTH * (n + 1) + 4096, n + 2, build_of(n))
                g.t[0][...] = 1.0
                r.release(g)
        times = []
        ru0 = resource.getrusage(resource.RUSAGE_SELF)
        for _ in range(CALLS):
            with r.lock:
                g = r.graph(("b", n), 4 * WIDTH * (n + 1) + 4096, n + 2, build_of(n))
                t = time.perf_counter()
                r.compute(g.graph, 1 << 40)  # macs: enough that both threads run every node
                times.append(time.perf_counter() - t)
                r.release(g)
        ru1 = resource.getrusage(resource.RUSAGE_SELF)
        out[n] = (float(np.median(times)) * 1e6, (ru1.ru_nvcsw - ru0.ru_nvcsw) / CALLS)
    print(json.dumps({"graph_us": out[1][0], "node_us": (out[NODES][0] - out[1][0]) / (NODES - 1),
                      "sleeps_per_node": (out[NODES][1] - out[1][1]) / (NODES - 1)}))


def run(policy: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    if policy == "passive":
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    else:
        env["GOMP_SPINCOUNT"] = policy
    p = subprocess.run([sys.executable, __file__, "--child"], capture_output=True, text=True, env=env, timeout=300)
    if p.returncode != 0:
        raise SystemExit(f"bench_omp_barrier: the child failed: {(p.stderr.strip().splitlines() or [''])[-1]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--spins", nargs="+", default=["300", "1000", "3000"], help="GOMP_SPINCOUNT values against passive")
    ap.add_argument("--write", action="store_true", help="append the table to docs/benchmarks.md")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        child()
        return 0
    policies = ["passive"] + a.spins
    runs: dict[str, list[dict]] = {p: [] for p in policies}
    for _ in range(a.rounds):
        for p in policies:
            runs[p].append(run(p))
            print(p, runs[p][-1], flush=True)
    rows = []
    for p in policies:
        med = {k: statistics.median(r[k] for r in runs[p]) for k in ("graph_us", "node_us", "sleeps_per_node")}
        name = "`OMP_WAIT_POLICY=PASSIVE`" if p == "passive" else f"`GOMP_SPINCOUNT={p}`"
        rows.append(f"| {name} | {med['graph_us']:.1f} | {med['node_us']:.1f} | {med['sleeps_per_node']:.2f} |")
    cmd = "python bench/bench_omp_barrier.py " + " ".join(sys.argv[1:] if argv is None else argv)
    text = (header("OpenMP waits: what a graph start and a node's barrier cost, 2 threads", cmd)
            + f"{a.rounds} rounds alternating, medians; a graph of 1 and of {NODES} `rms_norm` nodes on one row of "
            f"{WIDTH} floats, {CALLS} calls each.\n\n"
            + "| policy | graph of 1 node, us | each further node, us | sleeps per node |\n|---|---|---|---|\n"
            + "\n".join(rows) + "\n")
    publish(text, a.write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
