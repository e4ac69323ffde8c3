"""Where a speculative step's CPU goes: a one-token decode step against a verification step of
k+1 positions, and the MTP block's draft, stage by stage, in CPU seconds of the calling thread.

    python bench/verify_stages.py M.gguf [--reps 6] [--rows 2,5]

M.gguf: a qwen35moe file with an MTP block (``make-model --arch qwen35moe --preset geometry-122b
--layers 4 --mtp-agreement A``). One ggml thread (``threads=1``), so every graph computes in the
calling thread and ``time.thread_time`` around a call is exactly that call's CPU, whatever else
runs on the machine (the shared box's load moves wall time, not this). The calls are those the
backbone makes (``layer_in`` with the positions as one-row segments of one state: the verification
chunk; the local bank's ``forward_groups``: the experts a worker computes in the swarm;
``combine``; ``layer_out``; ``output``: the final norm and the lm head), synchronously.

Printed: per stage the CPU ms of a step of 1 row (decode) and of R rows (verification), and
their ratio; the lm head alone at 1-5 rows; the MTP block's ``forward`` split into its fusion,
its layer (attention, router, shared expert, routed experts) and its head, for a catch-up of
n rows and for a chained draft of one, with :meth:`~p2pswarm.backbone.serving.mtp.MtpBlock.draft`'s
total. Why not py-spy: it attributes wall samples, which a loaded machine skews; this needs
nothing installed.
"""
from __future__ import annotations

import argparse
import inspect
import collections
import statistics
import sys
import time

import numpy as np
from common import warm_page_cache

from p2pswarm.backbone.serving.combine import combine_outputs, expert_groups
from p2pswarm.backbone.serving.mtp import HiddenRows, MtpBlock, MtpState
from p2pswarm.engine.arch import load_dense
from p2pswarm.engine.kernels import make_bank
from p2pswarm.model.layout import ModelLayout


class Timer:
    """CPU ms of the calling thread per stage name, summed over calls; ``take()`` the totals."""

    def __init__(self):
        self.spent: collections.Counter = collections.Counter()

    def __call__(self, name, fn, *args, **kw):
        t = time.thread_time()
        try:
            return fn(*args, **kw)
        finally:
            self.spent[name] += (time.thread_time() - t) * 1e3

    def take(self) -> dict:
        got, self.spent = dict(self.spent), collections.Counter()
        return got


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--rows", default="2,5", help="verification widths R = k+1 to measure")
    ap.add_argument("--ab-split", action="store_true",
                    help="only the verification widths, with the Q8_0 lone-tail split (dense.SPLIT_LONE_TAIL) "
                         "off and on alternately, rep by rep, in this one process")
    a = ap.parse_args(argv)
    warm_page_cache(a.model)
    layout = ModelLayout.open(a.model)
    model = load_dense(layout, "ggml", threads=1)
    bank = make_bank(layout, "ggml", threads=1, graph_cache_bytes=256 << 20)
    T = Timer()
    V, L = model.n_vocab, model.n_layer
    kinds = ["deltanet" if model.recurrent_layer(il) else "attention" for il in range(L)]

    def step(tokens, state, verify: bool):
        """One step's trunk: R rows as R one-row segments (verify) or one segment; the hidden rows."""
        h = T("embed", model.embed, np.asarray(tokens))
        p0, R = state.n_past, len(tokens)
        segs = [(state, p0 + j, 1) for j in range(R)] if verify else [(state, p0, R)]
        for il in range(L):
            lin = T(f"layer_in {kinds[il]}", model.layer_in, il, h, segs)
            groups = expert_groups(lin.ids)
            outs = T("experts (the workers' CPU)", bank.forward_groups, il, lin.cur, groups)
            moe = T("combine", combine_outputs, lin.ids, lin.weights, groups, outs)
            h = T("layer_out", model.layer_out, il, lin, moe)
        state.n_past += R
        T("lm head (output_norm + output)", model.output, h)
        return h

    state = model.new_state()
    step([(7919 * i + 11) % V for i in range(8)], state, False)
    for i in range(6):  # warm: kept graphs, expert pages
        step([(104729 * i + 5) % V], state, False)
        step([(104729 * i + 7) % V for _ in range(5)], state, True)
    T.take()
    if a.ab_split:
        return ab_split(a, model, step, state, T)
    # (R, verify): R decode positions verified as one chunk (stepped), or R rows as a prefill chunk
    widths = [(1, False)] + [(int(r), True) for r in a.rows.split(",")] + [(int(a.rows.split(",")[-1]), False)]
    per: dict[tuple, dict] = {}
    for R, verify in widths:
        got: collections.defaultdict = collections.defaultdict(list)
        for i in range(a.reps):
            step([(7919 * i + 3 + j) % V for j in range(R)], state, verify)
            for k, v in T.take().items():
                got[k].append(v)
        per[(R, verify)] = {k: statistics.median(v) for k, v in got.items()}
    names = list(per[(1, False)])
    print(f"trunk: {L} layers ({', '.join(kinds)}), n_embd {model.n_embd}, vocab {V}, head "
          f"{model.output_name} {head_type(a.model, model.output_name)}; "
          f"CPU ms per step (one ggml thread, median of {a.reps})")
    cols = [f"{R} row{'s' if R > 1 else ''}" + (" verified" if v else " prefill chunk" if R > 1 else "")
            for R, v in widths]
    print("| stage | " + " | ".join(cols) + " | " + " | ".join(f"{c} / 1 row" for c in cols[1:]) + " |")
    print("| --- " * (2 * len(widths)) + "|")
    for n in names + ["total"]:
        v = [sum(per[w].values()) if n == "total" else per[w].get(n, 0.0) for w in widths]
        print(f"| {n} | " + " | ".join(f"{x:.1f}" for x in v) + " | " +
              " | ".join(f"{x / v[0]:.2f}x" if v[0] else "-" for x in v[1:]) + " |")

    # the lm head alone by rows
    hrows = np.random.default_rng(0).standard_normal((5, model.n_embd)).astype(np.float32)
    for r in range(1, 6):
        for _ in range(2):
            model.output(hrows[:r])
        T.take()
        for _ in range(a.reps):
            T("head", model.output, hrows[:r])
        print(f"lm head alone, {r} row(s): {T.take()['head'] / a.reps:.1f} ms CPU")

    # the MTP block: a catch-up of n rows, all rows' logits or the last row's only (what draft runs)
    block = MtpBlock(model, bank)
    last_ok = "last_only" in inspect.signature(block.forward).parameters
    for n in (1, 2, 5):
        for last_only in ((False, True) if last_ok else (False,)):
            got = []
            for i in range(a.reps + 1):
                hid = block.trunk_hidden(hrows[:n])
                t = time.thread_time()
                block.forward(MtpState(model), [(31 * i + j) % V for j in range(n)], hid,
                              **({"last_only": True} if last_only else {}))
                got.append((time.thread_time() - t) * 1e3)
            print(f"MtpBlock.forward of {n} row(s){', last row only' if last_only else ''}: "
                  f"{statistics.median(got[1:]):.1f} ms CPU")
    real_layer = model.mtp_layer
    # MtpBlock.draft as the scheduler calls it, after a step that accepted c drafts (c+1 to catch up)
    for c, k in ((0, 1), (0, 4), (4, 4)):
        res = collections.defaultdict(list)
        for i in range(a.reps):
            s = model.new_state()
            s.n_past = 16 + c + 1
            s.hidden = HiddenRows()
            s.hidden.put(0, np.repeat(hrows[:1], s.n_past, axis=0))
            s.mtp = MtpState(model)
            s.mtp.fed = 16  # the block saw positions < 16
            hist = [(13 * j + i) % V for j in range(s.n_past + 1)]
            model.mtp_layer = lambda *x, **y: T(" mtp layer", real_layer, *x, **y)
            try:
                T("draft", block.draft, s, hist, k)
            finally:
                model.mtp_layer = real_layer
            for kk, v in T.take().items():
                res[kk].append(v)
        med = {kk: statistics.median(v) for kk, v in res.items()}
        print(f"MtpBlock.draft, catch-up {c + 1} row(s), K={k}: " + ", ".join(f"{kk.strip()} {v:.1f}" for kk, v in med.items())
              + " ms CPU")
    return 0


def ab_split(a, model, step, state, T) -> int:
    """``--ab-split``: each verification width of ``--rows`` (and the lm head alone at those rows),
    with :data:`p2pswarm.engine.ggml.dense.SPLIT_LONE_TAIL` off and on in turn, rep by rep, so the
    shared machine's load falls on both alike; CPU ms per step by stage, median of ``--reps``."""
    from p2pswarm.engine.ggml import dense

    V = model.n_vocab
    hrows = np.random.default_rng(0).standard_normal((8, model.n_embd)).astype(np.float32)
    print(f"CPU ms per step (one ggml thread, median of {a.reps}), Q8_0 lone-tail split off / on, alternating")
    print("| rows | stage | split off | split on | on / off |")
    print("| --- | --- | --- | --- | --- |")
    for R in (int(r) for r in a.rows.split(",")):
        got: dict = {False: collections.defaultdict(list), True: collections.defaultdict(list)}
        for i in range(a.reps + 1):
            for on in ((False, True) if i % 2 else (True, False)):  # each goes first in every other round
                dense.SPLIT_LONE_TAIL = on
                # tokens of their own: the same rows twice would find the second run's experts warm
                step([(7919 * i + 3 + j + 101 * on) % V for j in range(R)], state, True)
                T("lm head alone", model.output, hrows[:R])
                for k, v in T.take().items():
                    if i:  # the first round builds each graph once
                        got[on][k].append(v)
        dense.SPLIT_LONE_TAIL = True
        names = list(got[False])
        for n in names + ["total (without the head alone)"]:
            off, on_ = ((sum(statistics.median(v) for k, v in got[f].items() if k != "lm head alone")
                         if n.startswith("total") else statistics.median(got[f][n])) for f in (False, True))
            print(f"| {R} verified | {n} | {off:.1f} | {on_:.1f} | {on_ / off:.3f}x |")
    return 0


def head_type(path, name: str) -> str:
    """The GGML type of tensor ``name`` in ``path`` (the lm head's: F32, F16, Q8_0, Q6_K ...)."""
    from gguf import GGUFReader

    return next(t.tensor_type.name for t in GGUFReader(path).tensors if t.name == name)


if __name__ == "__main__":
    sys.exit(main())
