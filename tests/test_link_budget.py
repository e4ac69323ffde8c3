"""Bytes in the micro-batch rule (p2pswarm.backbone.serving.link_budget): where an owner's link has a known
cost per row, the wait splits into latency and link time, and the rule pipelines the link."""
from __future__ import annotations

import pytest

from p2pswarm.backbone.serving.link_budget import LinkModel
from p2pswarm.backbone.serving.pacing import choose_micro_batches
from p2pswarm.backbone.owners.socket_owner import DEADLINE_SAMPLES, SocketOwner


def _owner(name: str, fixed_s: float | None, per_row_s: float = 0.0) -> SocketOwner:
    """A real (unconnected) owner whose window of round trips is a line: fixed + per_row * rows."""
    o = SocketOwner(name, "127.0.0.1", 1, model_fingerprint="m", kernel="k", layers=(0, 2), experts=(0, 8))
    if fixed_s is not None:
        for i in range(2 * DEADLINE_SAMPLES):
            rows = 10 + 3 * i
            o._record(fixed_s + per_row_s * rows, rows)
    return o


def test_the_rule_pipelines_a_busy_link():
    # 5.5 ms of dense work, 50 ms of latency: nothing to hide, one micro-batch
    assert choose_micro_batches(0.0055, 0.05, 64) == 1
    # the same latency plus 200 ms of link time for the step's bytes: with one micro-batch the link
    # idles through the dense work and the latency; with two it carries one's bytes during the other's
    assert choose_micro_batches(0.0055, 0.05, 64, link_s=0.2) >= 2
    # the link's busy time is a floor no split goes under: the rule stops adding micro-batches there
    assert choose_micro_batches(0.0055, 0.0, 64, link_s=0.2) == 1


def test_link_terms_come_from_the_busiest_owners_fit():
    slow, fast = _owner("slow", 0.05, 0.002), _owner("fast", 0.05, 0.0001)
    links = LinkModel()
    links.observe({"slow": 400, "fast": 400}, layers=2, rows=20)  # 10 pairs per row and layer each
    assert links.pairs_per_row == {"slow": 10.0, "fast": 10.0}
    wait, link = links.terms([slow, fast], rows=20, wait_s=0.45)
    assert wait == pytest.approx(0.05, abs=1e-6) and link == pytest.approx(0.002 * 10 * 20, rel=1e-6)
    # the measured wait alone (0.45 s a micro-batch) picks 1; latency and link apart pick more
    assert choose_micro_batches(0.0055, 0.45, 64) == 1
    assert choose_micro_batches(0.0055, wait, 64, link_s=link) >= 2


@pytest.mark.parametrize("owners", [
    [("a", 0.05, 0.00001)],  # uncapped: the link part is under LINK_SHARE of the wait
    [("a", 0.05, 0.002), ("b", None, 0.0)],  # an owner with no fit yet: its link is not known
])
def test_without_a_known_busy_link_the_measured_wait_stands(owners):
    links = LinkModel()
    links.observe({name: 400 for name, *_ in owners}, layers=2, rows=20)
    assert links.terms([_owner(*o) for o in owners], rows=20, wait_s=0.3) == (0.3, 0.0)
    assert LinkModel().terms([_owner("a", 0.05, 0.002)], rows=20, wait_s=0.3) == (0.3, 0.0)  # nothing observed
