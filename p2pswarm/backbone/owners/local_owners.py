"""The dispatcher's owners that live in this process: :class:`LocalOwner` (the backbone's own
replica or expert cache), :class:`UnheldOwner` (a unit nobody live holds: fetched first) and
:class:`InProcessOwner` (a worker object here), with the row packing every owner shares. Split from
:mod:`p2pswarm.backbone.dispatch.dispatcher`, which re-exports them."""
from __future__ import annotations

from contextvars import ContextVar
from functools import partial
from typing import Protocol

import numpy as np

from p2pswarm.contracts import ExpertBank, Groups, Owner
from p2pswarm.net.wire import precision as wire_precision
from p2pswarm.offload import Offload

from p2pswarm.backbone.owners.expert_cache import ExpertCache
from p2pswarm.backbone.owners.row_probe import RowInvariance, probe_expert_rows


def pack_rows(cur: np.ndarray, groups: Groups) -> tuple[np.ndarray, Groups]:
    """The distinct rows an owner needs, once each, and the groups re-indexed into them.

    A step of one row (a lone sequence decoding) needs no search: every group is that row."""
    if len(cur) == 1 and groups:
        return np.ascontiguousarray(cur), [(e, np.zeros(len(idx), np.int32)) for e, idx in groups]
    if not groups:
        return np.ascontiguousarray(cur[np.zeros(0, np.int64)]), []
    # one unique over every group's rows gives each its index into the distinct rows (no numpy
    # call per group: an owner's request has hundreds of them in a batch-invariant decode step)
    wanted, at = np.unique(np.concatenate([idx for _, idx in groups]), return_inverse=True)
    at = at.astype(np.int32)
    at.flags.writeable = False
    out: Groups = []
    pos = 0
    for e, idx in groups:
        n = len(idx)
        out.append((e, at[pos:pos + n]))
        pos += n
    return np.ascontiguousarray(cur[wanted]), out


class LayerInputs:
    """One layer's rows ``cur`` in the input form owners take them in, made once for all owners.

    Each remote owner's request carries the rows its groups need, quantised by the backbone's
    replica into what the worker's ggml would make of them (:meth:`SocketOwner.compute`). With
    4 owners a row goes to ~3.6 of them (top-8 of 256 experts), and each quantised it again: 1.1%
    of a 0.3-core backbone's samples, and float32 rows copied per owner before that. Quantising
    is row by row (a block never spans rows), so the rows of ``quantise(cur)`` are the same bytes
    as ``quantise(cur[rows])``. :class:`~p2pswarm.backbone.dispatch.dispatcher.Dispatcher` sets
    one per layer it sends to two or more owners (:data:`LAYER_INPUTS`, seen by the tasks it starts)."""

    __slots__ = ("layer", "cur", "_made")

    def __init__(self, layer: int, cur: np.ndarray):
        self.layer = layer
        self.cur = cur
        self._made: dict[int, tuple[np.ndarray, str | None]] = {}

    def quantised(self, quantiser, layer: int, cur: np.ndarray) -> tuple[np.ndarray, str | None] | None:
        """``quantiser.quantise_input(layer, cur)``, made on the first ask; None for another
        layer's or another array's rows (not this memo's)."""
        if layer != self.layer or cur is not self.cur:
            return None
        got = self._made.get(id(quantiser))
        if got is None:
            got = self._made[id(quantiser)] = quantiser.quantise_input(layer, cur)
        return got


#: the layer whose owners' requests are being made in this task (None: none; each owner quantises its own rows)
LAYER_INPUTS: ContextVar[LayerInputs | None] = ContextVar("p2pswarm_layer_inputs", default=None)


def peer_of(owner: "Owner") -> str:
    """The identity an owner's work is credited to and banned by: a libp2p peer id where there is one."""
    return owner.peer or owner.name


class LocalOwner(Owner):
    """The backbone's own replica: every expert, computed in this process: inline on the event loop
    when measured to take less than the offload bound (a verification sample of a few rows, a
    decode step's hot experts: the thread hop costs more), else in a thread (:mod:`p2pswarm.offload`).
    ``offload`` is shared with the backbone's dense path (one policy per process, so the loop
    never waits on a kernel lock a thread holds)."""

    name = "local"
    remote = False

    def __init__(self, bank: ExpertBank, offload: Offload | None = None):
        self.bank = bank
        self.offload = Offload() if offload is None else offload
        self.wire_precision: str | None = None  # the backbone's --wire-precision (p2pswarm.net.wire.precision)
        self._rows: RowInvariance | None = None  # measured once (row_invariance)

    def row_invariance(self, n_layer: int, n_embd: int) -> RowInvariance:
        """Whether this replica's expert mat-muls give a row the same bits whatever rows share the
        call (measured once, :func:`p2pswarm.backbone.owners.row_probe.probe_expert_rows`)."""
        if self._rows is None:
            self._rows = probe_expert_rows(getattr(self.bank, "probe_bank", self.bank), n_layer, n_embd)
        return self._rows

    @property
    def exact_rows(self) -> int:
        """The most rows of a group the verifier may check on their selected rows alone: the
        replica's kernel gives such a row the bits it gets in a call of all of them. 1 (every row
        of a group recomputed, unless the group is one row) until :meth:`row_invariance` measured."""
        return 1 if self._rows is None else self._rows.exact_rows

    def holds(self, layer: int, expert: int) -> bool:
        return self.bank.holds(layer, expert)

    def forward_groups(self, layer, cur, groups) -> list[np.ndarray]:
        """The bank's outputs, rounded as a worker's at the wire precision would be."""
        outs = self.bank.forward_groups(layer, cur, groups)
        p = self.wire_precision
        return outs if p is None else [wire_precision.round_to(o, p) for o in outs]

    async def compute(self, layer, cur, groups):
        n = sum(len(idx) for _, idx in groups)
        return await self.offload.run(partial(self.forward_groups, layer, cur, groups), n, "experts")


class Obtainer(Protocol):
    """What :class:`UnheldOwner` needs of the dispatcher (a Protocol: this module is below it)."""

    cache: ExpertCache | None
    local: LocalOwner

    async def obtain(self, layer: int, experts: list[int]) -> None: ...


class UnheldOwner(Owner):
    """Where the dispatcher routes a unit no live owner holds and the expert cache lacks: it is
    fetched into the cache (:meth:`Dispatcher.obtain`, bounded), then computed by the local
    replica - the same bytes, the same kernel, the same bits - or the step fails with
    :class:`UnitsUnavailable` naming the units (never a hang, never a wrong token)."""

    name = "fetch"
    remote = False

    def __init__(self, dispatcher: Obtainer):
        self.dispatcher = dispatcher

    def holds(self, layer: int, expert: int) -> bool:
        return False

    async def compute(self, layer, cur, groups):
        d = self.dispatcher
        experts = sorted({int(e) for e, _ in groups})
        await d.obtain(layer, experts)
        assert d.cache is not None  # (obtain raised otherwise)
        pinned = d.cache.pin(layer, experts)
        try:
            return await d.local.compute(layer, cur, groups)
        finally:
            d.cache.unpin(pinned)


class InProcessOwner(Owner):
    """A worker object in this process: same packing and same worker code as a remote one."""

    def __init__(self, worker, name: str):
        self.worker = worker
        self.name = name

    def holds(self, layer, expert):
        return self.worker.bank.holds(layer, expert)

    async def compute(self, layer, cur, groups, family=None):
        rows, local_groups = pack_rows(cur, groups)
        outs = await self.worker.compute_async(layer, rows, local_groups, family)
        p = self.wire_precision  # as a worker process's would come back
        return outs if p is None else [wire_precision.round_to(o, p) for o in outs]
