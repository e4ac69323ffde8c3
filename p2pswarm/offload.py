"""Run a CPU-bound call on the trio event loop when it is short, in a thread when it is long.

Why: ``trio.to_thread.run_sync`` is not free. Every call wakes a cached thread (a lock release,
then the woken thread and the event loop contend for the GIL), hands the result back through
the run queue and reschedules the waiting task. Profiled under bench_throughput's load
(docs/benchmarks.md, "Inline compute of small requests"), that hop was a fifth to a half of a
worker's GIL samples at 64 concurrent sequences, against ~12% for the expert math it moved: a
decode request of a few rows computes in well under a millisecond, less than the hop around
it. So a call whose *expected* time is at most ``inline_s`` (``$P2PSWARM_INLINE_MS``, default
1.5 ms) runs inline; anything longer still goes to a thread, so one big request (a long prompt's
prefill, a big expert) never stalls the other connections, the HTTP API or the streams for more
than that bound.

The expectation is measured, per ``key`` (one kind of call: a worker's expert compute, one layer
of the backbone's dense path), as an EWMA of seconds per unit of work (rows). A key never seen
goes to a thread once to be measured. Inline calls keep the EWMA current, so a call that turns
out slower than the bound (a busier host, a bigger model) moves its key back to threads.

Nothing here changes a result: the same function runs on the same data, only on another thread.
Threads that compute through the same kernel share its lock (``GgmlRunner.lock``): while any
call of this :class:`Offload` is running in a thread, the next one goes to a thread too, so the
event loop never blocks waiting for that lock. The kernels' own thread pools (ggml's OpenMP
team) are used the same way whichever thread calls them.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Hashable

import trio

from p2pswarm import settings

#: weight of the newest measurement in the seconds-per-row EWMA
ALPHA = 0.25


class Offload:
    """One process component's policy: inline below ``inline_s`` expected seconds, else a thread.

    ``inline_calls`` / ``thread_calls`` count the decisions (observable: the tests and the
    benchmarks read them)."""

    def __init__(self, inline_s: float | None = None, clock: Callable[[], float] = time.perf_counter):
        """``clock``: what a call is measured with. The default, wall time, suits calls whose work
        may run in other threads too (a ggml graph with its own thread pool). ``time.thread_time``
        measures the calling thread's CPU only: right for work done wholly in that thread (decoding
        a reply), where a thread's wall time also counts its waits for the GIL, which the event
        loop holds while it runs; measured by wall time such a call looked several times longer
        than it is on a busy 0.3-core backbone and always took the hop (docs/benchmarks.md, "What
        stops the curve")."""
        if inline_s is None:
            inline_s = settings.INLINE_MS.get() / 1000.0
        self.inline_s = float(inline_s)
        self.clock = clock
        self._row_s: dict[Hashable, float] = {}
        self.threaded_now = 0  # calls of this Offload running in threads right now
        self.inline_calls = 0
        self.thread_calls = 0

    def expected_s(self, key: Hashable, units: int) -> float | None:
        """Expected seconds of a call of ``units`` rows of kind ``key`` (None: never measured)."""
        r = self._row_s.get(key)
        return None if r is None else r * max(1, units)

    def inline(self, key: Hashable, units: int) -> bool:
        """Whether a call of ``units`` rows of kind ``key`` would run on the event loop now."""
        if self.inline_s <= 0 or self.threaded_now:
            return False
        t = self.expected_s(key, units)
        return t is not None and t <= self.inline_s

    def _note(self, key: Hashable, units: int, seconds: float) -> None:
        r = seconds / max(1, units)
        old = self._row_s.get(key)
        self._row_s[key] = r if old is None else (1.0 - ALPHA) * old + ALPHA * r

    async def run(self, fn: Callable[[], Any], units: int, key: Hashable = None) -> Any:
        """``fn()``, inline or in a thread (see the module doc); ``units``: its rows of work."""
        clock = self.clock
        if self.inline(key, units):
            t0 = clock()
            out = fn()
            self._note(key, units, clock() - t0)
            self.inline_calls += 1
            return out
        took: list[float] = []

        def timed():
            t0 = clock()
            res = fn()
            took.append(clock() - t0)  # the call itself, not the hop's wait
            return res

        self.threaded_now += 1
        try:
            out = await trio.to_thread.run_sync(timed)
        finally:
            self.threaded_now -= 1
        if took:
            self._note(key, units, took[0])
        self.thread_calls += 1
        return out
