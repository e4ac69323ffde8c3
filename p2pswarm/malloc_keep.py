"""Keep freed heap memory in the process: glibc's malloc thresholds fixed at start-up.

Why: glibc gives large free blocks back to the kernel (blocks over its mmap threshold are unmapped
when freed; free memory at the top of a heap over its trim threshold is trimmed), and both
thresholds are small and adapt only to the largest block freed so far (at most 32 MiB mapped, 64
trimmed). A node handles arrays of 0.1-2 MB per expert request (a reply's plaintext, its msgpack
payload, its float32 array; the request's rows; the combine's and the dense path's temporaries),
allocated and freed at every layer. Given back, every one is fresh pages again at the next
request, and on this VM the first write to a fresh page costs ~0.8-1 ms per MiB against
~0.07 ms per MiB for mapped memory (docs/benchmarks.md). Measured on one 344 KB reply (decrypt,
frame slice, msgpack, array) in a loop: ~650-840 us with glibc's thresholds, ~65-150 us with
these; in the 4-worker N=16 cell of bench/device_swarm.py the workers took ~150-300 page faults a
token, ~6 with these (the backbone's own heap had settled by then: ~0-5 either way;
docs/benchmarks.md, issue 46, i46f). The cost: a process keeps up to ``P2PSWARM_MALLOC_KEEP_MB``
of free memory per malloc arena instead of returning it (its peak working set stays resident).

Only glibc has these knobs (``mallopt``); elsewhere (musl, macOS, Windows) this does nothing.
Allocation placement does not change any arithmetic: the bits are the same either way.
"""
from __future__ import annotations

import ctypes
import logging
import platform
import sys

from p2pswarm import settings

log = logging.getLogger("p2pswarm.node")

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's most on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX); larger: refused

_applied: int | None = None


def keep_freed_memory() -> int | None:
    """Set glibc's trim threshold to ``P2PSWARM_MALLOC_KEEP_MB`` MiB and its mmap threshold to
    the same, at most 32 MiB (blocks above it are still mapped and unmapped: a rare huge
    temporary goes back at once). Returns the MiB kept, or None where nothing was set (0: glibc's
    own thresholds; not glibc; mallopt refused). Idempotent."""
    global _applied
    mb = settings.MALLOC_KEEP_MB.get()
    if mb == 0 or not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return None
    if _applied == mb:
        return mb
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    keep = mb << 20
    if not (mallopt(M_MMAP_THRESHOLD, min(keep, MMAP_THRESHOLD_MAX)) and mallopt(M_TRIM_THRESHOLD, keep)):
        log.debug("mallopt refused the thresholds: malloc keeps its own")
        return None
    _applied = mb
    return mb
