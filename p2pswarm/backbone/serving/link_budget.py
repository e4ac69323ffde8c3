"""Bytes in the micro-batch rule: the wait of a layer split into latency and link time.

Why: the micro-batch rule (``pacing.choose_micro_batches``) weighs the backbone's dense work C
against the wait R for the experts. Measured as one number, R hides what a capped link does: a
micro-batch's request waits for the link to carry *its* bytes (less with more micro-batches)
behind the other micro-batches' bytes (more with more micro-batches), so the measured R moved with
M itself and the rule's pick wandered from step to step on a capped link (2 to 5 for the same
load). Where an owner's link has a known cost per row - the straight line its recent round trips
fit against their sizes, ``SocketOwner.predict_s``, which the hot-expert path reads too - the wait
splits into a fixed part (latency, per-request costs) and the link's busy time for the step's
pairs, which the rule then treats like the backbone's CPU: a resource every micro-batch shares.

Only when the link part matters (at least :data:`LINK_SHARE` of the measured wait): otherwise the
rule keeps the measured wait, as before.
"""
from __future__ import annotations

LINK_SHARE = 0.1


class LinkModel:
    """Per remote owner, the (expert, row) pairs it got per layer and per row of a step (the last
    step that used it), and from them and its fit, the next step's link terms."""

    def __init__(self) -> None:
        self.pairs_per_row: dict[str, float] = {}

    def observe(self, per_owner_rows: dict[str, int], layers: float, rows: int) -> None:
        """A step of ``rows`` rows ran ``layers`` MoE layers and sent each owner these pairs."""
        if layers <= 0 or rows <= 0:
            return
        for name, pairs in per_owner_rows.items():
            if pairs > 0:
                self.pairs_per_row[name] = pairs / layers / rows

    def terms(self, owners, rows: int, wait_s: float) -> tuple[float, float]:
        """(wait, link) seconds per layer for a step of ``rows`` rows: the busiest owner's fixed
        round-trip part and its link time for the whole step's pairs, where every owner the recent
        steps used has a fit and the link part is at least :data:`LINK_SHARE` of ``wait_s``; else
        (``wait_s``, 0): the measured wait alone."""
        if not self.pairs_per_row:
            return wait_s, 0.0
        best: tuple[float, float] | None = None
        for owner in owners:
            share = self.pairs_per_row.get(owner.name)
            if not share or not owner.remote:
                continue
            fixed = owner.predict_s(0)
            if fixed is None:  # an owner without a fit yet: the link cost is not known
                return wait_s, 0.0
            link = max(0.0, owner.predict_s(1) - fixed) * share * rows
            if best is None or fixed + link > sum(best):
                best = (fixed, link)
        if best is None or best[1] < LINK_SHARE * wait_s:
            return wait_s, 0.0
        return best
