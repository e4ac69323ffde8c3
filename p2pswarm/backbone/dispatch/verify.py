"""Verification and taint, the dispatcher's second concern (docs/market.md; p2pswarm.market.verify).

With a :class:`~p2pswarm.market.verify.Verifier` the dispatcher recomputes a random sample of each
remote owner's groups on the local replica, beside the request, and compares them bit for bit (:meth:`Verification._accept`); a mismatch bans the owner here
(:class:`Bans`), tells ``on_mismatch``, and the step uses the replica's outputs for all of that
owner's groups. A ``ledger`` credits each owner's used work (receipts).

Taints. A caller that passes ``taint`` (a dict) to ``Dispatcher.run_groups`` learns which rows of
``cur`` were computed from a remote worker's *unverified* outputs: ``taint[peer]`` is a boolean
row mask, OR-ed in place (rows of groups that were checked and matched are not marked; a caught
worker's rows are the replica's and are not marked either). The backbone folds it into each
sequence's state, so that when the worker is banned later - caught here, or by a ban record another
backbone signed - the scheduler can rewind exactly the sequences that used its rows (docs/market.md,
"Replay on ban"). :attr:`Bans.epoch` counts bans, so a caller notices a new one with one comparison.

Split from :mod:`p2pswarm.backbone.dispatch.dispatcher` by concern: :class:`Verification` is a base of
:class:`~p2pswarm.backbone.dispatch.dispatcher.Dispatcher`; :class:`Bans` is the one object the scheduler and
the ban keeper are given (no reach through the dispatcher for ban events).

One local call per layer. Where the backbone holds every expert (no expert cache), the picks of
all remote owners of a layer are drawn when the layer's requests go out and recomputed in *one*
call to the local replica (:class:`LayerChecks`), beside all the requests: one ggml graph (and one
thread hop, or none) per layer instead of one per owner; a picked group's bits do not depend on the
other groups of the call (``GgmlExperts.forward_groups``). With an expert cache, a pick may need
its unit fetched first, per owner: :meth:`Verification._compute_checked` does that per owner."""
from __future__ import annotations

import logging
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import trio

from p2pswarm.contracts import Groups, Owner
from p2pswarm.engine.ggml.cpu_share import GRAPH_THREAD_CAP
from p2pswarm.errors import first_error
from p2pswarm.market.verify import mark_unverified

from p2pswarm.backbone.dispatch import check_fetch
from p2pswarm.backbone.dispatch.stats import DispatchStats
from p2pswarm.backbone.owners.expert_cache import ExpertCache
from p2pswarm.backbone.owners.local_owners import LocalOwner, peer_of

if TYPE_CHECKING:
    from p2pswarm.market.receipts import ContributionLedger
    from p2pswarm.market.verify import Check, Verifier

log = logging.getLogger("p2pswarm.backbone")

#: ggml threads a spot check's recomputation may use: one. It runs beside the request it checks (its
#: wall time hides behind the round trip) on the backbone's own CPU, and one row of one expert on two
#: threads cost 1.6-2.5x the CPU of one thread for no wall time back (cpu_share.GRAPH_THREAD_CAP)
CHECK_THREADS = 1


class Bans:
    """The worker peers this backbone sends nothing (caught here, or a ban record honoured), why,
    and who is told of a new one: the scheduler replays the sequences that used a banned peer's
    unverified rows, the swarm session tells the worker (a ``refused`` notice)."""

    def __init__(self) -> None:
        self.banned: dict[str, str] = {}  # worker peer id -> why it gets no requests
        self.epoch = 0  # bumped by every new ban: sequences tainted by the peer must be replayed
        #: fn(peer) told of every new ban (the scheduler wakes up for it)
        self.listeners: list[Callable[[str], object]] = []

    def ban(self, peer: str, reason: str) -> None:
        """Send ``peer`` nothing from now on (its experts go to another owner or the local replica)."""
        if peer not in self.banned:
            self.banned[peer] = reason
            self.epoch += 1
            for fn in self.listeners:
                fn(peer)


class LayerChecks:
    """Every remote owner's picks of one layer (``picks``, :meth:`Verifier.pick`'s, drawn per
    owner as before: one random stream per worker, so the rows checked do not depend on how the
    owners are batched), recomputed in one local call by :meth:`Verification.check_layer`;
    ``refs[owner]``: the replica's outputs for that owner's picks, once ``done`` is set."""

    def __init__(self, picks: dict[Owner, list[Check]]):
        self.picks = picks
        self.refs: dict[Owner, list[np.ndarray]] = {}
        self.done = trio.Event()

    async def refs_for(self, owner: Owner) -> list[np.ndarray]:
        await self.done.wait()
        return self.refs[owner]


class Verification:
    """Checks a sample of every remote answer against the local replica; bans a worker caught."""

    # what verification reads of the dispatcher it is a base of (set in Dispatcher.__init__; the
    # fetch of units a check needs: p2pswarm.backbone.dispatch.check_fetch)
    local: LocalOwner
    stats: DispatchStats
    cache: ExpertCache | None
    fetch: Callable[[int, list[int]], Any] | None
    fetch_bound_s: float
    check_budget: Any
    #: a caught worker's groups computed elsewhere (Dispatcher.recompute)
    recompute: Callable[..., Awaitable[list[np.ndarray]]]

    def __init__(self, verifier: Verifier | None, ledger: ContributionLedger | None,
                 on_mismatch: Callable[[str, Any], object] | None):
        self.verifier = verifier
        self.ledger = ledger
        self.on_mismatch = on_mismatch
        self.bans = Bans()

    @property
    def exact_rows(self) -> int:
        """Groups of at most this many rows may be checked on their selected rows alone (the local
        replica's measurement: :attr:`LocalOwner.exact_rows`)."""
        return self.local.exact_rows

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

    def layer_checks(self, layer: int, groups: Groups, plan: dict[Owner, list[int]]) -> LayerChecks | None:
        """The picks of every remote owner of ``plan``, checked in one local call
        (:meth:`check_layer`); None where each owner's checks run on their own (an expert cache:
        a pick may need its unit fetched, :meth:`_compute_checked`) or nothing is verified."""
        if self.verifier is None or self.cache is not None:
            return None
        picks: dict[Owner, list[Check]] = {}
        for owner, which in plan.items():
            if owner.remote:
                picked = self.verifier.pick(peer_of(owner), [groups[i] for i in which], self.exact_rows)
                if picked:
                    picks[owner] = picked
        return LayerChecks(picks)  # (with no picks too: the owners' draws are made)

    async def check_layer(self, layer: int, cur: np.ndarray, groups: Groups, plan: dict[Owner, list[int]],
                          checks: LayerChecks) -> None:
        """The local replica's outputs for every owner's picked rows in one call, started beside
        the requests (a step waits for max(slowest round trip, the check), not their sum)."""
        rows = [(groups[plan[owner][i]][0], groups[plan[owner][i]][1][at])
                for owner, picked in checks.picks.items() for i, at in picked]
        GRAPH_THREAD_CAP.set(CHECK_THREADS)  # (this task's context only: a nursery task of the step)
        refs = await self.local.compute(layer, cur, rows)
        k = 0
        for owner, picked in checks.picks.items():
            checks.refs[owner] = refs[k:k + len(picked)]
            k += len(picked)
        checks.done.set()

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
            GRAPH_THREAD_CAP.set(CHECK_THREADS)  # (this task's context only)
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
        if peer in self.bans.banned:
            return await self.recompute(layer, cur, groups), False
        self.stats.verified_groups += len(picked)
        if self.verifier is not None:
            evidence = self.verifier.check(peer, layer, cur, groups, outs, picked, refs)
            if evidence is not None:
                self.stats.mismatches += 1
                self.bans.ban(peer, evidence.summary())
                if self.on_mismatch is not None:
                    self.on_mismatch(peer, evidence)
                else:
                    log.warning("BANNED worker %s: %s", peer, evidence.summary())
                # checks may have covered some rows of a group only: recompute every group here
                return await self.recompute(layer, cur, groups), False
        if self.ledger is not None:
            self.ledger.add(peer, sum(len(idx) for _, idx in groups), sum(int(o.nbytes) for o in outs))
        return outs, True
