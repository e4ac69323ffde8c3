"""Where a prefill's time goes, ggml node by ggml node, in our engine and in llama.cpp on the same file.

    python bench/prefill_ops.py --model M.gguf [--prefill 16] [--reps 3] [--rounds 2] [--last-row]
                                [--decode N] [--ours-tree SRC] [--top 25]

Each side runs in its own process on ONE thread (so a node's time is its own work, not a thread
team's wait), the sides alternating (llama.cpp, ours, [ours from ``--ours-tree``]) for ``--rounds``
rounds; each times ``--reps`` prefills of ``--prefill`` tokens after an untimed one. Ours computes
every graph the engine builds one node at a time (the node added to a one-node graph, same
backend), llama.cpp reports each node through its eval callback (``cb_eval``: the scheduler then
computes node by node). A node is named by its op, its weight's shape and ggml type (for
``MUL_MAT`` / ``MUL_MAT_ID``) and its result's shape, so the same node of both graphs meets in one
row: the table shows ms per prefill per side (the median over rounds), the node counts per prefill
and each side's total. Ours also shows its engine calls (attention, post_moe, routed experts, ...)
by wall time. ``--last-row``: logits of the last row only on both sides (llama.cpp's ``inp_out_ids``).
``--decode N``: time decode steps instead: each rep prefills ``--prefill`` tokens untimed, then
decodes ``N`` tokens one at a time (ours ``Backbone.forward``, llama.cpp one-token ``llama_decode``);
the table is then ms per decode step.
"""
from __future__ import annotations

import argparse
import collections
import ctypes
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def tokens(n: int, salt: int, vocab: int) -> list[int]:
    return [(7919 * i + 104729 * salt + 11) % vocab for i in range(n)]


class Nodes:
    """Seconds and counts per node description."""

    def __init__(self, base):
        self.base = base
        base.ggml_op_desc.restype, base.ggml_op_desc.argtypes = ctypes.c_char_p, [ctypes.c_void_p]
        self.s: collections.Counter = collections.Counter()
        self.n: collections.Counter = collections.Counter()

    def describe(self, t: int) -> str:
        """op [weight shape, type] -> result shape (ggml_tensor: type at 0, ne[4] at 16, src[0] at 152)."""
        op = self.base.ggml_op_desc(t).decode()
        ne = (ctypes.c_int64 * 4).from_address(t + 16)
        src0 = ctypes.c_void_p.from_address(t + 152).value
        w = ""
        if op in ("MUL_MAT", "MUL_MAT_ID") and src0:
            wne = (ctypes.c_int64 * 4).from_address(src0 + 16)
            w = f" {list(wne[:3])} type {ctypes.c_int32.from_address(src0).value}"
        return f"{op}{w} -> {list(ne[:3])}"

    def add(self, t: int, seconds: float) -> None:
        d = self.describe(t)
        self.s[d] += seconds
        self.n[d] += 1


def child_ours(a) -> dict:
    sys.path.insert(0, os.environ.get("BENCH_OURS_TREE", str(REPO)))
    import trio

    try:
        from p2pswarm.backbone.sessions.local import open_backbone
        from p2pswarm.engine.ggml import runner as ggml_runner
        from p2pswarm.engine.ggml.lib import _InitParams
    except ImportError:  # a tree from before the engine's and backbone's folders (--ours-tree)
        from p2pswarm.backbone.session import open_backbone  # type: ignore[no-redef]
        from p2pswarm.engine import ggml_runner  # type: ignore[no-redef]
        from p2pswarm.engine.ggml_kernel import _InitParams  # type: ignore[no-redef]

    calls: collections.Counter = collections.Counter()

    def timed(obj, name, label):
        f = getattr(obj, name)

        def w(*args, **kw):
            t = time.perf_counter()
            try:
                return f(*args, **kw)
            finally:
                calls[label] += time.perf_counter() - t

        setattr(obj, name, w)

    async def run() -> dict:
        async with open_backbone(a.model, workers=0, kernel="ggml", threads=1) as swarm:
            b, m = swarm.backbone, swarm.backbone.model
            V = m.n_vocab
            await b.forward_batch([(tokens(a.prefill, 3, V), b.new_state())], last_only=a.last_row)
            lib = m.backend.ggml.runner.lib
            base = lib._libs["base"]
            base.ggml_graph_n_nodes.restype, base.ggml_graph_n_nodes.argtypes = ctypes.c_int, [ctypes.c_void_p]
            base.ggml_graph_node.restype = ctypes.c_void_p
            base.ggml_graph_node.argtypes = [ctypes.c_void_p, ctypes.c_int]
            base.ggml_graph_clear.argtypes = [ctypes.c_void_p]
            base.ggml_graph_add_node.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
            nodes = Nodes(base)
            on = [not a.decode]
            plain = ggml_runner.GgmlRunner.compute
            gctx = lib.init(_InitParams(int(lib.graph_overhead_custom(16, False)) + 4096, None, True))
            one = lib.new_graph_custom(gctx, 16, False)

            def compute(self, graph, macs):  # node by node, one thread
                if not on[0]:
                    return plain(self, graph, macs)
                self.lib.backend_cpu_set_n_threads(self._backend, 1)
                for i in range(base.ggml_graph_n_nodes(graph)):
                    node = base.ggml_graph_node(graph, i)
                    base.ggml_graph_clear(one)
                    base.ggml_graph_add_node(one, node)
                    t = time.perf_counter()
                    if self.lib.backend_graph_compute(self._backend, one) != 0:
                        raise RuntimeError("ggml graph compute failed")
                    nodes.add(node, time.perf_counter() - t)

            ggml_runner.GgmlRunner.compute = compute
            for name, label in (("pre_moe_batch", "attention (the layer's graph)"), ("ffn_input", "ffn_norm"),
                                ("route", "router"), ("post_moe", "post_moe (dense FFN, shared expert, residual)"),
                                ("output", "lm head"), ("embed", "embedding")):
                if hasattr(m, name):
                    timed(m, name, label)
            timed(b.dispatcher, "run_groups_local", "routed experts")
            if a.decode:  # warm the decode graphs once, untimed
                st = b.new_state()
                await b.forward(tokens(a.prefill, 4, V), st)
                await b.forward(tokens(1, 5, V), st)
                calls.clear()
            wall = 0.0
            for r in range(a.reps):
                if not a.decode:
                    t0 = time.perf_counter()
                    await b.forward_batch([(tokens(a.prefill, 10 + r, V), b.new_state())], last_only=a.last_row)
                    wall += time.perf_counter() - t0
                    continue
                st = b.new_state()
                await b.forward(tokens(a.prefill, 10 + r, V), st)
                on[0] = True
                t0 = time.perf_counter()
                for tok in tokens(a.decode, 20 + r, V):
                    await b.forward([tok], st)
                wall += time.perf_counter() - t0
                on[0] = False
        return {"wall": wall, "nodes": dict(nodes.s), "counts": dict(nodes.n), "calls": dict(calls)}

    return trio.run(run)


def child_llama(a) -> dict:
    from common import llama_model

    L, model, V = llama_model(a.model)
    nodes = Nodes(ctypes.CDLL(str(Path(L.__file__).parent / "lib" / "libggml-base.so")))
    state = {"on": False, "t": 0.0}

    @L.ggml_backend_sched_eval_callback
    def cb(t, ask, _ud):
        if ask:  # True: the scheduler computes up to this node, then calls back with ask=False
            return state["on"]
        nodes.add(t, time.perf_counter() - state["t"])
        state["t"] = time.perf_counter()
        return True

    cp = L.llama_context_default_params()
    cp.n_ctx = max(512, a.prefill + 64)
    cp.n_batch = cp.n_ubatch = max(a.prefill, 64)
    cp.n_seq_max = 1
    cp.n_threads = cp.n_threads_batch = 1
    cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_DISABLED
    cp.type_k = cp.type_v = 0  # F32
    cp.cb_eval = cb
    ctx = L.llama_init_from_model(model, cp)
    batch = L.llama_batch_init(max(a.prefill, 64), 0, 1)
    mem = L.llama_get_memory(ctx)

    def prefill(toks):
        batch.n_tokens = len(toks)
        for i, tok in enumerate(toks):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, i, 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = 1 if not a.last_row or i == len(toks) - 1 else 0
        state["t"] = time.perf_counter()
        if L.llama_decode(ctx, batch) != 0:
            raise SystemExit("llama_decode failed")
        L.llama_synchronize(ctx)
        if not a.decode:
            L.llama_memory_clear(mem, True)

    def step(tok, pos):
        batch.n_tokens = 1
        batch.token[0], batch.pos[0], batch.n_seq_id[0] = tok, pos, 1
        batch.seq_id[0][0], batch.logits[0] = 0, 1
        state["t"] = time.perf_counter()
        if L.llama_decode(ctx, batch) != 0:
            raise SystemExit("llama_decode failed")
        L.llama_synchronize(ctx)

    prefill(tokens(a.prefill, 3, V))
    if a.decode:
        step(tokens(1, 5, V)[0], a.prefill)
        L.llama_memory_clear(mem, True)
    wall = 0.0
    for r in range(a.reps):
        if not a.decode:
            state["on"] = True
            t0 = time.perf_counter()
            prefill(tokens(a.prefill, 10 + r, V))
            wall += time.perf_counter() - t0
            continue
        prefill(tokens(a.prefill, 10 + r, V))
        state["on"] = True
        t0 = time.perf_counter()
        for i, tok in enumerate(tokens(a.decode, 20 + r, V)):
            step(tok, a.prefill + i)
        wall += time.perf_counter() - t0
        state["on"] = False
        L.llama_memory_clear(mem, True)
    return {"wall": wall, "nodes": dict(nodes.s), "counts": dict(nodes.n), "calls": {}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--prefill", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3, help="timed prefills per process")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--last-row", action="store_true", help="the last row's logits only, both sides")
    ap.add_argument("--decode", type=int, default=0, help="time N one-token decode steps after each prefill")
    ap.add_argument("--ours-tree", type=Path, help="also run our engine from this source tree (before/after)")
    ap.add_argument("--top", type=int, default=25, help="rows of the node table")
    ap.add_argument("--child", choices=("ours", "llama"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child_ours(a) if a.child == "ours" else child_llama(a)))
        return
    sides = ["llama", "ours"] + (["ours-tree"] if a.ours_tree else [])
    runs: dict[str, list[dict]] = {s: [] for s in sides}
    load = []
    for _ in range(a.rounds):
        for s in sides:
            tree = a.ours_tree if s == "ours-tree" else REPO
            cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "llama" if s == "llama" else "ours",
                   "--model", str(a.model), "--prefill", str(a.prefill), "--reps", str(a.reps)]
            cmd += ["--last-row"] if a.last_row else []
            cmd += ["--decode", str(a.decode)] if a.decode else []
            env = dict(os.environ, PYTHONPATH=str(tree), BENCH_OURS_TREE=str(tree), P2PSWARM_THREADS="1")
            load.append(os.getloadavg()[0])
            p = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if p.returncode != 0:
                raise SystemExit(f"{s} failed: {(p.stderr.strip().splitlines() or [''])[-1]}")
            runs[s].append(json.loads(p.stdout.strip().splitlines()[-1]))
    names = {"llama": "llama.cpp", "ours": "p2pswarm", "ours-tree": f"p2pswarm ({a.ours_tree})"}

    per_rep = a.reps * (a.decode or 1)  # ms per prefill, or per decode step

    def per(s, field, key):  # ms per prefill (decode step), median over rounds
        return statistics.median(r[field].get(key, 0.0) for r in runs[s]) * 1000 / per_rep

    what = f"decode step after {a.prefill} tokens" if a.decode else f"prefill of {a.prefill} tokens"
    print(f"## {'Decode' if a.decode else 'Prefill'} by ggml node: `{a.model.name}`, ms per {what}"
          f"{', last row only' if a.last_row and not a.decode else ''}, 1 thread\n")
    print(f"`python bench/prefill_ops.py --model {a.model} --prefill {a.prefill} --reps {a.reps} --rounds {a.rounds}"
          + (" --last-row" if a.last_row else "") + (f" --decode {a.decode}" if a.decode else "")
          + (f" --ours-tree {a.ours_tree}" if a.ours_tree else "")
          + f"` — {time.strftime('%Y-%m-%d')}, load average {min(load):.1f}-{max(load):.1f}\n")
    print(f"| side | wall ms per {'step' if a.decode else 'prefill'} | ggml nodes ms |\n|---|---|---|")
    for s in sides:
        wall = statistics.median(r["wall"] for r in runs[s]) * 1000 / per_rep
        node_ms = statistics.median(sum(r["nodes"].values()) for r in runs[s]) * 1000 / per_rep
        print(f"| {names[s]} | {wall:.0f} | {node_ms:.0f} |")
    keys = collections.Counter()
    for s in sides:
        for k in {k for r in runs[s] for k in r["nodes"]}:
            keys[k] = max(keys[k], per(s, "nodes", k))
    print("\n| node (op, weight shape and type, result shape) | " + " | ".join(f"{names[s]} ms (n)" for s in sides)
          + " |\n|---|" + "---|" * len(sides))
    for k, _ in keys.most_common(a.top):
        cells = []
        for s in sides:
            n = statistics.median(r["counts"].get(k, 0) for r in runs[s]) / per_rep
            cells.append(f"{per(s, 'nodes', k):.1f} ({n:g})" if n else "-")
        print(f"| `{k}` | " + " | ".join(cells) + " |")
    ours = [s for s in sides if s != "llama"]
    labels = sorted({k for s in ours for r in runs[s] for k in r["calls"]}, key=lambda k: -per("ours", "calls", k))
    print("\n| engine call (wall, node by node) | " + " | ".join(f"{names[s]} ms" for s in ours)
          + " |\n|---|" + "---|" * len(ours))
    for k in labels:
        print(f"| {k} | " + " | ".join(f"{per(s, 'calls', k):.1f}" for s in ours) + " |")


if __name__ == "__main__":
    main()
