"""numpy's BLAS on one thread, in every process that multiplies with it.

Two reasons, both measured:

* **Bits.** numpy's OpenBLAS (0.3.31, Haswell kernels, on this project's 2-core machines) gives a
  row different bits with 1 and with 2 threads for products of 5 rows and more: a numpy-kernel
  backbone and its numpy-kernel workers then agree bit for bit only if they run the same thread
  count. One thread everywhere makes that hold whatever each machine's core count, and whatever
  an earlier part of the same process did (a test run that had used the ggml kernel left the
  process on one thread, and its numpy monolithic run then differed from fresh numpy worker
  processes by 5.7e-6).
* **Speed.** Once ggml computes the dense path, what numpy still multiplies is small (the F32
  router, attention scores, the chunked DeltaNet's 64x64 blocks), and OpenBLAS's own thread pool
  spins beside ggml's on the same cores: bench/profile_decode.py --prefill 64 (geometry-122b
  qwen35moe, a loaded 2-core machine, alternating) gave 3.1 and 1.9 tokens/s with OpenBLAS's 2
  threads, 4.2 and 5.1 with one.

``OPENBLAS_NUM_THREADS`` or ``OMP_NUM_THREADS`` in the environment win (the operator's choice, to
be made the same on every node of a numpy-kernel swarm). Process-wide, through threadpoolctl.
"""
from __future__ import annotations

import logging
import os

log = logging.getLogger("p2pswarm.engine")

_done = False


def single_threaded_blas() -> None:
    """Limit numpy's BLAS to one thread, once per process (see the module doc)."""
    global _done
    if _done:
        return
    _done = True
    if os.environ.get("OPENBLAS_NUM_THREADS") or os.environ.get("OMP_NUM_THREADS"):
        return
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # pragma: no cover - a pinned dependency
        log.debug("threadpoolctl missing: numpy's BLAS keeps its threads")
        return
    threadpool_limits(1, user_api="blas")
