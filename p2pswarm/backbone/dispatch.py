"""Dispatch one layer's expert work to whoever owns each expert, with the local replica as fallback.

The backbone hands :meth:`Dispatcher.run_groups` the rows ``cur`` of one layer and the groups
``[(expert, token indices), ...]`` the router chose. The dispatcher

1. routes: assigns each group to an owner that holds the expert (a worker, or the local bank;
   :meth:`Dispatcher.route`);
2. sends *one* request per owner with all its groups, to all owners concurrently;
3. on an owner's error or timeout, recomputes that owner's groups on the local replica (the
   backbone holds every expert) and avoids the owner for a back-off period (one that only
   missed its deadline is used again as soon as its late reply arrives: it was late, not hung);
4. verifies a sample of a remote answer (below; :meth:`Dispatcher._verified`);
5. returns the outputs per group; the caller combines them in top-k order, so arrival order never
   matters and the result is bit-identical whoever computed what.

With a :class:`~p2pswarm.market.verify.Verifier` it also recomputes a random sample of each
remote owner's groups on the local replica, beside the request, and compares them bit for bit; a
mismatch bans the owner here (``banned``), tells ``on_mismatch``, and the step uses the replica's
outputs for all of that owner's groups. A ``ledger`` credits each owner's used work (receipts).

Taints. A caller that passes ``taint`` (a dict) to :meth:`Dispatcher.run_groups` learns which rows
of ``cur`` were computed from a remote worker's *unverified* outputs: ``taint[peer]`` is a boolean
row mask, OR-ed in place (rows of groups that were checked and matched are not marked; a caught
worker's rows are the replica's and are not marked either). The backbone folds it into each
sequence's state, so that when the worker is banned later - caught here, or by a ban record another
backbone signed - the scheduler can rewind exactly the sequences that used its rows (docs/market.md,
"Replay on ban"). ``ban_epoch`` counts bans, so a caller can notice a new one with one comparison.

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
from p2pswarm.net import wire_precision
from p2pswarm.net.wire_bytes import WireBytes
from p2pswarm.offload import Offload

from p2pswarm.backbone import check_fetch
from p2pswarm.backbone.dispatch_stats import DemandCounter, DispatchStats
from p2pswarm.backbone.expert_cache import ExpertCache
from p2pswarm.backbone.local_owners import InProcessOwner, LocalOwner, UnheldOwner, pack_rows, peer_of

# the owners and counters split into their own modules, importable from here as before
__all__ = ["DemandCounter", "DispatchStats", "Dispatcher", "InProcessOwner", "LocalOwner", "UnheldOwner",
           "pack_rows", "peer_of", "FETCH_BOUND_S", "HOT_PROBE_S"]

from p2pswarm.market.verify import mark_unverified

if TYPE_CHECKING:
    from p2pswarm.market.receipts import ContributionLedger
    from p2pswarm.market.verify import Check, Verifier

log = logging.getLogger("p2pswarm.backbone")

#: the hot-expert path sends an owner it keeps local a probe (its share of the layer, in the
#: background: the step does not wait for it) at most this often, so that its round trip is
#: measured again: without requests an owner's estimate never changes, and a fast owner measured
#: once slow (a congested link, a phone waking up) would stay unused for good
HOT_PROBE_S = 2.0
#: weight of the newest request in an owner's seconds-per-pair estimate (Dispatcher._finish_s)
OWNER_RATE_EWMA = 0.2

#: how long a step waits for units no live owner holds to be fetched into the expert cache before
#: the requests in it fail with :class:`UnitsUnavailable` (a slab of a 671B model's expert is ~7 MB
#: per tensor: seconds on any link that can serve it)
FETCH_BOUND_S = 30.0


class Dispatcher:
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
        #: inline-or-thread policy of this process's compute (the local replica's and, through
        #: the Backbone, the dense path's): p2pswarm.offload
        self.offload = Offload()
        self.local = LocalOwner(local, self.offload)
        self.owners = list(owners or [])
        #: bytes to and from every remote owner this dispatcher ever used (p2pswarm.net.wire_bytes)
        self.wire = WireBytes()
        for owner in self.owners:
            self.adopt(owner)
        self.fallback = fallback
        self.backoff_s = backoff_s
        self.slow_backoff_s = slow_backoff_s  # after a missed deadline (WorkerSlow), not a failure
        self._down_until: dict[str, float] = {}
        self._slow_since: dict[str, float] = {}  # owner -> when it last missed a deadline (backed off)
        self.stats = DispatchStats()
        self.demand = DemandCounter()
        #: compute locally whatever a slow owner would take longer to return (see _keep_hot_local)
        self.hot_experts = hot_experts
        self.local_row_s: float | None = None  # EWMA: local seconds per (row, expert) computed
        #: EWMA per remote owner: seconds of a round trip per (expert, row) pair it was sent, its
        #: measured speed (link and compute together): replicas share a layer's groups by it (_assign)
        self.owner_row_s: dict[str, float] = {}
        self.hot_probe_s = HOT_PROBE_S
        self._asked_at: dict[str, float] = {}  # owner name -> time.monotonic() of its last request or probe
        self._probing: set[str] = set()  # owners with a probe in flight
        self.verifier = verifier
        self.ledger = ledger
        self.on_mismatch = on_mismatch
        self.banned: dict[str, str] = {}  # worker peer id -> why it gets no requests
        self.ban_epoch = 0  # bumped by every new ban: sequences tainted by the peer must be replayed
        #: fn(peer) told of every new ban (the scheduler wakes up for it)
        self.ban_listeners: list[Callable[[str], object]] = []
        #: the backbone's experts as a bounded cache (--expert-cache): units it lacks go to owners,
        #: and a unit no live owner holds goes to :class:`UnheldOwner` (fetched, or a clear error)
        self.cache: ExpertCache | None = local if isinstance(local, ExpertCache) else None
        self.unheld = UnheldOwner(self)
        #: ``await fetch(layer, experts)``: put units no live owner holds into the cache (the swarm
        #: session's :class:`~p2pswarm.backbone.cache_fill.CacheFiller`); None: such a unit fails
        self.fetch: Callable[[int, list[int]], Any] | None = None
        self.fetch_bound_s = FETCH_BOUND_S
        #: what checks of units the cache lacks may fetch (p2pswarm.market.verify.CheckFetchBudget;
        #: the swarm session sets it with ``fetch``); None: such picks are not checked
        self.check_budget: Any = None

    @property
    def exact_rows(self) -> int:
        """Groups of at most this many rows may be checked on their selected rows alone (the local
        replica's measurement: :attr:`LocalOwner.exact_rows`)."""
        return self.local.exact_rows

    def set_wire_precision(self, precision: str | None) -> None:
        """``--wire-precision``: every expert output this backbone combines is rounded to
        ``precision`` ("f16"/"bf16"; None: float32), whoever computed it, and workers send it in
        16 bits (p2pswarm.net.wire_precision); the monolithic run with the same setting gives the
        same bits."""
        if precision is not None and precision not in wire_precision.PRECISIONS:
            raise UserError(f"--wire-precision {precision!r}: choose one of {', '.join(wire_precision.PRECISIONS)}")
        self.local.wire_precision = precision
        for owner in self.owners:
            self.adopt(owner)

    def adopt(self, owner: Owner) -> None:
        """Count ``owner``'s wire bytes into :attr:`wire` too (an owner added after construction,
        e.g. by :class:`~p2pswarm.backbone.libp2p_owner.SwarmOwners`)."""
        if owner.wire is not None:
            owner.wire.parent = self.wire
        if owner.remote:
            owner.wire_precision = self.local.wire_precision
        # Our replica turns rows into the form the owner's kernel takes them in, when it is the
        # same kernel (the same bytes; p2pswarm.engine.ggml_inputs) and P2PSWARM_WIRE_INPUTS is on.
        bank = self.local.bank
        if (owner.remote and owner.kernel == bank.kernel and hasattr(bank, "quantise_input")
                and settings.WIRE_INPUTS.get()):
            owner.input_quantiser = bank

    def ban(self, peer: str, reason: str) -> None:
        """Send ``peer`` nothing from now on (its experts go to another owner or the local replica)."""
        if peer not in self.banned:
            self.banned[peer] = reason
            self.ban_epoch += 1
            for fn in self.ban_listeners:
                fn(peer)

    def clear_backoff(self, name: str) -> bool:
        """Use owner ``name`` again at once (it restarted: a newer signed record says so)."""
        return self._down_until.pop(name, None) is not None

    def healthy(self, owner: Owner) -> bool:
        """False while ``owner`` is banned or backed off (it failed or missed its deadline recently)."""
        if self.banned and peer_of(owner) in self.banned:
            return False
        until = self._down_until.get(owner.name)
        if until is None:
            return True
        if time.monotonic() >= until:
            return True
        since = self._slow_since.get(owner.name)
        recovered = owner.recovered_at
        if since is not None and recovered is not None and recovered > since:
            # it missed a deadline, then its late reply came: it is not hung, use it again now
            self._down_until.pop(owner.name, None)
            self._slow_since.pop(owner.name, None)
            self.stats.recoveries += 1
            return True
        return False

    def assign(self, layer: int, groups: Groups) -> dict[Owner, Groups]:
        return {o: [groups[i] for i in idx] for o, idx in self._assign(layer, groups).items()}

    def _assign(self, layer: int, groups: Groups, kept: dict[Owner, list[int]] | None = None,
                hot: bool = False) -> dict[Owner, list[int]]:
        """Owner -> indices of the groups it computes (an expert may have several groups).
        ``kept``, if given, receives the owners the hot-expert path kept local, with their groups;
        ``hot``: that path for this call even where :attr:`hot_experts` is off (the MTP drafter)."""
        plan: dict[Owner, list[int]] = {}
        local = self.local
        pairs: dict[Owner, int] = {}  # (expert, row) pairs given to each owner so far this layer
        live, held_by = [o for o in self.owners if self.healthy(o)], dict[int, list[Owner]]()  # found once an expert
        for i, (e, idx) in enumerate(groups):  # (its groups are many in the batch-invariant mode)
            holders = held_by[e] if e in held_by else held_by.setdefault(e, [o for o in live if o.holds(layer, e)])
            if len(holders) > 1:
                owner = min(holders, key=lambda o: self._finish_s(o, pairs.get(o, 0) + len(idx)))
            elif holders:
                owner = holders[0]
            else:  # the local replica, or (a unit the expert cache lacks) fetched first
                owner = local if local.holds(layer, e) else self.unheld
            plan.setdefault(owner, []).append(i)
            pairs[owner] = pairs.get(owner, 0) + len(idx)
        if self.hot_experts or hot:
            moved = self._keep_hot_local(layer, plan, groups, predicted=hot)
            if kept is not None:
                kept.update(moved)
        return plan

    def _finish_s(self, owner: Owner, pairs: int) -> float:
        """When ``owner`` would be done with ``pairs`` (expert, row) pairs this layer, at its measured
        seconds per pair (:attr:`owner_row_s`), behind the requests it already has in flight.

        Why: with replicas of a unit, the first holder used to take every group of it, so a second
        replica added no throughput, and on unequal devices a slow one set the step time whenever
        it was first. Giving each group to the replica that would finish it first shares a layer's
        groups in proportion to measured speed: a device at 0.1 of a core gets about a quarter of
        what one at 0.4 gets, and both finish about together. An owner not measured yet counts as
        fast as the fastest one measured (0 when none is), so it gets work and is measured."""
        rate = self.owner_row_s.get(owner.name)
        if rate is None:
            rate = min(self.owner_row_s.values(), default=0.0)
        return rate * (pairs + getattr(owner, "inflight", 0) * max(1, pairs))

    def _local_measured(self, seconds: float, pairs: int) -> None:
        """Local compute of ``pairs`` (expert, row) pairs into :attr:`local_row_s` (EWMA)."""
        if pairs:
            r = seconds / pairs
            self.local_row_s = r if self.local_row_s is None else 0.7 * self.local_row_s + 0.3 * r

    def _measured(self, owner: Owner, seconds: float, pairs: int) -> None:
        """One answered remote request into the owner's seconds-per-pair EWMA (:meth:`_finish_s`)."""
        if pairs:
            r = seconds / pairs
            old = self.owner_row_s.get(owner.name)
            self.owner_row_s[owner.name] = r if old is None else (1 - OWNER_RATE_EWMA) * old + OWNER_RATE_EWMA * r

    def _keep_hot_local(self, layer: int, plan: dict[Owner, list[int]], groups: Groups,
                        predicted: bool = False) -> dict[Owner, list[int]]:
        """The hot-expert path: an owner whose expected round trip for this request (its measured
        round trips, by request size where it fits them: a link's bandwidth makes a big request
        slower, see ``remote_s``) is longer than computing its groups here (on top of what is
        already local this layer) gets no request; the local
        replica computes them, with the same kernel, so the result is the same bits (only an owner
        whose groups are all in the local expert cache: the others need the owner anyway). Returns the
        owners kept local, with their groups (:meth:`run_groups` probes them now and then).
        ``predicted``: an owner with no measured ``rtt_s`` counts too where its ``predict_s`` fits
        its recent requests (a worker process on a socket: the MTP drafter's ``hot`` calls)."""
        moved: dict[Owner, list[int]] = {}
        rate = self.local_row_s
        local = plan.get(self.local, [])
        local_s = 0.0 if rate is None else rate * sum(len(groups[i][1]) for i in local)

        def remote_s(owner: Owner) -> float:
            """The owner's expected round trip for this request: by its size where the owner fits
            one to its recent requests (a capped link: SocketOwner.predict_s), else its EWMA."""
            est = owner.predict_s(sum(len(groups[i][1]) for i in plan[owner]))
            if est is not None:
                return est
            assert owner.rtt_s is not None  # (only measured owners are considered: predicted above)
            return owner.rtt_s

        def measured(owner: Owner) -> bool:
            return owner.rtt_s is not None or (predicted and owner.predict_s(1) is not None)

        remote = sorted(((remote_s(o), o) for o in plan if o.remote and measured(o)), key=lambda so: -so[0])
        for wait_s, owner in remote:
            if self.cache is not None and not all(self.local.holds(layer, groups[i][0]) for i in plan[owner]):
                continue
            rows = sum(len(groups[i][1]) for i in plan[owner])
            if rate is None:  # never measured: compute one owner's share here once, and time it
                cost = 0.0
            else:
                cost = rate * rows
            if local_s + cost < wait_s:
                moved[owner] = plan.pop(owner)
                local = local + moved[owner]
                local_s += cost
                if rate is None:
                    break
        if local:
            plan[self.local] = sorted(local)
        return moved

    def _probe(self, owner: Owner, layer: int, cur: np.ndarray, groups: Groups) -> None:
        """Send ``owner`` its share of this layer in the background, only to measure its round trip
        again (the owner's own estimate, ``rtt_s``, learns from every answered request); the
        outputs are dropped - the local replica's are the ones used - so a probe is neither
        verified nor credited. A failed probe backs the owner off like a failed request (no work,
        no probes for ``backoff_s``: a dead worker is not dialled every 2 s), and is logged."""
        rows, local_groups = pack_rows(cur, groups)
        rows = np.array(rows)  # a copy: the task runs after this layer, and the caller reuses its rows
        self._probing.add(owner.name)
        self.stats.probes += 1

        async def probe() -> None:
            try:
                await owner.compute(layer, rows, local_groups)
            except Exception as exc:  # a probe must never crash the run (a system task)
                self._down_until[owner.name] = time.monotonic() + self.backoff_s
                log.info("probe of worker %s on layer %d failed (%s): avoiding it for %.0f s",
                         owner.name, layer, exc, self.backoff_s)
            finally:
                self._probing.discard(owner.name)

        trio.lowlevel.spawn_system_task(probe, name=f"probe of {owner.name}")

    async def run_groups(self, layer: int, cur: np.ndarray, groups: Groups,
                         taint: dict[str, np.ndarray] | None = None, *, hot: bool = False) -> list[np.ndarray]:
        """Outputs per group, in group order: one request per owner with all the groups it holds
        (:meth:`route`), each answer verified on a sample (:meth:`_verified`).
        ``taint``: see the module doc (rows computed from a remote worker's unverified outputs).
        ``hot``: the hot-expert rule for this call whatever :attr:`hot_experts` says: the MTP
        drafter's (:mod:`p2pswarm.backbone.mtp`), whose drafts wait for every round trip they make.

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

        async def one(owner: Owner, which: list[int]) -> None:
            outs = await self._owner_outputs(owner, layer, cur, [groups[i] for i in which], taint)
            for i, out in zip(which, outs):
                results[i] = out

        try:
            async with trio.open_nursery() as nursery:
                for owner, which in plan.items():
                    nursery.start_soon(one, owner, which)
        except BaseExceptionGroup as group:
            raise first_error(group) from None
        return results  # type: ignore[return-value]  # (every slot filled: each group has an owner)

    def route(self, layer: int, cur: np.ndarray, groups: Groups, *, hot: bool = False) -> dict[Owner, list[int]]:
        """Routing: which owner computes which groups (indices into ``groups``): the first healthy
        owner that holds the expert, the local replica for the rest, and with ``hot_experts`` (or
        ``hot``) the local replica also for what a slow owner would take longer to return (with
        ``hot_experts``, those owners are probed now and then in the background). Counts the demand."""
        self.demand.add(layer, groups)
        if self.cache is not None:
            self.cache.count(layer, groups)
        kept: dict[Owner, list[int]] = {}
        plan = self._assign(layer, groups, kept, hot)
        # when each owner was last asked, and probes of those kept local (not for a ``hot`` call
        # alone: the trunk's layers, computed by the same owners, keep measuring their round trips)
        if self.hot_experts:
            now = time.monotonic()
            for owner in plan:
                if owner.remote:
                    self._asked_at[owner.name] = now
            for owner, which in kept.items():
                asked = self._asked_at.setdefault(owner.name, now)
                if owner.name not in self._probing and now - asked >= self.hot_probe_s:
                    self._asked_at[owner.name] = now
                    self._probe(owner, layer, cur, [groups[i] for i in which])
        return plan

    async def _owner_outputs(self, owner: Owner, layer: int, cur: np.ndarray, owner_groups: Groups,
                             taint: dict[str, np.ndarray] | None) -> list[np.ndarray]:
        """One owner's outputs for its groups: its answer, verified on a sample where it is remote
        (:meth:`_verified`), or the local replica's after it failed (:meth:`_fall_back`)."""
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
                if picked:
                    outs, refs, picked = await self._compute_checked(owner, layer, cur, owner_groups, picked, for_check)
                else:
                    outs = await owner.compute(layer, cur, owner_groups)
                if owner.remote:
                    self._measured(owner, time.perf_counter() - tc, sum(len(idx) for _, idx in owner_groups))
                else:
                    self._local_measured(time.perf_counter() - tc, sum(len(idx) for _, idx in owner_groups))
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
        # a hung worker may come back (SIGCONT, a phone waking up): try it again soon
        slow = isinstance(exc, WorkerSlow)
        backoff = min(self.slow_backoff_s, self.backoff_s) if slow else self.backoff_s
        self._down_until[owner.name] = time.monotonic() + backoff
        if slow:
            self._slow_since[owner.name] = time.monotonic()
        else:
            self._slow_since.pop(owner.name, None)  # a real failure: no late reply ends it
        self.stats.fallbacks += 1
        if slow:
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

    # -- verification (module doc; p2pswarm.market.verify) ----------------------------------------
    async def _verified(self, owner: Owner, layer: int, cur: np.ndarray, owner_groups: Groups,
                        outs: list[np.ndarray], picked: list[Check], refs: list[np.ndarray],
                        taint: dict[str, np.ndarray] | None) -> list[np.ndarray]:
        """A remote owner's answer after its sampled rows were checked (:meth:`_accept`); the rows
        used unverified are marked in ``taint``."""
        outs, trusted = await self._accept(owner, layer, cur, owner_groups, outs, picked, refs)
        if trusted and taint is not None and sum(len(at) for _, at in picked) < sum(
                len(idx) for _, idx in owner_groups):
            mark_unverified(taint, peer_of(owner), len(cur), owner_groups, picked)
        return outs

    async def _compute_checked(self, owner: Owner, layer: int, cur: np.ndarray, groups: Groups,
                               picked: list[Check], for_check: list[int] | None = None
                               ) -> tuple[list[np.ndarray], list[np.ndarray], list[Check]]:
        """The owner's outputs and the local replica's for the picked rows of the picked groups,
        computed side by side (the check costs the step max(round trip, local compute), not their
        sum); the units in ``for_check`` are fetched first (:func:`check_fetch.fetch_for_check`), beside the
        request too, and dropped after. Returns (outputs, references, the picks checked: those on
        a unit that could not be fetched are left out)."""
        got: dict[str, Any] = {"picked": picked}

        async def remote() -> None:
            got["outs"] = await owner.compute(layer, cur, groups)

        async def local() -> None:
            pins: list[tuple[int, int]] = []
            try:
                if for_check:
                    pins = await check_fetch.fetch_for_check(self, layer, for_check)
                    fetched = {e for _, e in pins}  # (the others are cached and pinned: checkable)
                    got["picked"] = [(i, at) for i, at in picked
                                     if int(groups[i][0]) not in for_check or int(groups[i][0]) in fetched]
                got["refs"] = await self.local.compute(layer, cur, [(groups[i][0], groups[i][1][at])
                                                                    for i, at in got["picked"]])
            finally:
                if for_check:
                    check_fetch.release(self, layer, pins, len(for_check))

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(remote)
                nursery.start_soon(local)
        except BaseExceptionGroup as group:
            raise first_error(group) from None
        return got["outs"], got["refs"], got["picked"]

    async def _accept(self, owner: Owner, layer: int, cur: np.ndarray, groups: Groups, outs: list[np.ndarray],
                      picked: list[Check], refs: list[np.ndarray]) -> tuple[list[np.ndarray], bool]:
        """Check a remote answer's sampled rows (``picked``: Verifier.pick's); on a mismatch ban the
        worker and use the local replica's outputs for *all* its groups; otherwise count the work for its receipts.
        Returns (outputs, whether they are the worker's). A worker banned while its answer was on
        the way (another request caught it, or a ban record arrived) is not used either."""
        peer = peer_of(owner)
        if peer in self.banned:
            return await self.recompute(layer, cur, groups), False
        self.stats.verified_groups += len(picked)
        if self.verifier is not None:
            evidence = self.verifier.check(peer, layer, cur, groups, outs, picked, refs)
            if evidence is not None:
                self.stats.mismatches += 1
                self.ban(peer, evidence.summary())
                if self.on_mismatch is not None:
                    self.on_mismatch(peer, evidence)
                else:
                    log.warning("BANNED worker %s: %s", peer, evidence.summary())
                # checks may have covered some rows of a group only: recompute every group here
                return await self.recompute(layer, cur, groups), False
        if self.ledger is not None:
            self.ledger.add(peer, sum(len(idx) for _, idx in groups), sum(int(o.nbytes) for o in outs))
        return outs, True

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
        self.demand.add(layer, groups)
        outs = self.local.forward_groups(layer, cur, groups)
        s = self.stats
        s.layers += 1
        s.seconds += time.perf_counter() - t0
        s.local_groups += len(groups)
        s.per_owner[self.local.name] = s.per_owner.get(self.local.name, 0) + len(groups)
        return outs

    async def aclose(self) -> None:
        for o in self.owners:
            await o.aclose()
