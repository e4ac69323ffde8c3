"""Continuous batching: one scheduler owns every active sequence of a backbone and steps them together.

    scheduler = Scheduler(backbone)                 # nursery.start(scheduler.run)
    async with scheduler.submit(prompt_ids, Params(max_tokens=16)) as tokens:
        async for step in tokens:                   # Step(index, token, text, seconds, dispatch, end)
            ...

Why: a decode step is ~L serial layers with one network round trip each; a sequence alone runs at
1/(L*RTT). Stepping all active sequences together sends each owner *one* request per layer for all
of them, so the round trip is paid once per step instead of once per sequence.

Rules of a step (the loop in :meth:`Scheduler.run`):

* Sequences join and leave only at step boundaries. A new request is admitted when fewer than
  ``max_active`` sequences are active; a finished, failed or cancelled one leaves after its step.
* Every decode sequence contributes its row (1 + its drafts); then prefill chunks (arrival order)
  fill the per-step ``token_budget``, so a long prompt never stalls the others for more than a chunk.
  ``"auto"`` (the node's default) is :data:`AUTO_BUDGET_FLOOR` rows, grown while the step is
  network-bound (:func:`choose_token_budget`; up to :data:`AUTO_BUDGET_CAP` in a step with no
  sequence decoding: nobody to protect); docs/architecture.md "Continuous batching" says why.
* A prompt is always cut into the same chunks (``prefill_chunk`` tokens, from its start), whatever
  else is running: with the backbone's ``batch_invariant`` mode its tokens are then bit-identical
  to the same request served alone.
* Pipelining: a step's sequences are split into ``micro_batches`` groups that run their layer loops
  concurrently, so while one waits on the network for layer l the backbone computes another's dense
  path. ``"auto"`` picks the number each step from the measured dense time C (per layer, whole step)
  and dispatch wait R (per layer): :func:`choose_micro_batches`.
* Sampling is per request (its own :class:`~p2pswarm.backbone.serving.sampling.Sampler` and seed; the
  token at a position is drawn with that position's own random number).
* Speculative decoding (``speculate``, :mod:`p2pswarm.backbone.serving.speculation`): a decoding sequence
  may feed drafted tokens after its sampled one; the step verifies them all and keeps the prefix
  the model itself produces, exact (the same tokens as without).
* A client that goes away (its ``async with`` exits, e.g. the HTTP connection closed) cancels its
  sequence; a step that fails (bad token id, or the dispatcher gave up) fails the requests in that
  step with the error and the scheduler goes on with new ones. Dead workers never hang a step: the
  dispatcher's timeout and local fallback bound every layer.

Replay on ban (:mod:`p2pswarm.backbone.serving.replay` says why and what is kept): after every step in
which a worker was banned, each active sequence tainted by it gets a fresh state, its prompt fed
again in the same chunks and its clean tokens fed again one by one as decode rows (the same
schedule: exact), re-derived and checked, not sent again; a client that had dropped tokens gets a
:class:`Rewind` (or, with ``submit(..., rewinds=False)``, :class:`SequenceRewound`). A sequence
that finished before the ban is logged and counted (``backbone.replays.finished_unfixable``).
"""
from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import partial

import numpy as np
import trio

from p2pswarm.backbone.serving.items import Params, Rewind, Rows, Step
from p2pswarm.backbone.dispatch.dispatcher import Bans, Dispatcher
from p2pswarm.backbone.serving.link_budget import LinkModel
from p2pswarm.backbone.serving.pacing import (AUTO_BUDGET_CAP, AUTO_BUDGET_FLOOR, BUDGET_SAMPLE_ROWS, BUDGET_WINDOW,
                                      GATHER_FIRST, GATHER_FRACTION, GATHER_GAP, GATHER_MAX_S, choose_micro_batches,
                                      choose_token_budget)
from p2pswarm.backbone.serving.replay import TokenReplay
from p2pswarm.backbone.serving.runner import Backbone
from p2pswarm.backbone.serving.sampling import Sampler
from p2pswarm.backbone.serving.speculation import SpecStats, Speculation, accept, draft_lengths, mtp_drafting, plan_drafts
from p2pswarm.engine.state import SequenceState
from p2pswarm.errors import UserError

log = logging.getLogger("p2pswarm.scheduler")
__all__ = ["Params", "Request", "Rewind", "Rows", "Scheduler", "SchedulerStats", "SequenceRewound", "Step",
           "TokenOutOfRange"]


class TokenOutOfRange(UserError, ValueError):
    """A prompt token id outside the vocabulary: the caller's input (a 400, exit 2)."""


class SequenceRewound(RuntimeError):
    """Raised to a request that cannot take tokens back (``rewinds=False``) when a replay on ban
    withdraws tokens it already received."""


FINISHED_TAINT_PEERS = 4096  # finished sequences' taints remembered for so many workers ...
FINISHED_TAINT_IDS = 32  # ... with the ids of the latest so many requests each (for the log)


@dataclass
class SchedulerStats:
    steps: int = 0
    rows: int = 0  # rows fed through the backbone (prefill + decode)
    generated: int = 0  # tokens handed to requests
    completed: int = 0
    cancelled: int = 0
    failed: int = 0
    max_active: int = 0


EWMA = 0.3  # weight of the newest step in the timing estimates
class _Sequence:
    def __init__(self, sid: int, prompt: list[int], params: Params, send, tokenizer):
        self.sid = sid
        self.request_id = params.request_id or f"seq-{sid}"
        self.prompt = prompt
        self.params = params
        self.sampler = params.sampler or Sampler(0.0)
        #: the tokens generated so far, the sampler's initial copy, and while a replay on ban runs,
        #: the kept tokens still to be re-derived (p2pswarm.backbone.serving.replay)
        self.replay = TokenReplay(self.sampler, len(prompt))
        self.tokenizer = tokenizer
        self.send = send
        self.decoder = tokenizer.stream_decoder() if tokenizer is not None else None
        self.state: SequenceState | None = None
        self.adaptive = None  # its recent acceptance (speculation.Adaptive), made when it first may draft
        self.fed = 0  # prompt tokens fed so far
        self.next_token = 0  # the sampled token to feed next step (once the prompt is fed)
        self.n_out = 0
        self.cancelled = False
        self.done = False
        self.t_last = time.perf_counter()

    def chunk(self, size: int) -> list[int]:
        if self.fed < len(self.prompt):
            return self.prompt[self.fed : self.fed + size]
        return [self.next_token]


class Request:
    """One submitted request: ``async with`` it and iterate its :class:`Step` s. Leaving the block
    early (or :meth:`cancel`) removes the sequence at the next step boundary."""

    def __init__(self, scheduler: "Scheduler", seq: _Sequence, receive, rewinds: bool = False):
        self._scheduler = scheduler
        self._seq = seq
        self._receive = receive
        self._rewinds = rewinds

    async def __aenter__(self) -> "Request":
        return self

    async def __aexit__(self, *exc) -> None:
        self.cancel()

    def cancel(self) -> None:
        if not self._seq.done:
            self._seq.cancelled = True
            self._scheduler._wake.set()
        self._receive.close()

    def __aiter__(self) -> AsyncIterator[Step]:
        return self._iter()

    def ready(self) -> tuple[list[Step | Rewind | Rows], bool]:
        """``(the steps already sampled, whether the request has ended)``, without waiting (for a
        caller that drives the scheduler itself: :meth:`Scheduler.turn`); a failed step raises."""
        got: list[Step | Rewind | Rows] = []
        while True:
            try:
                item = self._receive.receive_nowait()
            except trio.WouldBlock:
                return got, False
            except (trio.EndOfChannel, trio.ClosedResourceError):
                return got, True
            if isinstance(item, BaseException):
                raise item
            got.append(item)

    async def _iter(self) -> AsyncIterator[Step]:
        async for item in self._receive:
            if isinstance(item, BaseException):
                raise item
            if isinstance(item, Rewind) and not self._rewinds:
                raise SequenceRewound(
                    f"request {self._seq.request_id}: {item.sent - item.keep} of the {item.sent} tokens already "
                    f"delivered were computed with outputs of worker {item.worker}, since banned; they cannot "
                    f"be taken back")
            yield item


class Scheduler:
    """Owns the active sequences of one backbone; :meth:`run` steps them until cancelled."""

    def __init__(self, backbone: Backbone, tokenizer=None, *, token_budget: int | str = 256, prefill_chunk: int = 32,
                 max_active: int = 256, micro_batches: int | str = "auto",
                 gather: str | tuple[float, float] = "auto", rows: bool = False,
                 speculate: Speculation | None = None, dispatcher: Dispatcher | None = None):
        """``gather``: how long an idle scheduler waits for a burst of requests before its first
        step: ``auto`` (:data:`GATHER_FRACTION`), or fixed (gap, most) seconds; ``(0, 0)`` starts
        at once. ``rows``: compute every position's logits, not only each sequence's last (for
        ``Params(rows=True)`` requests: :func:`~p2pswarm.backbone.serving.generate.sequence_logits`).

        What the scheduler reads of the dispatcher is named here once, not reached for through the
        backbone at each use: its counters (``stats``: per-step dispatch figures, the link model),
        its ``owners`` (their links' cost in the micro-batch rule) and its :class:`Bans` (the ban
        events replay on ban follows). ``dispatcher``: the backbone's own unless given."""
        self.dispatcher = dispatcher if dispatcher is not None else backbone.dispatcher
        self.bans: Bans = self.dispatcher.bans
        self.rows = rows
        self.speculate = speculate  # speculative decoding settings; None or mode off: none
        if speculate is not None:
            speculate.attach(backbone)  # (mode mtp: the model's block, and the hidden states it reads)
        self.spec = SpecStats()
        if token_budget != "auto" and (not isinstance(token_budget, int) or token_budget < 1):
            raise ValueError("token_budget must be 'auto' or an integer >= 1")
        if prefill_chunk < 1 or max_active < 1:
            raise ValueError("prefill_chunk and max_active must be >= 1")
        if micro_batches != "auto" and (not isinstance(micro_batches, int) or micro_batches < 1):
            raise ValueError("micro_batches must be 'auto' or an integer >= 1")
        self.micro_batches = micro_batches
        if not isinstance(gather, str) and not (len(gather) == 2 and 0 <= gather[0] and 0 <= gather[1]):
            raise ValueError("gather must be 'auto' or (gap, most) seconds >= 0")
        if isinstance(gather, str) and gather != "auto":
            raise ValueError("gather must be 'auto' or (gap, most) seconds >= 0")
        self.gather = gather
        self.step_s: float | None = None  # EWMA: wall seconds of a step
        self.dense_s: float | None = None  # EWMA: seconds per layer the backbone's dense work is busy, a whole step
        self.wait_s: float | None = None  # EWMA: dispatch wait per layer of one micro-batch
        self.links = LinkModel()  # the wait's link part, where the owners' links have a known cost per row
        self.last_micro_batches = 1
        #: dense seconds per row and layer (token_budget="auto"): the least of the last steps' of at
        #: least BUDGET_SAMPLE_ROWS rows - the step with the most rows amortises the fixed costs best
        self.dense_row_s: float | None = None
        self._row_costs: deque[float] = deque(maxlen=BUDGET_WINDOW)
        self.backbone = backbone
        self.tokenizer = tokenizer
        self.token_budget = token_budget
        self.last_token_budget: int = token_budget if isinstance(token_budget, int) else AUTO_BUDGET_FLOOR
        self.prefill_chunk = min(prefill_chunk, self.last_token_budget)
        self.max_active = max_active
        self.stats = SchedulerStats()
        self._pending: deque[_Sequence] = deque()
        self._active: list[_Sequence] = []
        self._wake = trio.Event()
        self._ids = 0
        self._running = False
        self._ban_epoch = self.bans.epoch
        self._bans_seen: set[str] = set(self.bans.banned)
        #: worker -> (finished sequences that used its unverified outputs, the latest request ids)
        self._finished_taint: dict[str, tuple[int, deque]] = {}

    @property
    def active(self) -> int:
        return len(self._active)

    def submit(self, prompt_ids, params: Params | None = None, *, rewinds: bool = False) -> Request:
        """Queue a request; the returned :class:`Request` yields its steps as they are sampled.
        ``rewinds``: the caller takes :class:`Rewind` items (replay on ban withdrew tokens it had);
        without, such a withdrawal ends the iteration with :class:`SequenceRewound`."""
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("empty prompt")
        n_vocab = self.backbone.model.n_vocab
        bad = [t for t in prompt if t < 0 or t >= n_vocab]
        if bad:  # refused here: one bad prompt must not fail the step it would share with others
            raise TokenOutOfRange(f"token id {bad[0]} out of range: the vocabulary has ids 0-{n_vocab - 1}")
        params = params or Params()
        if params.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        send, receive = trio.open_memory_channel(math.inf)  # the step loop never waits on a client
        self._ids += 1
        seq = _Sequence(self._ids, prompt, params, send, self.tokenizer)
        self._pending.append(seq)
        self._wake.set()
        return Request(self, seq, receive, rewinds)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """The step loop; run it in a nursery (``await nursery.start(scheduler.run)``)."""
        if self._running:
            raise RuntimeError("the scheduler is already running")
        self._running = True
        listeners = self.bans.listeners
        listeners.append(self._on_ban)  # an idle loop reports a ban too; removed when the loop ends
        task_status.started()
        try:
            while True:
                if not await self.turn():
                    self._wake = trio.Event()
                    if not self._pending:
                        await self._wake.wait()
                        await self._gather()
        finally:
            self._running = False
            listeners.remove(self._on_ban)
            for seq in [*self._active, *self._pending]:
                seq.send.close()

    async def turn(self) -> bool:
        """One turn of the step loop, without waiting for requests: admit, replay a ban that came
        between steps, step the active sequences. False: nothing was active. :meth:`run` loops on
        it; :func:`p2pswarm.backbone.serving.generate.generate` drives a scheduler of its own with it, one
        step each time its consumer wants the next token."""
        self._admit()
        if self.bans.epoch != self._ban_epoch:
            self._replay_banned()  # a ban between steps (a ban record honoured); none in flight
        if not self._active:
            return False
        try:
            await self.step()
        except Exception as exc:
            log.exception("a scheduler step failed; failing its %d sequences", len(self._active))
            for seq in self._active:
                if not seq.done:
                    self._fail(seq, exc)
        return True

    async def drive(self, request: Request) -> AsyncIterator[Step | Rewind | Rows]:
        """``request``'s items, stepping this scheduler (one nobody :meth:`run` s) only when the
        caller wants more: nothing runs ahead of the consumer, so a ban it causes between two items
        is replayed before the next (:func:`~p2pswarm.backbone.serving.generate.generate`,
        :func:`~p2pswarm.backbone.serving.generate.sequence_logits`)."""
        ended = False
        while not ended:
            got, ended = request.ready()
            for item in got:
                yield item
            if not ended and not got and not await self.turn():
                return

    def _on_ban(self, peer: str) -> None:
        self._wake.set()

    def gather_window(self) -> tuple[float, float]:
        """(gap, most) seconds :meth:`_gather` waits now (see :data:`GATHER_FRACTION`): most a
        fraction of the recent step time, capped at :data:`GATHER_MAX_S`; the gap :data:`GATHER_GAP` of it."""
        if not isinstance(self.gather, str):
            return self.gather
        if self.step_s is None:
            return GATHER_FIRST
        most = min(GATHER_MAX_S, GATHER_FRACTION * self.step_s)
        return min(most, GATHER_GAP * self.step_s), most

    async def _gather(self) -> None:
        """Wait while requests keep arriving less than the gap apart, at most the window in all
        (:meth:`gather_window`); a wake-up that brings no request (a cancel, a ban) ends it."""
        gap, most = self.gather_window()
        if gap <= 0 or most <= 0 or not self._pending:
            return
        deadline = trio.current_time() + most
        while trio.current_time() < deadline:
            seen = len(self._pending)
            self._wake = trio.Event()
            with trio.move_on_at(min(deadline, trio.current_time() + gap)):
                await self._wake.wait()
            if len(self._pending) == seen:
                return

    def _admit(self) -> None:
        self.stats.cancelled += sum(1 for s in self._active if s.cancelled and not s.done)
        keep = []
        for s in self._active:
            if s.cancelled or s.done:
                self._remember_taint(s)
            else:
                keep.append(s)
        self._active = keep
        while self._pending and len(self._active) < self.max_active:
            seq = self._pending.popleft()
            if seq.cancelled:
                self.stats.cancelled += 1
                continue
            seq.state = self.backbone.new_state()
            self._active.append(seq)
        self.stats.max_active = max(self.stats.max_active, len(self._active))

    def plan(self, drafts: dict[int, list[int]] | None = None) -> list[_Sequence]:
        """Every decode row (1 + its ``drafts``), then prefill chunks in arrival order while the budget lasts."""
        decode = [s for s in self._active if s.fed >= len(s.prompt)]
        prefill = [s for s in self._active if s.fed < len(s.prompt)]
        if self.token_budget == "auto":
            # the budget keeps prefill from stalling decoding sequences; with none decoding there is
            # nobody to stall, and a prompt left out finishes a step later than the burst it came in
            self.last_token_budget = (choose_token_budget(self.dense_row_s, self.wait_s) if decode
                                      else AUTO_BUDGET_CAP)
        budget = self.last_token_budget - sum(1 + len((drafts or {}).get(s.sid, ())) for s in decode)
        chosen = list(decode)
        for s in prefill:
            n = len(s.chunk(self.prefill_chunk))
            if n <= budget or not chosen:
                chosen.append(s)
                budget -= n
        return chosen

    def _split(self, batch: list[_Sequence], chunks: list[list[int]]) -> list[list[int]]:
        """Indices of ``batch`` per micro-batch: contiguous, balanced by rows."""
        if isinstance(self.micro_batches, int):
            m = min(self.micro_batches, len(batch))
        elif self.dense_s is None or self.wait_s is None:
            m = 1
        else:
            wait, link = self.links.terms(self.dispatcher.owners, sum(map(len, chunks)), self.wait_s)
            m = choose_micro_batches(self.step_dense_s(chunks), wait, len(batch), link_s=link)
        self.last_micro_batches = m
        total = sum(len(c) for c in chunks)
        parts: list[list[int]] = [[] for _ in range(m)]
        acc = 0
        for i, c in enumerate(chunks):
            parts[min(m - 1, acc * m // max(total, 1))].append(i)
            acc += len(c)
        return [p for p in parts if p]

    def step_dense_s(self, chunks: list[list[int]]) -> float:
        """The dense time per layer expected of a step feeding ``chunks``: the recent steps' (an
        EWMA), or, for a step of more rows than they had (a burst of prompts), its rows times the
        measured per-row cost. Why not the EWMA alone: it follows the decode steps, and a prefill
        step of 64 ten-token prompts has ten times their rows; timed as a decode step it ran
        unpipelined, several times a decode step's time."""
        dense = self.dense_s or 0.0
        if self.dense_row_s is not None:
            dense = max(dense, self.dense_row_s * sum(len(c) for c in chunks))
        return dense

    async def step(self) -> None:
        dec = [s for s in self._active if s.fed >= len(s.prompt)]
        lengths = draft_lengths(self.speculate, dec)
        plan = partial(plan_drafts, self.speculate, dec, lengths)
        drafts = await trio.to_thread.run_sync(plan) if mtp_drafting(self.speculate, lengths) else plan()  # (CPU)
        batch = self.plan(drafts)  # (drafts first: they count against the token budget)
        chunks = [s.chunk(self.prefill_chunk) + drafts.get(s.sid, []) for s in batch]
        verify = [s.sid in drafts for s in batch]
        before = self.dispatcher.stats.snapshot()
        t_before = self.backbone.timing.snapshot()
        parts = self._split(batch, chunks)
        results: list[np.ndarray | Exception | None] = [None] * len(batch)

        async def run_part(idx: list[int]) -> None:
            out: list[np.ndarray | Exception]
            try:
                items = [(chunks[i], batch[i].state) for i in idx]  # (an admitted sequence has a state)
                out = list(await self.backbone.forward_batch(items, last_only=not self.rows,  # type: ignore[arg-type]
                                                             verify=[verify[i] for i in idx]))
            except Exception as exc:  # these requests get the error, the loop goes on
                out = [exc] * len(idx)
            for i, o in zip(idx, out):
                results[i] = o

        t_step = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for idx in parts:
                nursery.start_soon(run_part, idx)
        took = time.perf_counter() - t_step
        self.step_s = took if self.step_s is None else (1 - EWMA) * self.step_s + EWMA * took
        if self.speculate is not None:  # (its draft-length controller prices a row by the step's time)
            self.speculate.costs.observe_step(took, sum(len(c) for c in chunks))
        t = self.backbone.timing
        layers = t.layers - t_before.layers
        if layers:
            n_layer = layers / len(parts)
            # busy, not summed: micro-batches' dense pieces that overlap wait on each other (LayerTiming)
            dense, wait = (t.busy_s - t_before.busy_s) / n_layer, (t.wait_s - t_before.wait_s) / layers
            self.dense_s = dense if self.dense_s is None else (1 - EWMA) * self.dense_s + EWMA * dense
            self.wait_s = wait if self.wait_s is None else (1 - EWMA) * self.wait_s + EWMA * wait
            rows = sum(len(c) for c in chunks)
            self.links.observe(self.dispatcher.stats.since(before).per_owner_rows, n_layer, rows)
            if rows >= BUDGET_SAMPLE_ROWS:  # small steps' fixed per-layer costs would inflate the per-row cost
                self._row_costs.append(dense / rows)
                self.dense_row_s = min(self._row_costs)
        dispatch = self.dispatcher.stats.since(before)
        self.stats.steps += 1
        self.stats.rows += sum(len(c) for c in chunks)
        failed = [r for r in results if isinstance(r, Exception)]
        if failed:
            log.warning("%d of %d sequences of a step failed: %s", len(failed), len(batch), failed[0])
        rewound = self._replay_banned() if self.bans.epoch != self._ban_epoch else set()
        for s, c, lg in zip(batch, chunks, results):
            if isinstance(lg, Exception):
                self._fail(s, lg)
                continue
            if s.sid in rewound:
                continue  # this step's rows are thrown away with the rest of its state
            assert lg is not None and s.state is not None
            if s.params.rows and s.sid not in drafts:  # (a verification's rows: those kept, below)
                self._send(s, Rows(s.state.n_past - len(c), lg))
            if s.fed < len(s.prompt):
                s.fed += len(c)
                if s.fed < len(s.prompt):
                    continue  # more of the prompt to feed before the first token
            if s.cancelled:
                continue
            if s.sid in drafts:  # keep the positions whose drafts the model confirmed (each row's Rows first)
                at = s.state.n_past - len(c)
                on_row = (lambda i, s=s, at=at, lg=lg: self._send(s, Rows(at + i, lg[i:i + 1]))) if s.params.rows else None
                self.backbone.keep_positions(s.state, accept(partial(self._emit, dispatch=dispatch), s, lg,
                                                             drafts[s.sid], self.spec, on_row))
            else:
                self._emit(s, lg[-1], dispatch=dispatch)

    # -- replay on ban (module doc) -------------------------------------------------------------
    def _replay_banned(self) -> set[int]:
        """Rewind every active sequence tainted by a banned worker; report finished ones that were.
        Returns the ids of the sequences rewound."""
        self._ban_epoch = self.bans.epoch
        for peer in [p for p in self.bans.banned if p not in self._bans_seen]:
            self._bans_seen.add(peer)
            n, ids = self._finished_taint.pop(peer, (0, ()))
            if n:
                self.backbone.replays.finished_unfixable += n
                log.warning("%d requests that finished before worker %s was banned used its unverified outputs "
                            "and cannot be replayed (their output may differ from monolithic); latest: %s",
                            n, peer, ", ".join(ids))
        return {s.sid for s in self._active
                if not (s.done or s.cancelled or s.state is None) and self._rewind(s)}

    def _rewind(self, s: _Sequence) -> bool:
        """Back to the last clean point (:meth:`TokenReplay.rewind`): keep the tokens produced from
        clean positions; False when the sequence is clean."""
        assert s.state is not None
        rewound = s.replay.rewind(s.state, self.bans.banned, self.backbone.replays,
                                  f"request {s.request_id}")
        if rewound is None:
            return False
        s.sampler, withdrawn = rewound
        if withdrawn is not None:
            self._send(s, withdrawn)
        s.state = self.backbone.new_state()
        s.fed = 0
        s.next_token = 0
        s.n_out = 0
        s.decoder = s.tokenizer.stream_decoder() if s.tokenizer is not None else None
        return True

    @staticmethod
    def _send(s: _Sequence, item: Rewind | Rows) -> None:
        """Hand ``item`` (a :class:`Rewind`: its tokens from ``keep`` on withdrawn; or a
        :class:`Rows`) to the client; a client that has gone away cancels the sequence."""
        try:
            s.send.send_nowait(item)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            s.cancelled = True

    def _remember_taint(self, s: _Sequence) -> None:
        """A sequence leaves: remember which workers' unverified outputs it used, so a later ban of
        one of them can be reported (it is too late to replay it)."""
        if s.state is None or not s.state.taint:
            return
        for peer in s.state.taint:
            n, ids = self._finished_taint.pop(peer, (0, None))
            if ids is None:
                ids = deque(maxlen=FINISHED_TAINT_IDS)
            ids.append(s.request_id)
            self._finished_taint[peer] = (n + 1, ids)  # re-inserted: the dict's order is recency
        while len(self._finished_taint) > FINISHED_TAINT_PEERS:
            self._finished_taint.pop(next(iter(self._finished_taint)))

    def _fail(self, s: _Sequence, exc: Exception) -> None:
        s.done = True
        self.stats.failed += 1
        try:
            s.send.send_nowait(exc)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        s.send.close()

    def _emit(self, s: _Sequence, row: np.ndarray, drafted: int = 0, expected: int | None = None, *,
              dispatch) -> None:
        token = s.sampler(row, len(s.prompt) + s.n_out)  # the position's own random number
        again, withdrawn = s.replay.rederive(s.n_out, token, self.backbone.replays, f"request {s.request_id}")
        if again:  # replaying: a token the client already has, derived again
            if s.decoder is not None:
                s.decoder.push(token)  # (the decoder's state, not its text: that was sent)
            s.n_out += 1
            s.next_token = token
            return
        if withdrawn is not None:
            self._send(s, withdrawn)
        p = s.params
        tok = self.tokenizer
        end = bool(p.stop_at_eos and tok is not None and tok.is_eog(token))
        last = end or s.n_out == p.max_tokens - 1
        text = ""
        if s.decoder is not None:
            text = s.decoder.push(token) + (s.decoder.flush() if last else "")
        now = time.perf_counter()
        step = Step(s.n_out, token, text, now - s.t_last, dispatch, end=end, drafted=drafted,
                    accepted=token == expected)
        s.t_last = now
        s.n_out += 1
        s.next_token = token
        s.replay.tokens.append(token)
        self.stats.generated += 1
        try:
            s.send.send_nowait(step)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            s.cancelled = True  # the client is gone
        if last:
            s.done = True
            self.stats.completed += 1
            s.send.close()
