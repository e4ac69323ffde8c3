"""How long this process's own event loop was stalled: so a backbone does not blame a worker for it.

A worker's *deadline* (:mod:`p2pswarm.backbone.owners.socket_owner`) is a few times its recent p99 round
trip, at least half a second. A backbone whose own trio loop is stalled for that long (a lazy
import, a burst of inline compute, a CPU stolen by other processes on a busy machine) cannot read a
reply that has already arrived: on a libp2p stream the read-ahead task that would deliver it runs
in the same loop, after the deadline has fired. The worker was then called hung, its experts were
recomputed here and it was avoided for seconds, although it had answered in time. On a loaded CI
machine that made a process test flaky (a worker avoided for the rest of a short decode).

:class:`LoopWatch` is one system task per trio run that sleeps :data:`TICK_S` at a time and records
every wake-up later than :data:`STALL_MIN_S` past its due time. :meth:`LoopWatch.stalled_since`
adds up the stall seen since a moment, the one going on now included (a loop that has not ticked
for a while is stalled right now, even before the ticker runs again). A request credits that time
back to its deadline. The cost: 50 wake-ups a second of a few microseconds each.
"""
from __future__ import annotations

import collections
import time

import trio

TICK_S = 0.02
STALL_MIN_S = 0.005  # lateness below this is timer slack, not a stall
HISTORY = 512  # stalls remembered (a request's window is seconds; this covers far longer)

_WATCH: trio.lowlevel.RunVar = trio.lowlevel.RunVar("p2pswarm_loop_watch")


class LoopWatch:
    """The stalls of the trio loop it runs in (see the module doc)."""

    def __init__(self) -> None:
        self._last = time.perf_counter()  # when the ticker last woke
        self._stalls: collections.deque[tuple[float, float]] = collections.deque(maxlen=HISTORY)  # (end, length)

    async def run(self) -> None:
        while True:
            due = time.perf_counter() + TICK_S
            await trio.sleep(TICK_S)
            now = time.perf_counter()
            if now - due > STALL_MIN_S:
                self._stalls.append((now, now - due))
            self._last = now

    def stalled_since(self, t0: float) -> float:
        """Seconds (``time.perf_counter`` clock) the loop was stalled between ``t0`` and now."""
        now = time.perf_counter()
        total = 0.0
        for end, length in reversed(self._stalls):
            if end <= t0:
                break
            total += min(length, end - t0)
        due = self._last + TICK_S  # the ticker should have woken by then
        if now - due > STALL_MIN_S:
            total += max(0.0, now - max(t0, due))
        return total


def loop_watch() -> LoopWatch:
    """This trio run's watch, started on first use (a system task: it ends with the run)."""
    try:
        return _WATCH.get()
    except LookupError:
        watch = LoopWatch()
        _WATCH.set(watch)
        trio.lowlevel.spawn_system_task(watch.run, name="p2pswarm loop watch")
        return watch
