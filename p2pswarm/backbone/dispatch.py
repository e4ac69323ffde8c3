"""Dispatch one layer's expert work to whoever owns each expert, with the local replica as fallback.

The backbone hands :meth:`Dispatcher.run` the rows ``cur`` of one layer and the groups
``[(expert, token indices), ...]`` the router chose. The dispatcher

1. assigns each group to an owner that holds the expert (a worker, or the local bank);
2. sends *one* request per owner with all its groups, to all owners concurrently;
3. on an owner's error or timeout, recomputes that owner's groups on the local replica (the
   backbone holds every expert) and avoids the owner for a back-off period;
4. returns ``{expert: outputs}``; the caller combines them in top-k order, so arrival order never
   matters and the result is bit-identical whoever computed what.

Owners are transports: :class:`LocalOwner` (this process), :class:`InProcessOwner` (a worker object
in this process, exercising the same row packing as a remote one) and
:class:`p2pswarm.backbone.socket_owner.SocketOwner` (a worker process over a local socket).
"""
from __future__ import annotations

import abc
import logging
import time
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import trio

from p2pswarm.engine.experts import ExpertBank
from p2pswarm.errors import WorkerError

log = logging.getLogger("p2pswarm.backbone")

Groups = list[tuple[int, np.ndarray]]


def pack_rows(cur: np.ndarray, groups: Groups) -> tuple[np.ndarray, Groups]:
    """The distinct rows an owner needs, once each, and the groups re-indexed into them."""
    wanted = np.unique(np.concatenate([idx for _, idx in groups])) if groups else np.zeros(0, np.int64)
    rows = np.ascontiguousarray(cur[wanted])
    return rows, [(e, np.searchsorted(wanted, idx).astype(np.int32)) for e, idx in groups]


def first_error(group: BaseExceptionGroup) -> BaseException:
    """The first leaf of a (nested) exception group: nurseries wrap errors, callers want the error."""
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


class Owner(abc.ABC):
    """Something that can compute the experts of some (layer, expert) ranges."""

    name = "owner"
    remote = True

    @abc.abstractmethod
    def holds(self, layer: int, expert: int) -> bool:
        """Whether this owner computes expert ``expert`` of layer ``layer``."""

    @abc.abstractmethod
    async def compute(self, layer: int, cur: np.ndarray, groups: Groups) -> list[np.ndarray]:
        """Outputs per group, in order; raise WorkerError on any failure."""

    async def aclose(self) -> None:
        pass


class LocalOwner(Owner):
    """The backbone's own replica: every expert, computed in a thread of this process."""

    name = "local"
    remote = False

    def __init__(self, bank: ExpertBank):
        self.bank = bank

    def holds(self, layer: int, expert: int) -> bool:
        return self.bank.holds(layer, expert)

    async def compute(self, layer, cur, groups):
        return await trio.to_thread.run_sync(partial(self.bank.forward_groups, layer, cur, groups))


class InProcessOwner(Owner):
    """A worker object in this process: same packing and same worker code as a remote one."""

    def __init__(self, worker, name: str):
        self.worker = worker
        self.name = name

    def holds(self, layer, expert):
        return self.worker.bank.holds(layer, expert)

    async def compute(self, layer, cur, groups):
        rows, local_groups = pack_rows(cur, groups)
        return await trio.to_thread.run_sync(partial(self.worker.compute, layer, rows, local_groups))


@dataclass
class DispatchStats:
    """Counters over the dispatcher's life; `snapshot()` and differences give per-step numbers."""

    layers: int = 0
    requests: int = 0
    remote_rows: int = 0
    local_groups: int = 0
    remote_groups: int = 0
    fallbacks: int = 0
    seconds: float = 0.0
    per_owner: dict[str, int] = field(default_factory=dict)

    def snapshot(self) -> "DispatchStats":
        return DispatchStats(self.layers, self.requests, self.remote_rows, self.local_groups, self.remote_groups,
                             self.fallbacks, self.seconds, dict(self.per_owner))

    def since(self, before: "DispatchStats") -> "DispatchStats":
        return DispatchStats(
            self.layers - before.layers, self.requests - before.requests, self.remote_rows - before.remote_rows,
            self.local_groups - before.local_groups, self.remote_groups - before.remote_groups,
            self.fallbacks - before.fallbacks, self.seconds - before.seconds,
            {k: v - before.per_owner.get(k, 0) for k, v in self.per_owner.items()},
        )


class Dispatcher:
    """Routes groups to owners; the local bank computes what no healthy owner holds."""

    def __init__(self, local: ExpertBank, owners: list[Owner] | None = None, *, fallback: bool = True,
                 backoff_s: float = 30.0):
        self.local = LocalOwner(local)
        self.owners = list(owners or [])
        self.fallback = fallback
        self.backoff_s = backoff_s
        self._down_until: dict[str, float] = {}
        self.stats = DispatchStats()

    def clear_backoff(self, name: str) -> bool:
        """Use owner ``name`` again at once (it restarted: a newer signed record says so)."""
        return self._down_until.pop(name, None) is not None

    def _healthy(self, owner: Owner) -> bool:
        return time.monotonic() >= self._down_until.get(owner.name, 0.0)

    def assign(self, layer: int, groups: Groups) -> dict[Owner, Groups]:
        plan: dict[Owner, Groups] = {}
        for e, idx in groups:
            owner = next((o for o in self.owners if o.holds(layer, e) and self._healthy(o)), self.local)
            plan.setdefault(owner, []).append((e, idx))
        return plan

    async def run(self, layer: int, cur: np.ndarray, groups: Groups) -> dict[int, np.ndarray]:
        t0 = time.perf_counter()
        plan = self.assign(layer, groups)
        results: dict[int, np.ndarray] = {}

        async def one(owner: Owner, owner_groups: Groups) -> None:
            try:
                outs = await owner.compute(layer, cur, owner_groups)
                if len(outs) != len(owner_groups) or any(
                    o.shape != (len(idx), cur.shape[1]) for o, (_, idx) in zip(outs, owner_groups)
                ):
                    raise WorkerError(f"{owner.name} returned outputs of the wrong shape")
            except WorkerError as exc:
                if not owner.remote or not self.fallback:
                    raise
                self._down_until[owner.name] = time.monotonic() + self.backoff_s
                self.stats.fallbacks += 1
                log.warning("worker %s failed on layer %d (%s): fell back to the local replica for %d experts;"
                            " avoiding it for %.0f s", owner.name, layer, exc, len(owner_groups), self.backoff_s)
                outs = await self.local.compute(layer, cur, owner_groups)
            for (e, _), out in zip(owner_groups, outs):
                results[e] = out

        try:
            async with trio.open_nursery() as nursery:
                for owner, owner_groups in plan.items():
                    nursery.start_soon(one, owner, owner_groups)
        except BaseExceptionGroup as group:
            raise first_error(group) from None
        s = self.stats
        s.layers += 1
        s.seconds += time.perf_counter() - t0
        for owner, owner_groups in plan.items():
            if owner.remote:
                s.requests += 1
                s.remote_groups += len(owner_groups)
                s.remote_rows += sum(len(idx) for _, idx in owner_groups)
            else:
                s.local_groups += len(owner_groups)
            s.per_owner[owner.name] = s.per_owner.get(owner.name, 0) + len(owner_groups)
        return results

    async def aclose(self) -> None:
        for o in self.owners:
            await o.aclose()
