"""Dispatch one layer's expert work to whoever owns each expert, with the local replica as fallback.

The backbone hands :meth:`Dispatcher.run_groups` the rows ``cur`` of one layer and the groups
``[(expert, token indices), ...]`` the router chose. The dispatcher

1. routes: assigns each group to an owner that holds the expert (a worker, or the local bank;
   :meth:`Dispatcher.route`);
2. sends *one* request per owner with all its groups, to all owners concurrently;
3. on an owner's error or timeout, recomputes that owner's groups on the local replica (the
   backbone holds every expert) and avoids the owner for a back-off period (one that only
   missed its deadline is used again as soon as its late reply arrives: it was late, not hung);
4. verifies a sample of a remote answer (:meth:`Dispatcher._verified`);
5. returns the outputs per group; the caller combines them in top-k order, so arrival order never
   matters and the result is bit-identical whoever computed what.

One concern per module: routing and back-off (which owner, which owners to avoid, the hot-expert
path) in :mod:`~p2pswarm.backbone.dispatch.routing`, verification, bans and taint in
:mod:`~p2pswarm.backbone.dispatch.verify`, counters and demand in
:mod:`~p2pswarm.backbone.dispatch.stats`, the in-process owners in
:mod:`~p2pswarm.backbone.owners.local_owners`; this module runs a layer's plan and falls back.

Owners (:class:`p2pswarm.contracts.Owner`) are transports: :class:`LocalOwner` (this process),
:class:`InProcessOwner` (a worker object here, packing rows as a remote one) and
``socket_owner.SocketOwner`` / ``libp2p_owner.Libp2pOwner`` (a worker process, over a socket)."""
from __future__ import annotations

import logging
import time
from functools import partial
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import trio

from p2pswarm import settings
from p2pswarm.contracts import ExpertBank, Groups, Owner
from p2pswarm.errors import UnitsUnavailable, UserError, WorkerError, WorkerSlow, first_error
from p2pswarm.net.wire import precision as wire_precision
from p2pswarm.net.wire.counting import WireBytes
from p2pswarm.offload import Offload

from p2pswarm.backbone.dispatch import check_fetch
from p2pswarm.backbone.dispatch.routing import HOT_PROBE_S, Routing
from p2pswarm.backbone.dispatch.stats import DemandCounter, DispatchStats
from p2pswarm.backbone.dispatch.verify import Bans, LayerChecks, Verification
from p2pswarm.backbone.owners.expert_cache import ExpertCache
from p2pswarm.backbone.owners.local_owners import (LAYER_INPUTS, InProcessOwner, LayerInputs, LocalOwner, UnheldOwner,
                                                   pack_rows, peer_of)

# the owners and counters split into their own modules, importable from here as before
__all__ = ["Bans", "DemandCounter", "DispatchStats", "Dispatcher", "InProcessOwner", "LocalOwner", "UnheldOwner",
           "pack_rows", "peer_of", "FETCH_BOUND_S", "HOT_PROBE_S"]

if TYPE_CHECKING:
    from p2pswarm.market.receipts import ContributionLedger
    from p2pswarm.market.verify import Verifier

log = logging.getLogger("p2pswarm.backbone")

#: how long a step waits for units no live owner holds to be fetched into the expert cache before
#: the requests in it fail with :class:`UnitsUnavailable` (a slab of a 671B model's expert is ~7 MB
#: per tensor: seconds on any link that can serve it)
FETCH_BOUND_S = 30.0


class Dispatcher(Routing, Verification):
    """Routes groups to owners; the local bank computes what no healthy owner holds."""

    def __init__(self, local: ExpertBank, owners: list[Owner] | None = None, *, fallback: bool = True,
                 backoff_s: float = 30.0, slow_backoff_s: float = 5.0, hot_experts: bool = False,
                 verifier: Verifier | None = None, ledger: ContributionLedger | None = None,
                 on_mismatch: Callable[[str, Any], object] | None = None):
        """The market's collaborators (p2pswarm.market): a ``verifier`` recomputes a sample of
        remote outputs; a ``ledger`` counts the work used per worker peer (receipts);
        ``on_mismatch(peer, evidence)`` is told of a worker caught returning wrong numbers, after
        it is banned here (default: a warning in the log). The ban keeper that publishes such a
        ban needs the DHT, which is opened after the dispatcher: it sets ``on_mismatch`` then."""
        Routing.__init__(self, backoff_s=backoff_s, slow_backoff_s=slow_backoff_s, hot_experts=hot_experts)
        Verification.__init__(self, verifier, ledger, on_mismatch)
        #: inline-or-thread policy of this process's compute (the local replica's and, through
        #: the Backbone, the dense path's): p2pswarm.offload
        self.offload = Offload()
        self.local = LocalOwner(local, self.offload)
        self.owners = list(owners or [])
        #: bytes to and from every remote owner this dispatcher ever used (p2pswarm.net.wire.counting)
        self.wire = WireBytes()
        for owner in self.owners:
            self.adopt(owner)
        self.fallback = fallback
        self.stats = DispatchStats()
        self.demand = DemandCounter()
        #: the backbone's experts as a bounded cache (--expert-cache): units it lacks go to owners,
        #: and a unit no live owner holds goes to :class:`UnheldOwner` (fetched, or a clear error)
        self.cache: ExpertCache | None = local if isinstance(local, ExpertCache) else None
        self.unheld = UnheldOwner(self)
        #: ``await fetch(layer, experts)``: put units no live owner holds into the cache (the swarm
        #: session's :class:`~p2pswarm.backbone.sessions.cache_fill.CacheFiller`); None: such a unit fails
        self.fetch: Callable[[int, list[int]], Any] | None = None
        self.fetch_bound_s = FETCH_BOUND_S
        #: what checks of units the cache lacks may fetch (p2pswarm.market.verify.CheckFetchBudget;
        #: the swarm session sets it with ``fetch``); None: such picks are not checked
        self.check_budget: Any = None

    def set_wire_precision(self, precision: str | None) -> None:
        """``--wire-precision``: every expert output this backbone combines is rounded to
        ``precision`` ("f16"/"bf16"; None: float32), whoever computed it, and workers send it in
        16 bits (p2pswarm.net.wire.precision); the monolithic run with the same setting gives the
        same bits."""
        if precision is not None and precision not in wire_precision.PRECISIONS:
            raise UserError(f"--wire-precision {precision!r}: choose one of {', '.join(wire_precision.PRECISIONS)}")
        self.local.wire_precision = precision
        for owner in self.owners:
            self.adopt(owner)

    def adopt(self, owner: Owner) -> None:
        """Count ``owner``'s wire bytes into :attr:`wire` too (an owner added after construction,
        e.g. by :class:`~p2pswarm.backbone.owners.libp2p_owner.SwarmOwners`)."""
        if owner.wire is not None:
            owner.wire.parent = self.wire
        if owner.remote:
            owner.wire_precision = self.local.wire_precision
        # Our replica turns rows into the form the owner's kernel takes them in, when it is the
        # same kernel (the same bytes; p2pswarm.engine.ggml.inputs) and P2PSWARM_WIRE_INPUTS is on.
        bank = self.local.bank
        if (owner.remote and owner.kernel == bank.kernel and hasattr(bank, "quantise_input")
                and settings.WIRE_INPUTS.get()):
            owner.input_quantiser = bank

    async def run_groups(self, layer: int, cur: np.ndarray, groups: Groups,
                         taint: dict[str, np.ndarray] | None = None, *, hot: bool = False) -> list[np.ndarray]:
        """Outputs per group, in group order: one request per owner with all the groups it holds
        (:meth:`route`), each answer verified on a sample (:meth:`_verified`).
        ``taint``: see the module doc (rows computed from a remote worker's unverified outputs).
        ``hot``: the hot-expert rule for this call whatever :attr:`hot_experts` says: the MTP
        drafter's (:mod:`p2pswarm.backbone.serving.mtp`), whose drafts wait for every round trip they make.

        No groups (a layer without routed experts: a leading dense-FFN layer routes to nothing)
        is no work: no request, no demand, nothing counted."""
        if not groups:
            return []
        t0 = time.perf_counter()
        return await self._run_routed(layer, cur, groups, self.route(layer, cur, groups, hot=hot), taint, t0)

    async def _run_routed(self, layer: int, cur: np.ndarray, groups: Groups, plan: dict[Owner, list[int]],
                          taint: dict[str, np.ndarray] | None, t0: float) -> list[np.ndarray]:
        """:meth:`run_groups` after its routing: ``plan`` run, counted from ``t0``."""
        cache = self.cache
        # the cache's refill never drops a unit this layer may still compute (here, a fallback, a check)
        pinned = cache.pin(layer, [e for e, _ in groups]) if cache is not None else []
        try:
            results = await self._run_plan(layer, cur, groups, plan, taint)
        finally:
            if cache is not None:
                cache.unpin(pinned)
        self.stats.add_plan(plan, groups, time.perf_counter() - t0)
        return results

    def run_groups_from_thread(self, layer: int, cur: np.ndarray, groups: Groups) -> list[np.ndarray]:
        """:meth:`run_groups` with ``hot``, called from a worker thread trio started (the MTP
        drafter's): routed on the event loop; a plan that is all the local replica's, on a backbone
        holding every expert (no cache whose refill could drop a unit meanwhile), is computed here
        in the calling thread, as :meth:`run_groups_local` computes it, so each chained draft costs
        one wake-up of the loop and not also a hop to a compute thread and back; any other plan
        runs on the loop. (Its counters are bumped from this thread: plain integers, a lost
        increment at worst.)"""
        if not groups:
            return []
        t0 = time.perf_counter()
        plan = trio.from_thread.run_sync(partial(self.route, layer, cur, groups, hot=True))
        if self.cache is not None or list(plan) != [self.local]:
            return trio.from_thread.run(partial(self._run_routed, layer, cur, groups, plan, None, t0))
        tc = time.perf_counter()
        outs = self.local.forward_groups(layer, cur, groups)
        self._local_measured(time.perf_counter() - tc, sum(len(idx) for _, idx in groups))
        self.stats.add_plan(plan, groups, time.perf_counter() - t0)
        return outs

    async def _run_plan(self, layer: int, cur: np.ndarray, groups: Groups, plan: dict[Owner, list[int]],
                        taint: dict[str, np.ndarray] | None) -> list[np.ndarray]:
        """Every owner's groups of ``plan`` at once; the outputs in group order (the first error raised)."""
        results: list[np.ndarray | None] = [None] * len(groups)
        checks = self.layer_checks(layer, groups, plan)  # all owners' picks: one local call

        async def one(owner: Owner, which: list[int]) -> None:
            outs = await self._owner_outputs(owner, layer, cur, [groups[i] for i in which], taint, checks)
            for i, out in zip(which, outs):
                results[i] = out

        # two or more remote owners: the rows' input form made once for all (LayerInputs); the
        # tasks started below see it, other layers' tasks (another micro-batch's) do not
        shared = LAYER_INPUTS.set(LayerInputs(layer, cur)) if sum(o.remote for o in plan) > 1 else None
        try:
            async with trio.open_nursery() as nursery:
                if checks is not None and checks.picks:
                    nursery.start_soon(self.check_layer, layer, cur, groups, plan, checks)
                for owner, which in plan.items():
                    nursery.start_soon(one, owner, which)
        except BaseExceptionGroup as group:
            raise first_error(group) from None
        finally:
            if shared is not None:
                LAYER_INPUTS.reset(shared)
        return results  # type: ignore[return-value]  # (every slot filled: each group has an owner)

    async def _owner_outputs(self, owner: Owner, layer: int, cur: np.ndarray, owner_groups: Groups,
                             taint: dict[str, np.ndarray] | None, checks: LayerChecks | None = None
                             ) -> list[np.ndarray]:
        """One owner's outputs for its groups: its answer, verified on a sample where it is remote
        (:meth:`_verified`), or the local replica's after it failed (:meth:`_fall_back`).
        ``checks``: the layer's picks, recomputed in one local call for all owners (else this
        owner's are drawn and recomputed here)."""
        if checks is not None:
            picked = checks.picks.get(owner, [])
        else:
            picked = (self.verifier.pick(peer_of(owner), owner_groups, self.exact_rows)
                      if owner.remote and self.verifier is not None else [])
        for_check: list[int] = []  # units the cache lacks, fetched to check the picks on them
        held: list[tuple[int, int]] = []  # cached units the checks compute on: pinned until done
        if picked and self.cache is not None:
            picked, for_check, held = check_fetch.checkable(self, layer, owner_groups, picked)
        try:
            refs: list[np.ndarray] = []
            try:
                tc = time.perf_counter()
                if picked and checks is None:
                    outs, refs, picked = await self._compute_checked(owner, layer, cur, owner_groups, picked, for_check)
                else:
                    outs = await owner.compute(layer, cur, owner_groups)
                if owner.remote:
                    self._measured(owner, time.perf_counter() - tc, sum(len(idx) for _, idx in owner_groups))
                else:
                    self._local_measured(time.perf_counter() - tc, sum(len(idx) for _, idx in owner_groups))
                if picked and checks is not None:
                    refs = await checks.refs_for(owner)  # (the owner's speed above: its round trip alone)
                if len(outs) != len(owner_groups) or any(
                    o.shape != (len(idx), cur.shape[1]) for o, (_, idx) in zip(outs, owner_groups)
                ):
                    raise WorkerError(f"{owner.name} returned outputs of the wrong shape", peer=owner.peer)
            except WorkerError as exc:
                if not owner.remote or not self.fallback:
                    raise
                return await self._fall_back(owner, layer, cur, owner_groups, exc)
            if not owner.remote:
                return outs
            return await self._verified(owner, layer, cur, owner_groups, outs, picked, refs, taint)
        finally:
            if held and self.cache is not None:
                self.cache.unpin(held)

    async def _fall_back(self, owner: Owner, layer: int, cur: np.ndarray, owner_groups: Groups,
                         exc: WorkerError) -> list[np.ndarray]:
        """The local replica's outputs for a remote owner that failed; the owner is backed off."""
        backoff = self.back_off(owner, exc)
        self.stats.fallbacks += 1
        if isinstance(exc, WorkerSlow):
            self.stats.deadline_misses += 1
        log.warning("worker %s failed on layer %d (%s): fell back to %s for %d experts;"
                    " avoiding it for %.0f s", owner.name, layer, exc,
                    "the local replica" if self.cache is None else "another replica or the expert cache",
                    len(owner_groups), backoff)
        return await self.recompute(layer, cur, owner_groups)

    async def recompute(self, layer: int, cur: np.ndarray, groups: Groups,
                        taint: dict[str, np.ndarray] | None = None) -> list[np.ndarray]:
        """Groups an owner failed (or lied) on, computed elsewhere: on the local replica where it
        holds them all (always, without an expert cache), else routed again - the failed owner is
        backed off or banned by now, so another replica, the cache or a fetch takes them."""
        if all(self.local.holds(layer, e) for e, _ in groups):
            # (pinned: a unit held for a concurrent check is dropped when that check ends)
            pins = self.cache.pin(layer, [e for e, _ in groups]) if self.cache is not None else []
            try:
                return await self.local.compute(layer, cur, groups)
            finally:
                if pins and self.cache is not None:
                    self.cache.unpin(pins)
        return await self._run_plan(layer, cur, groups, self._assign(layer, groups), taint)

    async def obtain(self, layer: int, experts: list[int]) -> None:
        """Units of ``layer`` no live owner holds, put into the expert cache (``fetch``) within
        ``fetch_bound_s``; :class:`UnitsUnavailable` naming those it could not get."""
        cache = self.cache
        if cache is not None:
            cache.stats.no_owner.update((layer, e) for e in experts)
        if self.fetch is not None:
            with trio.move_on_after(self.fetch_bound_s):
                await self.fetch(layer, experts)
        missing = [e for e in experts if not self.local.holds(layer, e)]
        if missing:
            how = (f"and none could be fetched within {self.fetch_bound_s:.0f} s" if self.fetch is not None
                   else "and this backbone fetches none (no --token for shard downloads)")
            raise UnitsUnavailable(f"no live owner holds expert(s) {', '.join(map(str, missing))} of layer {layer} "
                                   f"(coverage units {', '.join(sorted({f'L{layer}/E{e}' for e in missing}))}), "
                                   f"the backbone's expert cache lacks them {how}", layer=layer, experts=missing)

    @property
    def all_local(self) -> bool:
        """No owner but the local replica (a monolithic backbone): every layer is one local call."""
        return not self.owners and (self.cache is None or self.cache.complete)

    def run_groups_local(self, layer: int, cur: np.ndarray, groups: Groups) -> list[np.ndarray]:
        """:meth:`run_groups` when :attr:`all_local`, synchronously in the caller's thread: the
        backbone then runs a whole step in one thread hop instead of two more per layer."""
        if not groups:  # a layer without routed experts (see run_groups)
            return []
        t0 = time.perf_counter()
        outs = self.local.forward_groups(layer, cur, groups)
        self.ran_locally(layer, groups, time.perf_counter() - t0)
        return outs

    def ran_locally(self, layer: int, groups: Groups, seconds: float) -> None:
        """Count groups computed on the local replica outside :meth:`run_groups_local` (the
        backbone's layer graph computed them in front of the next layer: the same demand and stats)."""
        self.demand.add(layer, groups)
        self.stats.add_plan({self.local: list(range(len(groups)))}, groups, seconds)

    async def aclose(self) -> None:
        for o in self.owners:
            await o.aclose()
