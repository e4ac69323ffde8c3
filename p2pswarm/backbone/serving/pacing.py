"""How big and how split a scheduler step is: the rules behind ``token_budget="auto"``,
``micro_batches="auto"`` and the wait for a burst of requests (:mod:`p2pswarm.backbone.serving.scheduler`,
which measures the inputs each step). Pure functions and their constants, kept apart from the step
loop so they can be read, tested and tuned alone; the measurements behind the constants are in
docs/benchmarks.md.
"""
from __future__ import annotations

#: fixed cost of one more micro-batch per layer: one more request per owner (~1.1-1.5 ms of CPU per
#: round trip through py-libp2p, both ends, docs/benchmarks.md "per-request transport cost") times the
#: owners of a layer, plus its thread hops. A smaller value split small steps into micro-batches
#: that ran slower than one (docs/benchmarks.md, "Inline compute of small requests"); this one
#: keeps one there and still splits when the dense work is tens of ms per layer (a big model),
#: where pipelining pays.
MICRO_OVERHEAD_S = 0.005

#: Gathering a burst. An idle backbone that gets a request waits before its first step while more
#: keep coming: at most GATHER_FRACTION of a recent step's time (an EWMA), and it starts as soon as
#: GATHER_GAP of a step passes with no new request (before any step was timed: GATHER_FIRST, gap
#: and most, in seconds). Why: requests sent together (a client's batch, many users at once) reach
#: the scheduler one by one as the HTTP server parses them on the event loop (a millisecond or so
#: each); without waiting, the first step took the first one or two and every later one joined a
#: step later: one more step, L round trips, for the whole burst (docs/benchmarks.md has the
#: measurements). While they keep coming, waiting up to a whole step is worth it: a straggler left
#: out costs the burst one more step, and waiting costs it at most one, once (half a step was too
#: little on a slower machine). A lone request pays only the gap, a tenth of a step.
GATHER_FRACTION = 1.0
GATHER_GAP = 0.1
GATHER_FIRST = (0.002, 0.025)
GATHER_MAX_S = 0.25  # never longer, however slow the steps


AUTO_BUDGET_FLOOR = 256  # rows of an "auto" step whatever the timing (the fixed default before)
AUTO_BUDGET_CAP = 4096  # and never more: bounds one step's dense work and memory
BUDGET_SAMPLE_ROWS = 64  # steps of fewer rows do not update the per-row dense cost
BUDGET_WINDOW = 32  # the per-row dense cost is the least of the last this many such steps


def choose_token_budget(dense_row_s: float | None, wait_s: float | None, *, floor: int = AUTO_BUDGET_FLOOR,
                        cap: int = AUTO_BUDGET_CAP) -> int:
    """Rows per step for ``token_budget="auto"``: ``max(floor, R / c)`` capped at ``cap``, with c the
    measured dense seconds per row and layer (the least over the last :data:`BUDGET_WINDOW` steps of at
    least :data:`BUDGET_SAMPLE_ROWS` rows: a step's fixed per-layer and per-micro-batch costs inflate
    its per-row cost, least so in the step with the most rows) and R the measured dispatch wait per
    layer (network round trip + remote compute).

    Why: a layer of a step costs about ``rows * c + R``. While ``rows * c < R`` the step is
    network-bound, and feeding more prefill rows into it costs a fraction of what one more step
    would (``L * R``); past that point the extra rows would slow every decoding sequence's step by
    more than a round trip, so the budget stops growing there. A step may thus take up to about
    twice its round-trip time while prompts are being absorbed, never more. Unmeasured: ``floor``."""
    if dense_row_s is None or wait_s is None or dense_row_s <= 0:
        return floor
    return int(min(cap, max(floor, wait_s / dense_row_s)))


def choose_micro_batches(dense_s: float, wait_s: float, n_seqs: int, *, overhead_s: float = MICRO_OVERHEAD_S,
                         max_m: int = 8, slack: float = 0.05, link_s: float = 0.0) -> int:
    """The number of micro-batches M that minimises the time of one layer,

        T(M) = max(C + (M - 1) * o,  X,  C / M + R + X / M + (M - 1) * o)
    (X: a known link's time for the step's bytes, R the rest of the wait: backbone/serving/link_budget.py)

    with C the dense time of the whole step's rows, R the wait for the experts (network round trip
    + remote compute) and o the fixed cost of one more micro-batch. The first term is the backbone's
    CPU (busy on all M micro-batches in turn), the second one micro-batch's critical path (its share
    of the dense work, then its round trip). The overhead is on that path too: every micro-batch is
    one more request per owner and layer, and each owner answers one connection's requests in order,
    so the last micro-batch's request waits behind the others' framing, proxy and worker hops.
    (Without that term the model picked several micro-batches where one gave the same tokens/s with
    a fraction of the expert requests and less backbone CPU; each extra request costs its owner and
    this process CPU on the same cores the dense work needs: docs/benchmarks.md, hence
    ``MICRO_OVERHEAD_S``.) With R >> C pipelining hides at
    most C: M stays 1-2; with C ~ R it approaches a 2x gain. We take the *smallest* M within
    ``slack`` (5%) of the best time. M <= the number of sequences and ``max_m``."""
    ms = range(1, max(1, min(max_m, n_seqs)) + 1)
    times = [max(dense_s + (m - 1) * overhead_s, link_s, dense_s / m + wait_s + link_s / m + (m - 1) * overhead_s) for m in ms]
    best = min(times)
    return next(m for m, t in zip(ms, times) if t <= best * (1 + slack))
