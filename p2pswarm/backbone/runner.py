"""The backbone's layer loop: dense path here, routed experts wherever the dispatcher sends them.

    h = embed(tokens)
    for each layer:
        h   = pre_moe(h)                 attention + residual (KV cache)
        cur = ffn_input(h)               the rows the experts see
        ids, w = route(cur)              authoritative, once, here
        partials = await dispatcher.run(layer, cur, groups(ids))
        h   = post_moe(h, combine(ids, w, partials))
    logits = output(h)

``combine`` sums the weighted expert outputs in top-k order, never in arrival order: that is what
makes the split run bit-identical to the monolithic one whatever the timing. The numpy work runs in
a thread (``trio.to_thread``) so the event loop keeps streams flowing.

:meth:`Backbone.forward_batch` runs one step for many sequences (the continuous-batching step the
:mod:`p2pswarm.backbone.scheduler` drives): attention / DeltaNet per sequence on its own state, then
the expert work of *all* rows in one :meth:`Dispatcher.run_groups` per layer, so each owner gets one
request per layer whatever the number of sequences. With ``batch_invariant`` every batch-sensitive
mat-mul (router, experts, shared expert, lm head) sees one sequence's rows only, so a sequence's
logits are bit-identical to running it alone (docs/architecture.md, "Continuous batching").
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial

import numpy as np
import trio

from p2pswarm.backbone.dispatch import Dispatcher, Groups
from p2pswarm.contracts import DenseModel
from p2pswarm.engine.state import SequenceState

F32 = np.float32


def expert_groups(ids: np.ndarray) -> Groups:
    """(expert, token indices) for every expert chosen in a layer; experts ascending, tokens in order."""
    return [(int(e), np.nonzero((ids == e).any(axis=1))[0]) for e in np.unique(ids)]


def combine(ids: np.ndarray, weights: np.ndarray, groups: Groups, partials: dict[int, np.ndarray]) -> np.ndarray:
    """sum_j w[t, j] * out_{ids[t, j]}[t], summed ((y0 + y1) + y2) + ... in top-k order."""
    return combine_outputs(ids, weights, groups, [partials[e] for e, _ in groups])


def combine_outputs(ids: np.ndarray, weights: np.ndarray, groups: Groups, outs: list[np.ndarray]) -> np.ndarray:
    """:func:`combine` with one output per group, in group order: an expert may have several groups
    (one per sequence in a batch-invariant step), each covering its own rows."""
    T, k = ids.shape
    n_embd = outs[0].shape[1]
    y = np.empty((k, T, n_embd), dtype=F32)
    for (e, rows), out in zip(groups, outs):
        r, j = np.nonzero(ids[rows] == e)
        y[j, rows[r]] = out[r]
    y *= weights.T[:, :, None]
    acc = y[0].copy()
    for j in range(1, k):
        acc += y[j]
    return acc


@dataclass
class LayerTiming:
    """Wall time of batched layers, summed: the dense path (in threads) and the wait on the
    dispatcher (network + remote compute). The scheduler reads it to size its micro-batches."""

    dense_s: float = 0.0
    wait_s: float = 0.0
    layers: int = 0

    def snapshot(self) -> "LayerTiming":
        return LayerTiming(self.dense_s, self.wait_s, self.layers)


class Backbone:
    """Runs a model's dense path and drives a dispatcher; one instance serves many sequences."""

    def __init__(self, model: DenseModel, dispatcher: Dispatcher, *, batch_invariant: bool = True):
        self.model = model
        self.dispatcher = dispatcher
        self.batch_invariant = batch_invariant
        self.timing = LayerTiming()
        self._row_invariant: tuple[bool, bool] | None = None  # (experts, lm head), probed on first use

    @property
    def row_invariant_experts(self) -> bool:
        return self._probe_row_invariance()[0]

    @property
    def row_invariant_output(self) -> bool:
        return self._probe_row_invariance()[1]

    def _probe_row_invariance(self) -> tuple[bool, bool]:
        """Whether the expert and lm-head mat-muls give a row the same bits whatever rows share the
        call, *measured* here on this CPU and these tensor types (row counts 1-9, 15-17, 31-33, 63-65
        against one 70-row call): OpenBLAS never does (its kernels depend on the row count), libggml
        does for Q8_0 but switches kernels at 8 rows for K-quants. Where it holds, the
        batch-invariant mode batches those mat-muls across sequences; where not, it runs them per
        sequence (the ``--no-batch-invariant`` mode never does)."""
        if self._row_invariant is None:
            bank, m = self.dispatcher.local.bank, self.model
            x = np.random.default_rng(0).standard_normal((70, m.n_embd)).astype(F32)
            sizes = [*range(1, 10), 15, 16, 17, 31, 32, 33, 63, 64, 65]

            def invariant(fn) -> bool:
                full = fn(x)
                return all(np.array_equal(fn(x[3 : 3 + n]), full[3 : 3 + n]) for n in sizes)

            experts = getattr(bank, "kernel", "numpy") != "numpy"
            if experts:
                layout = getattr(bank, "layout", None)
                seen = set()
                for il in range(m.n_layer):  # one probe per distinct set of expert tensor types
                    kinds = getattr(layout, "expert_tensors", {}).get(il, {})
                    key = tuple(sorted((k, getattr(t, "ggml_type", None)) for k, t in kinds.items()))
                    if key in seen or not bank.holds(il, 0):
                        continue
                    seen.add(key)
                    if not invariant(partial(bank.forward, il, 0)):
                        experts = False
                        break
            w_out = m.w[m.output_name]
            output = not isinstance(w_out, np.ndarray) and invariant(lambda rows: rows @ w_out.T)
            self._row_invariant = (experts, output)
        return self._row_invariant

    def new_state(self) -> SequenceState:
        return self.model.new_state()

    async def forward(self, tokens, state: SequenceState) -> np.ndarray:
        """Feed tokens (all at once) after what ``state`` has seen; logits (T, n_vocab) for each."""
        m = self.model
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        pos0 = state.n_past
        h = await trio.to_thread.run_sync(m.embed, tokens)
        for il in range(m.n_layer):
            h, cur, ids, w = await trio.to_thread.run_sync(partial(self._pre, il, h, state, pos0))
            groups = expert_groups(ids)
            partials = await self.dispatcher.run(il, cur, groups)
            h = await trio.to_thread.run_sync(partial(self._post, il, h, cur, ids, w, groups, partials))
        state.n_past += len(tokens)
        return await trio.to_thread.run_sync(m.output, h)

    def _pre(self, il, h, state, pos0):
        m = self.model
        h = m.pre_moe(il, h, state, pos0)
        cur = m.ffn_input(il, h)
        ids, w = m.route(il, cur)
        return h, cur, ids, w

    def _post(self, il, h, cur, ids, w, groups, partials):
        return self.model.post_moe(il, h, cur, combine(ids, w, groups, partials))

    async def forward_batch(self, items: list[tuple[object, SequenceState]], *, last_only: bool = False,
                            batch_invariant: bool | None = None) -> list[np.ndarray]:
        """One step for many sequences: ``items`` = [(tokens, state), ...], each a prefill chunk or one
        decode token fed after what its state has seen (every state at most once). Returns each
        item's logits, (T_i, n_vocab), or only its last row (1, n_vocab) with ``last_only``.

        Per layer: pre_moe per sequence (its own KV / DeltaNet state and positions), the router and
        the grouping over all rows, **one** dispatcher call (one request per owner with every row it
        must compute, for all sequences), combine in top-k order, post_moe, rows split back."""
        invariant = self.batch_invariant if batch_invariant is None else batch_invariant
        m = self.model
        toks = [np.asarray(t, dtype=np.int64).reshape(-1) for t, _ in items]
        states = [st for _, st in items]
        if len({id(st) for st in states}) != len(states):
            raise ValueError("a sequence appears twice in one step")
        if any(len(t) == 0 for t in toks):
            raise ValueError("an empty chunk in a step")
        pos0 = [st.n_past for st in states]
        bounds = np.cumsum([0] + [len(t) for t in toks])
        spans = [slice(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]
        timing = self.timing
        L = m.n_layer

        def first():
            return self._pre_batch(0, m.embed(np.concatenate(toks)), spans, states, pos0, invariant)

        def after(il, h, cur, ids, w, groups, outs):
            """post_moe of layer il and pre_moe of the next in ONE thread hop (each hop is a
            wake-up; on a busy host those cost more than the arithmetic), or the lm head."""
            h = self._post_batch(il, h, cur, ids, w, groups, outs, spans, invariant)
            if il + 1 < L:
                return self._pre_batch(il + 1, h, spans, states, pos0, invariant)
            return self._output_batch(h, spans, last_only, invariant)

        t0 = time.perf_counter()
        res = await trio.to_thread.run_sync(first)
        timing.dense_s += time.perf_counter() - t0
        for il in range(L):
            h, cur, ids, w, groups = res
            t1 = time.perf_counter()
            outs = await self.dispatcher.run_groups(il, cur, groups)
            t2 = time.perf_counter()
            res = await trio.to_thread.run_sync(partial(after, il, h, cur, ids, w, groups, outs))
            timing.dense_s += time.perf_counter() - t2
            timing.wait_s += t2 - t1
            timing.layers += 1
        for st, t in zip(states, toks):
            st.n_past += len(t)
        return res

    def _pre_batch(self, il, h, spans, states, pos0, invariant):
        m = self.model
        h = np.concatenate([m.pre_moe(il, h[sp], st, p) for sp, st, p in zip(spans, states, pos0)])
        if not invariant:
            cur = m.ffn_input(il, h)
            ids, w = m.route(il, cur)
            return h, cur, ids, w, expert_groups(ids)
        parts = [m.ffn_input(il, h[sp]) for sp in spans]
        routed = [m.route(il, c) for c in parts]  # the router is an F32 numpy mat-mul: per sequence
        ids = np.concatenate([r[0] for r in routed])
        if self.row_invariant_experts:
            groups = expert_groups(ids)  # one group per expert, all sequences: same bits per row
        else:
            groups = []
            for sp, (ids_s, _) in zip(spans, routed):  # one group per (sequence, expert)
                groups += [(e, idx + sp.start) for e, idx in expert_groups(ids_s)]
        return h, np.concatenate(parts), ids, np.concatenate([r[1] for r in routed]), groups

    def _post_batch(self, il, h, cur, ids, w, groups, outs, spans, invariant):
        moe = combine_outputs(ids, w, groups, outs) if groups else np.zeros_like(cur)
        if not invariant:
            return self.model.post_moe(il, h, cur, moe)
        return np.concatenate([self.model.post_moe(il, h[sp], cur[sp], moe[sp]) for sp in spans])

    def _output_batch(self, h, spans, last_only, invariant):
        m = self.model
        if last_only:
            spans = [slice(sp.stop - 1, sp.stop) for sp in spans]
        if invariant and not self.row_invariant_output:
            return [m.output(h[sp]) for sp in spans]
        rows = np.concatenate([np.arange(sp.start, sp.stop) for sp in spans])
        logits = m.output(h[rows])
        at = np.cumsum([0] + [sp.stop - sp.start for sp in spans])
        return [logits[a:b] for a, b in zip(at[:-1], at[1:])]

    async def logits(self, tokens, *, decode: bool = False, on_step=None) -> np.ndarray:
        """All-position logits of a fresh sequence: one prefill, or token by token (``decode``).
        ``on_step(done, total)`` is called after each decode step (progress, long runs)."""
        state = self.new_state()
        if not decode:
            return await self.forward(tokens, state)
        rows = []
        for i, t in enumerate(tokens):
            rows.append(await self.forward([t], state))
            if on_step is not None:
                on_step(i + 1, len(tokens))
        return np.concatenate(rows, axis=0)
