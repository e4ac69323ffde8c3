"""How many of this process's CPUs other processes left free: what a ggml graph should use.

Why: ggml's threads wait for one another at every node. On cores no one else wants a short spin
makes those waits cheap (``ggml_kernel._short_omp_waits``), but when another process keeps a core
busy, one of our threads runs only when the scheduler takes that core from it, and every barrier
then waits for it: measured on this 2-core machine (gpt-oss geometry, decode), 2 threads beside
one busy process ran at 48 tok/s spinning and 57 sleeping, 1 thread at 64 (docs/benchmarks.md,
"Short spin"). So each graph runs on at most the CPUs that are free: those this process may use,
less what other processes used of them over the last half second (``/proc/stat`` per CPU, less
this process's own CPU time). The count is re-read at most every ``INTERVAL_S``, so it costs one
small file read per half second, and it never changes a result: ggml's bits do not depend on the
thread count (docs/kernels.md).

``P2PSWARM_ADAPT_THREADS=off`` turns it off (the configured threads always); where ``/proc/stat``
cannot be read (not Linux) every CPU counts as free.
"""
from __future__ import annotations

import os
import resource
import threading
import time
from contextvars import ContextVar

from p2pswarm import settings

#: how often the free CPUs are measured again (seconds)
INTERVAL_S = 0.5
#: other processes' use of a CPU above which it no longer counts as free (in CPUs)
BUSY_SHARE = 0.5


def _allowed_cpus() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def _busy_ticks(cpus: frozenset[int]) -> int | None:
    """Clock ticks the CPUs in ``cpus`` spent on anything but idle, I/O wait and steal, since boot."""
    try:
        with open("/proc/stat", "rb") as f:
            text = f.read(1 << 16)
    except OSError:
        return None
    total = 0
    for line in text.split(b"\n"):
        if not line.startswith(b"cpu") or line[3:4] == b" ":
            continue
        name, *fields = line.split()
        try:
            cpu = int(name[3:])
        except ValueError:
            continue
        if cpu in cpus and len(fields) >= 7:
            user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in fields[:7])
            total += user + nice + system + irq + softirq
    return total


def _own_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


class CpuShare:
    """The CPUs of this process's affinity that other processes leave free, measured as it goes."""

    def __init__(self):
        self._lock = threading.Lock()
        self._cpus = frozenset(_allowed_cpus())
        self._tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._free = len(self._cpus)
        self._last: tuple[float, int, float] | None = None  # (monotonic time, busy ticks, own CPU s)

    def free(self) -> int:
        """CPUs free for our graphs: all of them until the first interval has passed."""
        now = time.monotonic()
        last = self._last
        if last is not None and now - last[0] < INTERVAL_S:
            return self._free
        with self._lock:
            last = self._last
            if last is not None and now - last[0] < INTERVAL_S:
                return self._free
            busy = _busy_ticks(self._cpus)
            if busy is None:
                return self._free
            own = _own_seconds()
            if last is not None:
                others = ((busy - last[1]) / self._tick - (own - last[2])) / (now - last[0])
                self._free = max(1, len(self._cpus) - int(max(0.0, others) + 1.0 - BUSY_SHARE))
            self._last = (now, busy, own)
            return self._free


#: the most threads a graph computed in this context may use (None: no cap beyond the free CPUs).
#: The verifier's spot checks set 1 (``p2pswarm.backbone.dispatch.verify.CHECK_THREADS``): a check
#: runs beside the request it checks, so its wall time is hidden behind the round trip, while its CPU
#: is taken from the backbone's own. A check is a row or a few of one expert, which streams the
#: expert's weights once; split over 2 threads it gave no wall time back on this machine and cost
#: 1.6-2.5x the CPU (docs/benchmarks.md, "A spot check's CPU"). Set in a task, it holds for that
#: task and the threads it hands work to (trio copies the context), never for its parent.
GRAPH_THREAD_CAP: ContextVar[int | None] = ContextVar("p2pswarm_graph_thread_cap", default=None)

_share: CpuShare | None = None


def free_cpus() -> int | None:
    """The CPUs a graph may use now, or None when adapting is off (``P2PSWARM_ADAPT_THREADS``)."""
    global _share
    if not settings.ADAPT_THREADS.get():
        return None
    if _share is None:
        _share = CpuShare()
    return _share.free()
