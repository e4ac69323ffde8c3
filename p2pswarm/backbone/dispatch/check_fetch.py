"""Checks of units the backbone's expert cache lacks (p2pswarm.market.verify, "With a partial
expert cache"): which picks can be checked, the fetch of their units' slabs for the check, and
their eviction after it. Split from :mod:`p2pswarm.backbone.dispatch.dispatcher`, whose
``Verification._compute_checked`` (dispatch/verify.py) calls these beside the remote request.

Why fetch at all: with ``--expert-cache none`` the backbone holds no unit, so checks limited to
cached units would check nothing and a lying worker would never be caught. A unit's slabs come
by byte range from any holder (the dispatcher's ``fetch``: the cache filler, every slab checked
against the signed manifest, the checked worker's own shard server included), are held in the
cache only while the check computes (pinned), then dropped; the dispatcher's ``check_budget``
(:class:`~p2pswarm.market.verify.CheckFetchBudget`) bounds the bytes a minute and the units held.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Protocol

import trio

from p2pswarm.backbone.owners.expert_cache import ExpertCache
from p2pswarm.contracts import Groups

if TYPE_CHECKING:
    from p2pswarm.market.verify import Check


class Holder(Protocol):
    """What these checks read of the dispatcher (a Protocol, so this module, below the dispatcher,
    does not import it)."""

    cache: ExpertCache | None
    fetch: Callable[[int, list[int]], Any] | None
    fetch_bound_s: float
    check_budget: Any

    @property
    def local(self) -> Any: ...  # the local replica: .holds(layer, expert)


def checkable(d: Holder, layer: int, groups: Groups, picked: list[Check]
              ) -> tuple[list[Check], list[int], list[tuple[int, int]]]:
    """The picks that can be checked, the units among them to fetch for it, and the pins of the
    cached ones (the caller unpins them once the check is done: a unit cached now may be one a
    concurrent check fetched, which that check drops when it ends). A pick on a cached unit stays;
    one on a unit the cache lacks stays where its bytes can be had: the model's file holds them
    (no fetch, no budget), or ``d.fetch`` and ``d.check_budget`` allow one more unit's slabs. The
    rest are left unchecked (their rows count as used unverified)."""
    cache = d.cache
    assert cache is not None
    keep: list[Check] = []
    fetch: list[int] = []
    refused: set[int] = set()
    budget = d.check_budget
    for i, at in picked:
        e = int(groups[i][0])
        if d.local.holds(layer, e):
            keep.append((i, at))
            continue
        if e not in fetch and e not in refused:
            if d.fetch is not None and (cache.store is None or (budget is not None
                                                                and budget.take(cache.unit_bytes[layer]))):
                fetch.append(e)
            else:
                refused.add(e)
        if e in fetch:
            keep.append((i, at))
        if budget is not None:
            if e in fetch:
                budget.picks_fetched += 1
            else:
                budget.picks_refused += 1
    held = cache.pin(layer, sorted({int(groups[i][0]) for i, _ in keep if int(groups[i][0]) not in fetch}))
    return keep, fetch, held


async def fetch_for_check(d: Holder, layer: int, experts: list[int]) -> list[tuple[int, int]]:
    """Units of ``layer`` fetched into the cache (``d.fetch``) and pinned for a check; returns the
    pins (what :func:`release` unpins and drops). Bounded by ``d.fetch_bound_s``: what does not
    come in time is not checked."""
    cache = d.cache
    assert cache is not None and d.fetch is not None
    with trio.move_on_after(d.fetch_bound_s):
        await d.fetch(layer, experts)
    pins = cache.pin(layer, experts)  # (no checkpoint since the fetch returned: nothing dropped them)
    budget = d.check_budget
    if budget is not None and cache.store is not None:
        budget.checks += len(pins)
        budget.fetched_bytes += len(pins) * cache.unit_bytes[layer]
        budget.failed += len(experts) - len(pins)
    return pins


def release(d: Holder, layer: int, pins: list[tuple[int, int]], n_fetched: int) -> None:
    """After the check: unpin, drop the units (the check's store is bounded: evicted once used;
    one pinned by a running step stays until that step's unpin), free the budget's slots."""
    cache = d.cache
    if cache is None:
        return
    cache.unpin(pins)
    for _, e in pins:
        cache.drop(layer, e)
    if d.check_budget is not None and cache.store is not None:
        d.check_budget.release(n_fetched)
