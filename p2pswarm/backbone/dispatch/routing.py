"""Routing and back-off, the dispatcher's first concern: which owner computes which of a layer's
groups (:meth:`Routing.route`), which owners are avoided for a while (they failed, or missed a
deadline: :meth:`Routing.back_off`, :meth:`Routing.healthy`), how fast each owner is measured to
be (replicas of a unit share its groups by it: :meth:`Routing._finish_s`) and the hot-expert path
(``--hot-experts``: what a slow owner would return later than the local replica computes it stays
local, and such an owner is probed now and then so that its round trip is measured again).

Split from :mod:`p2pswarm.backbone.dispatch.dispatcher` by concern: :class:`Routing` is a base of
:class:`~p2pswarm.backbone.dispatch.dispatcher.Dispatcher` and holds the state only routing reads and writes;
what it reads of the rest of the dispatcher is declared below its docstring."""
from __future__ import annotations

import logging
import math
import time

import numpy as np
import trio

from p2pswarm.contracts import Groups, Owner
from p2pswarm.errors import WorkerError, WorkerSlow

from p2pswarm.backbone.dispatch.stats import DemandCounter, DispatchStats
from p2pswarm.backbone.dispatch.verify import Bans
from p2pswarm.backbone.owners.expert_cache import ExpertCache
from p2pswarm.backbone.owners.local_owners import LocalOwner, UnheldOwner, pack_rows, peer_of

log = logging.getLogger("p2pswarm.backbone")

#: the hot-expert path sends an owner it keeps local a probe (its share of the layer, in the
#: background: the step does not wait for it) at most this often, so that its round trip is
#: measured again: without requests an owner's estimate never changes, and a fast owner measured
#: once slow (a congested link, a phone waking up) would stay unused for good
HOT_PROBE_S = 2.0
#: weight of the newest request in an owner's seconds-per-pair estimate (Routing._finish_s)
OWNER_RATE_EWMA = 0.2
#: a replica given no group for this long gets one (the next group of an expert it holds) so that
#: its speed is measured again: replicas share by measured speed, and one measured slow once (a
#: phone's momentary load, a CPU quota's throttled period) would otherwise never be asked again
#: while a faster replica is healthy. Its cost: one group a second on the slower device.
REPLICA_PROBE_S = 1.0


class Routing:
    """Routes groups to owners: the first healthy holder (or the fastest of several), the local
    replica for the rest, and the back-off of owners that failed."""

    # what routing reads of the dispatcher it is a base of (set in Dispatcher.__init__)
    owners: list[Owner]
    local: LocalOwner
    unheld: UnheldOwner
    cache: ExpertCache | None
    stats: DispatchStats
    demand: DemandCounter
    bans: Bans

    def __init__(self, *, backoff_s: float, slow_backoff_s: float, hot_experts: bool):
        self.backoff_s = backoff_s
        self.slow_backoff_s = slow_backoff_s  # after a missed deadline (WorkerSlow), not a failure
        self._down_until: dict[str, float] = {}
        self._slow_since: dict[str, float] = {}  # owner -> when it last missed a deadline (backed off)
        #: compute locally whatever a slow owner would take longer to return (see _keep_hot_local)
        self.hot_experts = hot_experts
        self.local_row_s: float | None = None  # EWMA: local seconds per (row, expert) computed
        #: EWMA per remote owner: seconds of a round trip per (expert, row) pair it was sent, its
        #: measured speed (link and compute together): replicas share a layer's groups by it (_assign)
        self.owner_row_s: dict[str, float] = {}
        self.hot_probe_s = HOT_PROBE_S
        self._asked_at: dict[str, float] = {}  # owner name -> time.monotonic() of its last request or probe
        self._probing: set[str] = set()  # owners with a probe in flight
        self.replica_probe_s = REPLICA_PROBE_S
        self._given_at: dict[str, float] = {}  # owner name -> time.monotonic() it was last given a group

    def back_off(self, owner: Owner, exc: WorkerError) -> float:
        """Avoid ``owner``, which failed with ``exc``, for a while; returns for how long. One that
        only missed its deadline (:class:`WorkerSlow`) is avoided for ``slow_backoff_s`` at most,
        and used again as soon as its late reply comes (:meth:`healthy`): a hung worker may come
        back (SIGCONT, a phone waking up)."""
        slow = isinstance(exc, WorkerSlow)
        backoff = min(self.slow_backoff_s, self.backoff_s) if slow else self.backoff_s
        self._down_until[owner.name] = time.monotonic() + backoff
        if slow:
            self._slow_since[owner.name] = time.monotonic()
        else:
            self._slow_since.pop(owner.name, None)  # a real failure: no late reply ends it
        return backoff

    def clear_backoff(self, name: str) -> bool:
        """Use owner ``name`` again at once (it restarted: a newer signed record says so)."""
        return self._down_until.pop(name, None) is not None

    def healthy(self, owner: Owner) -> bool:
        """False while ``owner`` is banned or backed off (it failed or missed its deadline recently)."""
        if self.bans.banned and peer_of(owner) in self.bans.banned:
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
        live = [o for o in self.owners if self.healthy(o)]
        holders_of: dict[int, list[Owner]] = {}  # (an expert's groups are many in the batch-invariant mode)
        now = time.monotonic()
        for i, (e, idx) in enumerate(groups):
            holders = holders_of.get(e)
            if holders is None:
                holders = holders_of[e] = [o for o in live if o.holds(layer, e)]
            if len(holders) > 1:
                owner = self._stale_replica(holders, now) or min(
                    holders, key=lambda o: self._finish_s(o, pairs.get(o, 0) + len(idx)))
            elif holders:
                owner = holders[0]
            else:  # the local replica, or (a unit the expert cache lacks) fetched first
                owner = local if local.holds(layer, e) else self.unheld
            plan.setdefault(owner, []).append(i)
            pairs[owner] = pairs.get(owner, 0) + len(idx)
        for owner in plan:
            self._given_at[owner.name] = now
        if self.hot_experts or hot:
            moved = self._keep_hot_local(layer, plan, groups, predicted=hot)
            if kept is not None:
                kept.update(moved)
        return plan

    def _stale_replica(self, holders: list[Owner], now: float) -> Owner | None:
        """A measured holder not given a group for :attr:`replica_probe_s`, marked as given now
        (one group, then the measured speeds decide again); None when every holder is fresh."""
        for o in holders:
            if o.name in self.owner_row_s and now - self._given_at.get(o.name, -math.inf) >= self.replica_probe_s:
                self._given_at[o.name] = now
                return o
        return None

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
