"""The backbone's layer loop: dense path here, routed experts wherever the dispatcher sends them.

    h = embed(tokens)
    for each layer:
        lin = layer_in(h)                attention + residual (KV cache), the rows the experts
                                         see (lin.cur), the router's choice (lin.ids, lin.weights):
                                         authoritative, once, here
        partials = await dispatcher.run_groups(layer, lin.cur, groups(lin.ids))
        h   = layer_out(lin, combine(lin.ids, lin.weights, partials))
    logits = output(h)

``combine`` sums the weighted expert outputs in top-k order, never in arrival order: that is what
makes the split run bit-identical to the monolithic one whatever the timing. The dense work between
two dispatches runs in a thread (``trio.to_thread``) so the event loop keeps streams flowing, unless
it is measured to take less than ``$P2PSWARM_INLINE_MS`` (a decode step of a few sequences): then it
runs inline, because the hop costs more than the work (:mod:`p2pswarm.offload`).

:meth:`Backbone.forward_batch` runs one step for many sequences (the continuous-batching step the
:mod:`p2pswarm.backbone.serving.scheduler` drives): the dense path of all rows together (norms and
projections as one set of mat-muls, ``model.layer_in``; only the attention / DeltaNet
recurrence per sequence on its own state), then the expert work of *all* rows in one
:meth:`Dispatcher.run_groups` per layer, so each owner gets one request per layer whatever the
number of sequences. With ``batch_invariant`` a piece of the step is batched across sequences only
where a probe measured it row-invariant on this CPU and these tensor types (it gives a row the same
bits whatever rows share the call); every other batch-sensitive piece sees one sequence's rows
only, so a sequence's logits are bit-identical to running it alone (docs/architecture.md,
"Continuous batching").
"""
from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import numpy as np
import trio

from p2pswarm.backbone.serving.combine import combine, combine_outputs, combine_rows, expert_groups  # noqa: F401 - combine: re-exported
from p2pswarm.backbone.serving import grouping
from p2pswarm.backbone.serving.grouping import one_row_spans as _rows, renumbered as _renumbered
from p2pswarm.backbone.dispatch.dispatcher import Dispatcher, Groups
from p2pswarm.backbone.serving.mtp import HiddenRows
from p2pswarm.backbone.serving.replay import ReplayStats
from p2pswarm.backbone.serving.replay import fold_taint as _fold_taint
from p2pswarm.backbone.owners.row_probe import PROBE_ROWS, invariant, probe_rows  # noqa: F401 - PROBE_ROWS: re-exported
from p2pswarm.contracts import DenseModel, LayerIn
from p2pswarm.engine.experts.ggml_bank import ExpertsInFront, GgmlExpertBank
from p2pswarm.engine.state import SequenceState

F32 = np.float32
log = logging.getLogger("p2pswarm.backbone")


@dataclass
class LayerTiming:
    """Wall time of batched layers, summed: the dense path (in threads) and the wait on the
    dispatcher (network + remote compute). The scheduler reads it to size its micro-batches.

    ``busy_s`` is the wall time during which *some* dense piece was running: the union of the
    pieces' intervals, where ``dense_s`` sums them. They differ when micro-batches' dense pieces
    overlap: each then waits for a core or the GIL while another computes, and the sum counts that
    waiting once per micro-batch: a decode step's dense sum with 3 micro-batches was about three
    times its sum with 1, for the same work, and fed to the micro-batch rule the inflated sum kept
    choosing 3 (docs/benchmarks.md)."""

    dense_s: float = 0.0
    wait_s: float = 0.0
    layers: int = 0
    busy_s: float = 0.0

    def snapshot(self) -> "LayerTiming":
        return LayerTiming(self.dense_s, self.wait_s, self.layers, self.busy_s)


@dataclass(frozen=True)
class DenseInvariance:
    """Which of one layer's two calls give a row the same bits whatever other sequences' rows
    share the call: ``layer_in`` (norms, projections, gates, output projection, the experts' input
    and the router; the attention / recurrence is per sequence anyway; a shared expert its graph
    computes) and ``layer_out`` (shared expert, residual). The batch-invariant mode batches only
    those; the other runs per sequence."""

    layer_in: bool
    layer_out: bool


ALL_BATCHED = DenseInvariance(True, True)

# Probe layouts: segment sizes (sequences' row counts) of batched calls of 70, 16 and 64 rows. They
# share their first segments, so each segment's alone result is computed once; together they put
# rows alone in calls of 1, 2, 5, 8, 17, 26, 33, 36 rows and batched in calls of 16, 64 and 70 (ggml
# switches K-quant kernels at 8 rows; OpenBLAS at its block edges). At most 5 sequences per call:
# each carries a fresh state (4 MiB per DeltaNet layer at the 122B's geometry) while it runs.
_PROBE_LAYOUTS = ([1, 2, 8, 26, 33], [1, 2, 8, 5], [1, 2, 8, 17, 36])


def _layer_signature(model, il: int) -> tuple:
    """What decides a layer's dense kernels: its kind, whether it routes to experts at all (a
    leading dense layer's route returns none: trivially invariant, which said nothing about the
    router of the layers after it when their dense tensors had the same types) and the types of
    its dense tensors."""
    kind = (model.recurrent_layer(il), il in model.layout.expert_tensors)
    prefix = f"blk.{il}."
    types = []
    for t in model.layout.reader.tensors:
        if t.name.startswith(prefix) and "_exps." not in t.name:
            types.append((t.name[len(prefix):], int(t.tensor_type)))
    return (kind, tuple(sorted(types)))


def probe_dense_invariance(model, il: int) -> DenseInvariance:
    """Measure whether layer ``il``'s ``layer_in`` (every array it returns) and ``layer_out`` are
    row-invariant: each sequence of every :data:`_PROBE_LAYOUTS` batch, run alone on a fresh
    state, must give the bits it gets inside the batch (also on a fresh state).

    Why measured, not assumed: libggml's Q8_0 mat-mul (llamafile's tinyBLAS) is row-invariant, its
    K-quant path is not (another kernel from 8 rows), OpenBLAS's F32 GEMM is not (block edges), and
    which of those a layer uses depends on the file and the build. The state-carrying part (KV
    append, attention, DeltaNet conv + delta rule) runs per sequence in both, so fresh states
    suffice. Costs 8 alone and 3 batched calls per call and distinct layer signature, once."""
    rng = np.random.default_rng(il + 1)
    E = model.n_embd
    n = max(sum(lay) for lay in _PROBE_LAYOUTS)
    x = rng.standard_normal((n, E)).astype(F32)
    y = rng.standard_normal((n, E)).astype(F32)

    def segments(layout):
        at = np.cumsum([0] + list(layout))
        return [(int(a), int(b)) for a, b in zip(at[:-1], at[1:])]

    def same(batched, alone) -> bool:
        return len(batched) == len(alone) and all(np.array_equal(p, q) for p, q in zip(batched, alone))

    def check(fn_batched, fn_alone) -> bool:
        memo: dict[tuple[int, int], list] = {}
        for layout in _PROBE_LAYOUTS:
            segs = segments(layout)
            got = fn_batched(segs)
            for a, b in segs:
                if (a, b) not in memo:
                    memo[(a, b)] = fn_alone(a, b)
                if not same([g[a:b] for g in got], memo[(a, b)]):
                    return False
        return True

    def layer_in(segs) -> list[np.ndarray]:
        lin = model.layer_in(il, x[segs[0][0]:segs[-1][1]], [(model.new_state(), 0, b - a) for a, b in segs])
        return [lin.h, lin.cur, lin.ids, lin.weights, *(lin.extras[k] for k in sorted(lin.extras))]

    first = check(layer_in, lambda a, b: layer_in([(a, b)]))
    # layer_out on rows with no extras: it computes what it adds (a shared expert) itself, as it
    # does for a layer_in that did not
    got = model.layer_in(il, y, [(model.new_state(), 0, n)])
    lin = LayerIn(x, got.cur, got.ids, got.weights)
    moe = (0.1 * rng.standard_normal((n, E))).astype(F32)
    out = check(lambda segs: [model.layer_out(il, lin.rows(slice(0, segs[-1][1])), moe[: segs[-1][1]])],
                lambda a, b: [model.layer_out(il, lin.rows(slice(a, b)), moe[a:b])])
    return DenseInvariance(first, out)


class Backbone:
    """Runs a model's dense path and drives a dispatcher; one instance serves many sequences."""

    def __init__(self, model: DenseModel, dispatcher: Dispatcher, *, batch_invariant: bool = True):
        self.model = model
        self.dispatcher = dispatcher
        self.batch_invariant = batch_invariant
        self.timing = LayerTiming()
        #: inline-or-thread policy for the dense pieces between dispatches, shared with the
        #: dispatcher's local replica where it has one (p2pswarm.offload)
        self.offload = dispatcher.offload
        self.replays = ReplayStats()  # replay on ban: by the scheduler (generate.sequence_logits too)
        #: record which positions used a remote worker's unverified outputs (SequenceState.taint), so
        #: a ban can replay them; off, a ban fixes nothing already computed (benchmarks, tests)
        self.replay_on_ban = True
        self.keep_hidden = False  # keep each sequence's last hidden states (SequenceState.hidden): --speculate mtp
        #: layers of verification steps computed as one chunk per layer, or in rounds of one
        #: position each (forward_batch's ``verify``; tests and benchmarks read which ran)
        self.verify_calls = {"chunk": 0, "rounds": 0}
        #: layer boundaries computed as one graph, the experts in front of the next layer (_through)
        self.fused_layers = 0
        #: decode steps computed as ONE graph, every layer and the head (_one_graph)
        self.one_graph_steps = 0
        self._row_invariant: tuple[bool, bool, int] | None = None  # (experts, lm head, small rows), probed once
        self._dense_invariant: dict[tuple, DenseInvariance] = {}  # per layer signature, probed on first use
        self._dense_running = 0  # dense pieces in progress, all micro-batches (LayerTiming.busy_s)
        self._dense_since = 0.0

    @contextmanager
    def _dense_piece(self):
        """Around one dense piece of a step (on the event loop): the pieces' wall time, summed into
        ``timing.dense_s``, and the time any piece ran, into ``timing.busy_s``."""
        t0 = time.perf_counter()
        if self._dense_running == 0:
            self._dense_since = t0
        self._dense_running += 1
        try:
            yield
        finally:
            self._dense_running -= 1
            t1 = time.perf_counter()
            self.timing.dense_s += t1 - t0
            if self._dense_running == 0:
                self.timing.busy_s += t1 - self._dense_since

    @property
    def row_invariant_experts(self) -> bool:
        return self._probe_row_invariance()[0]

    @property
    def row_invariant_output(self) -> bool:
        return self._probe_row_invariance()[1]

    @property
    def small_call_rows(self) -> int:
        """Where the experts are not row-invariant: the most rows of one expert a call may hold and
        still give every row the bits it gets in a call of any fewer rows (libggml's K-quants: 7,
        below the 8 rows at which it switches to its tiled GEMM; OpenBLAS: 1). The batch-invariant
        mode merges different sequences' groups of one expert into one group up to this size."""
        return self._probe_row_invariance()[2]

    def _probe_row_invariance(self) -> tuple[bool, bool, int]:
        """Whether the expert and lm-head mat-muls give a row the same bits whatever rows share the
        call, *measured* here on this CPU and these tensor types (row counts 1-9, 15-17, 31-33, 63-65,
        127-129, 255-257, 511-512 against one PROBE_ROWS-row call): OpenBLAS never does (its kernels
        depend on the row count), libggml does for Q8_0 but switches kernels at 8 rows for K-quants.
        Where it holds, the batch-invariant mode batches those mat-muls across sequences; where not, it runs them per
        sequence (the ``--no-batch-invariant`` mode never does)."""
        if self._row_invariant is None:
            m = self.model
            experts = self.dispatcher.local.row_invariance(m.n_layer, m.n_embd)
            w_out = m.w[m.output_name]
            dense = m.backend.ggml
            if not isinstance(w_out, np.ndarray) and dense is not None:
                w_out = dense.leading_rows(m.output_name, 1024)  # the head's type and kernels, 1% of its rows
            output = not isinstance(w_out, np.ndarray) and invariant(lambda rows: rows @ w_out.T,
                                                                     probe_rows(m.n_embd))
            # (the verifier's exact_rows follows the replica's own measurement: LocalOwner.exact_rows)
            self._row_invariant = (experts.invariant, output, experts.small)
        return self._row_invariant

    def dense_invariance(self, il: int) -> "DenseInvariance":
        """Which pieces of layer ``il``'s dense path are row-invariant (see :class:`DenseInvariance`),
        measured once per distinct layer signature (layer kind + dense tensor types)."""
        m = self.model
        key = _layer_signature(m, il)
        got = self._dense_invariant.get(key)
        if got is None:
            got = probe_dense_invariance(m, il)
            self._dense_invariant[key] = got
        return got

    def new_state(self) -> SequenceState:
        return self.model.new_state()

    async def forward(self, tokens, state: SequenceState) -> np.ndarray:
        """Feed tokens (all at once) after what ``state`` has seen; logits (T, n_vocab) for each.

        One sequence's :meth:`forward_batch`: the same bits, and one thread hop per layer (the
        layer_out of a layer and the layer_in of the next run in one hop) instead of three."""
        return (await self.forward_batch([(tokens, state)]))[0]

    async def forward_batch(self, items: list[tuple[object, SequenceState]], *, last_only: bool = False,
                            batch_invariant: bool | None = None,
                            verify: list[bool] | None = None) -> list[np.ndarray]:
        """One step for many sequences: ``items`` = [(tokens, state), ...], each a prefill chunk or one
        decode token fed after what its state has seen (every state at most once). Returns each
        item's logits, (T_i, n_vocab), or only its last row (1, n_vocab) with ``last_only``.

        Per layer: ``layer_in`` over all rows (one set of dense mat-muls; KV / DeltaNet state
        and positions per sequence; the router), the grouping over all rows, **one** dispatcher
        call (one request per owner with every row it must compute, for all sequences), combine in
        top-k order, ``layer_out``, rows split back. In the batch-invariant mode each of the two
        calls is batched only where :meth:`dense_invariance` measured it row-invariant, else run
        per sequence.

        ``verify[i]``: item i's tokens are *decode* positions of one sequence (a speculative
        decoding step: the sampled token and its drafts), each computed exactly as a one-token
        decode step computes it: where the model takes a verification chunk
        (``model.chunk_verify(il)``: qwen35moe's ggml layer graphs) and the probe found the layer's
        dense path row-invariant, in ONE ``layer_in`` call per layer, the positions passed as
        one-row segments of the sequence's state (the model steps the attention / DeltaNet part
        per position inside that call, so the dense weights are streamed once, not once per
        position); otherwise in rounds, one row of each such sequence per call
        (:meth:`_pre_rounds`). Which ran is counted in ``verify_calls``. Every other dense piece
        runs per position where a probe did not find it row-invariant (the batch-invariant rules,
        with each position as a sequence of its own), and all positions' logits are returned. Each layer's
        state is checkpointed after each position, so :meth:`keep_positions` can drop the rejected
        ones with no trace. Their experts still go in the step's one request per owner per layer."""
        invariant = self.batch_invariant if batch_invariant is None else batch_invariant
        verify = list(verify) if verify is not None else [False] * len(items)
        if len(items) == 1:
            invariant = False  # one sequence: batched is alone, nothing to probe or split
        if any(verify):
            invariant = True  # each verified position must get the bits it gets alone
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
        # the spans the per-sequence pieces see: a verified sequence's positions one by one
        pspans = [s for sp, v in zip(spans, verify) for s in (_rows(sp) if v else [sp])]
        ospans = [_rows(sp) if v else [slice(sp.stop - 1, sp.stop) if last_only else sp]
                  for sp, v in zip(spans, verify)]
        for st, v in zip(states, verify):
            st.checkpoints, st.verified = {}, 0
        timing = self.timing
        L = m.n_layer
        # The rows that reach an output. In the last layer only they go on past the attention (which
        # still runs on every row: the caches need them), as llama.cpp's inp_out_ids does: a prefill
        # with last_only computes the experts of its last row's groups and its layer_out, not every
        # row's (a 128-row prefill of a 256-expert layer otherwise reads almost every expert).
        out_rows = np.concatenate([np.arange(sp.start, sp.stop) for item in ospans for sp in item])
        last = out_rows if len(out_rows) < bounds[-1] and not self.keep_hidden else None

        def first():
            if self._row_invariant is None and bounds[-1] > 1 and self.dispatcher.verifier:
                self._probe_row_invariance()  # once: which groups the verifier may check row by row
            return self._pre_batch(0, m.embed(np.concatenate(toks)), spans, states, pos0, invariant, verify, pspans,
                                   only=last if L == 1 else None)

        def after(il, lin, groups, outs):
            """layer_out of layer il and layer_in of the next in ONE thread hop (each hop is a
            wake-up; on a busy host those cost more than the arithmetic), or the lm head."""
            if il + 1 < L:
                h = self._post_batch(il, lin, groups, outs, pspans, invariant)
                return self._pre_batch(il + 1, h, spans, states, pos0, invariant, verify, pspans,
                                       only=last if il + 2 == L else None)
            if last is not None:  # h of the out rows only, and each item's spans renumbered to them
                return self._output_batch(self._post_rows(il, lin, groups, outs, pspans, invariant, last),
                                          _renumbered(ospans), invariant)
            h = self._post_batch(il, lin, groups, outs, pspans, invariant)
            if self.keep_hidden:  # the MTP drafter reads the trunk's last hidden states (backbone.mtp)
                for st, sp, p0 in zip(states, spans, pos0):
                    st.hidden = st.hidden or HiddenRows()
                    st.hidden.put(p0, h[sp])
            return self._output_batch(h, ospans, invariant)

        disp = self.dispatcher
        if disp.all_local:  # monolithic: the whole step in one thread hop
            # one sequence (nothing split per sequence): a layer's experts may run in front of the next
            # layer's graph, one graph where the bank's and the layer's ran with numpy between them
            fuse = len(items) == 1 and not any(verify) and isinstance(disp.local.bank, GgmlExpertBank)
            # one decode token whose logits go nowhere else: the whole step may be one graph (_one_graph)
            one = fuse and len(toks[0]) == 1 and last is None and not self.keep_hidden

            def whole():
                got = self._one_graph(int(toks[0][0]), states[0]) if one else None
                if got is not None:
                    return got
                res = first()
                for il in range(L):
                    lin, groups = res
                    nxt = None
                    if fuse and il + 1 < L:
                        nxt = self._through(il, lin, groups, states[0], pos0[0], spans, last if il + 2 == L else None)
                    elif fuse and last is None and not self.keep_hidden:  # every row's logits: h goes nowhere else
                        nxt = self._through_output(il, lin, groups)
                    res = nxt or after(il, lin, groups, disp.run_groups_local(il, lin.cur, groups))
                return res

            with self._dense_piece():
                res = await trio.to_thread.run_sync(whole)
            timing.layers += L
        else:
            # each piece inline on the event loop when measured shorter than the offload bound
            # (a few rows: the hop costs more than the work), else in a thread (p2pswarm.offload)
            off = self.offload
            n_rows = int(bounds[-1])
            with self._dense_piece():
                res = await off.run(first, n_rows, ("first", invariant))
            # peer -> rows computed from its unverified outputs
            taint: dict[str, np.ndarray] | None = {} if self.replay_on_ban else None
            for il in range(L):
                lin, groups = res
                t1 = time.perf_counter()
                outs = await disp.run_groups(il, lin.cur, groups, taint)
                timing.wait_s += time.perf_counter() - t1
                with self._dense_piece():
                    res = await off.run(partial(after, il, lin, groups, outs), n_rows,
                                        ("after", il, invariant, last_only))
                timing.layers += 1
            if taint:
                _fold_taint(taint, bounds, states, pos0)
        for st, t, v in zip(states, toks, verify):
            st.n_past += len(t)
            if v:
                st.verified = len(t)
        return res

    def keep_positions(self, state: SequenceState, keep: int) -> None:
        """After a verification step (``forward_batch(..., verify=...)``) that fed ``state``
        ``state.verified`` positions: keep the first ``keep`` of them, as if the others had never
        been fed (every layer's KV rows / DeltaNet state back to its checkpoint after position
        ``keep``). Exact: the state is then bit-identical to one that decoded only those."""
        n = state.verified
        if not 1 <= keep <= n:
            raise ValueError(f"keep {keep} of {n} verified positions")
        if keep < n:
            for il, snaps in state.checkpoints.items():
                state.layer_state(il).restore(snaps[keep - 1])
            state.n_past -= n - keep
        state.checkpoints, state.verified = {}, 0

    def _one_graph(self, token: int, state: SequenceState) -> list[np.ndarray] | None:
        """A one-sequence decode step as ONE graph of the model's (``decode_graph``: embedding,
        every layer with its experts on the local ggml bank, the lm head), each layer's choice
        grouped after it as :meth:`_groups` groups a lone sequence's and counted as :meth:`_through`
        counts it; None where the model does not run it. The same bits as the layer-by-layer path
        (:meth:`_through`, :meth:`_through_output`)."""
        bank = self.dispatcher.local.bank
        if not isinstance(bank, GgmlExpertBank):
            return None
        planned: list[tuple[int, Groups]] = []
        t0 = time.perf_counter()
        logits = self.model.decode_graph(token, state, bank, lambda il, ids: planned.append((il, expert_groups(ids))))
        if logits is None:
            return None
        per_layer = (time.perf_counter() - t0) / max(1, len(planned))
        for il, groups in planned:
            self.dispatcher.ran_locally(il, groups, per_layer)
        self.fused_layers += len(planned)
        self.one_graph_steps += 1
        return [logits]

    def _through(self, il, lin: LayerIn, groups, state, pos0, spans, only) -> tuple[LayerIn, Groups] | None:
        """Layer ``il``'s experts and layer_out and layer ``il + 1``'s layer_in as ONE graph of the
        model's (:meth:`~p2pswarm.engine.arch.common.LayerByGraph.layer_in_after`), for one sequence
        whose experts are all on the local ggml bank; None where the model does not run it. The same
        bits as :meth:`_post_batch` and :meth:`_pre_batch` with the bank's call between them."""
        front = self._front(il, lin, groups)
        if front is None:
            return None
        t0 = time.perf_counter()
        nxt = self.model.layer_in_after(il + 1, front, [(state, pos0, lin.h.shape[0])])
        if nxt is None:
            return None
        self.dispatcher.ran_locally(il, groups, time.perf_counter() - t0)
        self.fused_layers += 1
        return nxt, self._groups(nxt, lin.h.shape[0], spans, False, only)

    def _through_output(self, il, lin: LayerIn, groups) -> list[np.ndarray] | None:
        """The last layer's experts and layer_out and the lm head as ONE graph of the model's
        (``output_after``), for one sequence all of whose rows want logits; None where not run."""
        front = self._front(il, lin, groups)
        t0 = time.perf_counter()
        logits = self.model.output_after(front) if front is not None else None
        if logits is None:
            return None
        self.dispatcher.ran_locally(il, groups, time.perf_counter() - t0)
        self.fused_layers += 1
        return [logits]

    def _front(self, il, lin: LayerIn, groups) -> ExpertsInFront | None:
        bank = self.dispatcher.local.bank
        return ExpertsInFront.of(bank, il, lin.h, lin.cur, lin.ids, lin.weights, groups, lin.extras) \
            if isinstance(bank, GgmlExpertBank) else None

    def _pre_batch(self, il, h, spans, states, pos0, invariant, verify=None, pspans=None,
                   only: np.ndarray | None = None) -> tuple[LayerIn, Groups]:
        """Layer ``il``'s layer_in and its expert groups; with ``only`` (the last layer's rows that
        reach an output) only the groups that hold one of them, each cut to those rows where the
        probe found that exact (row-invariant experts, or a group of at most :attr:`small_call_rows`
        rows), else whole: the rows an expert's kernel computes together decide its bits. Only where
        the probe already ran: a lone request's step does not run it for this."""
        m = self.model
        batched = not invariant or self.dense_invariance(il).layer_in
        if verify is not None and any(verify):
            if batched and m.chunk_verify(il):
                # one call: a verified sequence's positions as one-row segments of its state (the
                # model computes each as its decode step would and checkpoints it)
                segs: list[tuple[SequenceState, int, int]] = []
                for sp, st, p, v in zip(spans, states, pos0, verify):
                    n = sp.stop - sp.start
                    segs += [(st, p + r, 1) for r in range(n)] if v else [(st, p, n)]
                lin = m.layer_in(il, h, segs)
                self.verify_calls["chunk"] += 1
            else:
                lin = self._pre_rounds(il, h, spans, states, pos0, verify, batched)
                self.verify_calls["rounds"] += 1
            spans = pspans
        elif batched:  # one set of dense mat-muls for every sequence's rows
            lin = m.layer_in(il, h, [(st, p, sp.stop - sp.start) for sp, st, p in zip(spans, states, pos0)])
        else:  # e.g. K-quant projections, or the F32 router on OpenBLAS: per sequence
            lin = LayerIn.gather(h.shape[0], [
                (np.arange(sp.start, sp.stop), m.layer_in(il, h[sp], [(st, p, sp.stop - sp.start)]))
                for sp, st, p in zip(spans, states, pos0)])
        return lin, self._groups(lin, h.shape[0], spans, invariant, only)

    def _groups(self, lin: LayerIn, n: int, spans, invariant, only: np.ndarray | None) -> Groups:
        """``lin``'s expert groups (of ``n`` rows): see :meth:`_pre_batch`."""
        if not invariant or self.row_invariant_experts:
            groups = expert_groups(lin.ids)  # one group per expert, all sequences: same bits per row
        else:
            groups = self._invariant_groups(lin.ids, spans)
        if only is not None:
            needed = np.zeros(n, bool)
            needed[only] = True
            # cut to the out rows only where already measured exact: a lone request never pays the
            # probes (seconds at a big geometry) for it; whole groups that hold an out row are exact
            probed = self._row_invariant
            cut = 0 if probed is None else n if probed[0] else probed[2]
            groups = [(e, rows[needed[rows]] if len(rows) <= cut else rows) for e, rows in groups
                      if needed[rows].any()]
        return groups

    def _pre_rounds(self, il, h, spans, states, pos0, verify, batched: bool) -> LayerIn:
        """Layer ``il``'s layer_in in rounds: round r holds row r of every verified sequence (one
        decode position on its state, checkpointed after it) and, in round 0, every other
        sequence's rows; each round is one ``layer_in`` call (``batched``) or one call per
        sequence, as a step of one-token decodes would make it."""
        m = self.model
        calls: list[tuple[np.ndarray, LayerIn]] = []
        n_rounds = max(sp.stop - sp.start for sp, v in zip(spans, verify) if v)
        for r in range(n_rounds):
            segs = []  # (rows of h, state, position of its first row, positions verified or 0)
            for sp, st, p, v in zip(spans, states, pos0, verify):
                if v and r < sp.stop - sp.start:
                    segs.append((np.arange(sp.start + r, sp.start + r + 1), st, p + r, sp.stop - sp.start))
                elif not v and r == 0:
                    segs.append((np.arange(sp.start, sp.stop), st, p, 0))
            if batched:
                idx = np.concatenate([s[0] for s in segs])
                calls.append((idx, m.layer_in(il, np.ascontiguousarray(h[idx]),
                                              [(st, p, len(rows)) for rows, st, p, _ in segs])))
            else:
                for rows, st, p, _ in segs:
                    calls.append((rows, m.layer_in(il, np.ascontiguousarray(h[rows]), [(st, p, len(rows))])))
            for _, st, _, n in segs:
                # after each position but the last (keeping every position restores nothing): a
                # DeltaNet layer's checkpoint is a copy of its state (4 MiB at the 122B's geometry)
                if r < n - 1:
                    st.checkpoints.setdefault(il, []).append(st.layer_state(il).checkpoint())
        return LayerIn.gather(h.shape[0], calls)

    def _invariant_groups(self, ids, spans) -> Groups:
        """Expert groups for the batch-invariant mode where the experts are not row-invariant: one
        group per (sequence, expert), except that sequences' groups of one expert with at most
        :attr:`small_call_rows` rows each are merged while the merged group stays that small (a
        decode step's one-row groups: 16 sequences on one expert are 3 groups, not 16). Exact: the
        probe measured that a row in a call of up to that many rows gets the bits of any smaller
        call, its own sequence's alone included. (One sort of the layer's pairs, not numpy calls per
        sequence and expert: p2pswarm.backbone.serving.grouping.)"""
        return grouping.invariant_groups(ids, spans, self.small_call_rows)

    def _post_batch(self, il, lin: LayerIn, groups, outs, spans, invariant, moe=None):
        if moe is None:
            moe = combine_outputs(lin.ids, lin.weights, groups, outs) if groups else np.zeros_like(lin.cur)
        if not invariant or self.dense_invariance(il).layer_out:
            return self.model.layer_out(il, lin, moe)
        return np.concatenate([self.model.layer_out(il, lin.rows(sp), moe[sp]) for sp in spans])

    def _post_rows(self, il, lin: LayerIn, groups, outs, spans, invariant, rows: np.ndarray) -> np.ndarray:
        """:meth:`_post_batch` for the step's rows ``rows`` only (the last layer's out rows; ``groups``
        those that hold them): their h, with the bits the whole step gives them. layer_out runs on
        those rows alone where the probe (already run: not for this) found it row-invariant, else on
        every row as the whole step does (the other rows' expert sum left zero: a row's result never depends on another's)."""
        kept = lin.rows(rows)
        moe = combine_rows(lin.ids, lin.weights, groups, outs, rows) if groups else np.zeros_like(kept.cur)
        known = self._dense_invariant.get(_layer_signature(self.model, il))  # (not probed for this alone)
        if known is not None and known.layer_out:
            return self.model.layer_out(il, kept, moe)
        full = np.zeros_like(lin.cur)
        full[rows] = moe
        return self._post_batch(il, lin, groups, outs, spans, invariant, full)[rows]

    def _output_batch(self, h, ospans, invariant):
        """Logits of each item's ``ospans`` (its rows, in one or more spans), per item."""
        m = self.model
        spans = [sp for item in ospans for sp in item]
        if invariant and not self.row_invariant_output:
            flat = [m.output(h[sp]) for sp in spans]
        else:
            rows = np.concatenate([np.arange(sp.start, sp.stop) for sp in spans])
            logits = m.output(h[rows])
            at = np.cumsum([0] + [sp.stop - sp.start for sp in spans])
            flat = [logits[a:b] for a, b in zip(at[:-1], at[1:])]
        out, i = [], 0
        for item in ospans:
            got = flat[i:i + len(item)]
            out.append(got[0] if len(got) == 1 else np.concatenate(got))
            i += len(item)
        return out
