"""Where a backbone decode step's wall time goes, by engine call, without a profiler.

    python bench/decode_stages.py M.gguf [--steps 64] [--threads 2]

A synchronous loop over the calls ``Backbone.forward`` makes per layer (``layer_in``: attention,
the experts' input and the router; the local bank's ``forward_groups``, ``combine``,
``layer_out``; then ``output``), one token a step, ggml kernel for the dense path and the experts. It prints the
milliseconds per step in each call, and inside them the time in ggml's graph compute, keyed by
the function that called ``GgmlRunner.compute``. The difference between a call's time and its
compute time is Python, numpy and ctypes around the graphs. The file is read through first, so
the page cache holds it. It also counts the step's minor page faults and its threads' sleeps
(voluntary context switches: an OpenMP wait that slept, see bench_omp_barrier.py), and how much
of the model its mapping holds in 2 MiB pages (smaps ``FilePmdMapped``): that follows how the page
cache was filled (on this VM's Linux 6.18, a file read through, by ``cat`` or a mapping, sits in
2 MiB folios, one just written in 4 KiB pages) and moves a cold one-row mat-vec ~1.7x, so a run
that differs from another in it is not comparable. Why not py-spy (``profile_decode.py``):
this needs nothing installed and separates ggml compute from what surrounds it exactly.
"""
from __future__ import annotations

import argparse
import collections
import re
import resource
import sys
import time
from pathlib import Path

import numpy as np
from common import warm_page_cache

from p2pswarm.backbone.serving.runner import combine, expert_groups
from p2pswarm.engine.ggml import runner as ggml_runner
from p2pswarm.engine.arch import load_dense
from p2pswarm.engine.kernels import make_bank
from p2pswarm.model.layout import ModelLayout


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    warm_page_cache(a.model)  # a step that read an expert from disk would time the disk
    layout = ModelLayout.open(a.model)
    model = load_dense(layout, "ggml", threads=a.threads)
    bank = make_bank(layout, "ggml", threads=a.threads, graph_cache_bytes=256 << 20)
    spent: collections.Counter = collections.Counter()
    graphs = [0]
    real_compute = ggml_runner.GgmlRunner.compute

    def timed_compute(self, graph, macs):
        graphs[0] += 1
        t = time.perf_counter()
        try:
            return real_compute(self, graph, macs)
        finally:
            spent["  ggml compute in " + sys._getframe(1).f_code.co_name] += time.perf_counter() - t

    ggml_runner.GgmlRunner.compute = timed_compute

    def timed(name, fn, *args):
        t = time.perf_counter()
        try:
            return fn(*args)
        finally:
            spent[name] += time.perf_counter() - t

    def step(tokens, state):
        h = timed("embed", model.embed, np.asarray(tokens))
        pos0 = state.n_past
        for il in range(model.n_layer):
            lin = timed("layer_in", model.layer_in, il, h, [(state, pos0, h.shape[0])])
            groups = expert_groups(lin.ids)
            outs = timed("experts", bank.forward_groups, il, lin.cur, groups)
            moe = (timed("combine", combine, lin.ids, lin.weights, groups, dict(zip([e for e, _ in groups], outs)))
                   if groups else np.zeros_like(lin.cur))  # a leading dense layer (deepseek2, glm4moe): no routed experts
            h = timed("layer_out", model.layer_out, il, lin, moe)
        state.n_past += len(tokens)
        return timed("output", model.output, h)

    V = model.n_vocab
    state = model.new_state()
    step([(7919 * i + 11) % V for i in range(8)], state)
    for i in range(8):  # warm: pages of the experts these tokens pick, kept graphs
        step([(104729 * i + 5) % V], state)
    spent.clear()
    graphs[0] = 0
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    t = time.perf_counter()
    for i in range(a.steps):
        step([(7919 * i + 3) % V], state)
    per = (time.perf_counter() - t) / a.steps
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    faults, sleeps = ((getattr(ru1, k) - getattr(ru0, k)) / a.steps for k in ("ru_minflt", "ru_nvcsw"))
    print(f"{per * 1e3:.2f} ms a step, {graphs[0] / a.steps:.1f} ggml graphs a step, {faults:.0f} page faults and "
          f"{sleeps:.0f} thread sleeps (voluntary context switches) a step ({a.steps} steps); "
          f"{pmd_mapped_mb(a.model):.0f} MB of the model mapped by 2 MiB pages")
    for name, sec in sorted(spent.items(), key=lambda kv: -kv[1]):
        print(f"  {name:40s} {sec / a.steps * 1e3:7.3f} ms")
    return 0


def pmd_mapped_mb(path) -> float:
    """MB of this process's mappings of ``path`` mapped by 2 MiB page-table entries (smaps FilePmdMapped)."""
    name, inside, kb = str(Path(path).resolve()), False, 0
    with open("/proc/self/smaps") as f:
        for ln in f:
            if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", ln):
                inside = ln.rstrip().endswith(name)
            elif inside and ln.startswith("FilePmdMapped:"):
                kb += int(ln.split()[1])
    return kb / 1024


if __name__ == "__main__":
    sys.exit(main())
