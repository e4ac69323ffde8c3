"""A decode step's CPU inside our ggml graphs and outside them, against llama.cpp's whole step.

    python bench/decode_split.py --model M.gguf [--rounds 5] [--reps 3] [--steps 32] [--threads 1]

Why: on a shared machine the wall-clock ratio to llama.cpp is noise, and at 2 threads our
short OpenMP spin and llama.cpp's long one make CPU seconds hard to compare.
At ONE thread neither side waits for a thread. So CPU per step splits cleanly into what our graphs
cost (the computing thread's CPU inside ``GgmlRunner.compute``) and what runs between them: the
computing thread's Python between graphs, the event loop and the thread hop. llama.cpp's whole
step (one graph, process user CPU) is the reference. Processes alternate, llama.cpp then ours, for
``--rounds`` rounds. Each process runs ``--reps`` reps of an 8-token prompt then ``--steps`` timed one-token
steps (``Backbone.forward`` / one-token ``llama_decode``, F32 KV cache, no flash attention).
Ours also times, in the loop, the Python pieces between graphs (gpt-oss's one-graph decode step
runs its router's numpy inside the graph: ``route_biased``, counted inside). It prints medians over all reps. Each piece
is timed as its own time less any timed piece inside it. Those pieces cost several times what they cost
warm: each runs right after a graph that streamed the weights through the caches.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def tokens(n: int, salt: int, vocab: int) -> list[int]:
    return [(7919 * i + 104729 * salt + 11) % vocab for i in range(n)]


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def child_ours(a) -> dict:
    sys.path.insert(0, str(REPO))
    import trio

    from p2pswarm.backbone.dispatch.dispatcher import Dispatcher
    from p2pswarm.backbone.serving.runner import Backbone
    from p2pswarm.backbone.sessions.local import open_backbone
    from p2pswarm.engine.experts.ggml_bank import ExpertsInFront
    from p2pswarm.engine.ggml.runner import GgmlRunner

    own: collections.Counter = collections.Counter()
    stack: list[float] = []

    def timed(owner, name: str, label: str, clock=time.perf_counter) -> None:
        f = getattr(owner, name)

        def w(*args, **kw):
            t = clock()
            stack.append(0.0)
            try:
                return f(*args, **kw)
            finally:
                dt = clock() - t
                own[label] += dt - stack.pop()
                if stack:
                    stack[-1] += dt

        setattr(owner, name, w)

    async def run() -> dict:
        out: dict[str, list[float]] = collections.defaultdict(list)
        async with open_backbone(a.model, workers=0, kernel="ggml", threads=a.threads) as swarm:
            b, m = swarm.backbone, swarm.backbone.model
            V = m.n_vocab
            inside = collections.Counter()
            plain = GgmlRunner.compute

            def compute(self, graph, macs):
                t, w = time.thread_time(), time.perf_counter()
                plain(self, graph, macs)
                inside["cpu"] += time.thread_time() - t
                dt = time.perf_counter() - w
                inside["wall"] += dt
                if stack:  # not the Python of the piece that called it
                    stack[-1] += dt
                inside["n"] += 1

            GgmlRunner.compute = compute  # type: ignore[method-assign]
            for owner, name in ((type(m), "route_logits"), (type(m), "route_biased"), (type(m), "embed"),
                                (type(m), "layer_in"),
                                (type(m), "layer_in_after"), (type(m), "output_after"), (ExpertsInFront, "of"),
                                (ExpertsInFront, "fill"), (Backbone, "_groups"), (Dispatcher, "ran_locally")):
                if hasattr(owner, name):
                    timed(owner, name, f"{owner.__name__}.{name}")
            for r in range(a.reps + 1):
                st = b.new_state()
                await b.forward(tokens(8, 10 + r, V), st)
                inside.clear()
                own.clear()
                c0, w0 = cpu_s(), time.perf_counter()
                for t in tokens(a.steps, 20 + r, V):
                    await b.forward([t], st)
                cpu, wall = cpu_s() - c0, time.perf_counter() - w0
                if r == 0:
                    continue  # warm-up
                n = a.steps
                out["cpu"].append(cpu * 1000 / n)
                out["inside_cpu"].append(inside["cpu"] * 1000 / n)
                out["outside_wall"].append((wall - inside["wall"]) * 1000 / n)
                out["graphs"].append(inside["n"] / n)
                for k, v in own.items():
                    out["piece " + k].append(v * 1e6 / n)
        return dict(out)

    return trio.run(run)


def child_llama(a) -> dict:
    from common import llama_model

    L, model, V = llama_model(a.model)
    cp = L.llama_context_default_params()
    cp.n_ctx, cp.n_seq_max = max(512, a.steps + 64), 1
    cp.n_batch = cp.n_ubatch = 64
    cp.n_threads = cp.n_threads_batch = a.threads
    cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_DISABLED
    cp.type_k = cp.type_v = 0  # F32
    ctx = L.llama_init_from_model(model, cp)
    mem = L.llama_get_memory(ctx)
    batch = L.llama_batch_init(64, 0, 1)

    def decode(items):
        batch.n_tokens = len(items)
        for i, (tok, pos) in enumerate(items):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
            batch.seq_id[i][0], batch.logits[i] = 0, int(i == len(items) - 1)
        if L.llama_decode(ctx, batch) != 0:
            raise SystemExit("llama_decode failed")
        L.llama_synchronize(ctx)

    out: dict[str, list[float]] = collections.defaultdict(list)
    for r in range(a.reps + 1):
        decode([(t, i) for i, t in enumerate(tokens(8, 10 + r, V))])
        c0 = cpu_s()
        for i, t in enumerate(tokens(a.steps, 20 + r, V)):
            decode([(t, 8 + i)])
        if r:
            out["cpu"].append((cpu_s() - c0) * 1000 / a.steps)
        L.llama_memory_clear(mem, True)
    return dict(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=3, help="timed reps per process")
    ap.add_argument("--steps", type=int, default=32, help="decode steps per rep")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--child", choices=("ours", "llama"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child_ours(a) if a.child == "ours" else child_llama(a)))
        return
    runs: dict[str, dict[str, list[float]]] = {"llama": collections.defaultdict(list),
                                               "ours": collections.defaultdict(list)}
    load = []
    for _ in range(a.rounds):
        for side in ("llama", "ours"):
            load.append(os.getloadavg()[0])
            cmd = [sys.executable, str(Path(__file__).resolve()), "--child", side, "--model", str(a.model),
                   "--reps", str(a.reps), "--steps", str(a.steps), "--threads", str(a.threads)]
            env = dict(os.environ, PYTHONPATH=str(REPO), P2PSWARM_ADAPT_THREADS="off")
            p = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if p.returncode != 0:
                raise SystemExit(f"{side} failed: {(p.stderr.strip().splitlines() or [''])[-1]}")
            for k, v in json.loads(p.stdout.strip().splitlines()[-1]).items():
                runs[side][k] += v
    med = {s: {k: statistics.median(v) for k, v in r.items()} for s, r in runs.items()}
    ref = med["llama"]["cpu"]
    o = med["ours"]
    print(f"## Decode CPU inside and outside the graphs: `{a.model.name}`, {a.threads} thread(s)\n")
    print(f"`python bench/decode_split.py --model {a.model} --rounds {a.rounds} --reps {a.reps} --steps {a.steps}"
          f" --threads {a.threads}` — {time.strftime('%Y-%m-%d')}, load average {min(load):.1f}-{max(load):.1f}, "
          f"medians of {a.rounds * a.reps} reps\n")
    print("| | ms per decode step | vs llama.cpp's step |\n|---|---|---|")
    print(f"| llama.cpp, whole step (process CPU) | {ref:.2f} | 1.00x |")
    print(f"| p2pswarm, whole step (process CPU) | {o['cpu']:.2f} | {o['cpu'] / ref:.2f}x |")
    print(f"| p2pswarm, inside its {o['graphs']:.0f} graphs (the computing thread's CPU) | {o['inside_cpu']:.2f} | "
          f"{o['inside_cpu'] / ref:.2f}x |")
    print(f"| p2pswarm, wall outside the graphs | {o['outside_wall']:.2f} | |")
    pieces = sorted((k for k in o if k.startswith("piece ")), key=lambda k: -o[k])
    print("\n| our Python between graphs (a one-graph step's router, `route_biased`: inside it), in the loop (own time)"
          " | µs per step |\n|---|---|")
    for k in pieces:
        print(f"| `{k[6:]}` | {o[k]:.0f} |")


if __name__ == "__main__":
    main()
