"""p2pswarm/malloc_keep.py: with glibc's thresholds fixed, arrays freed between requests stay in
the heap and the next request's arrays are no fresh pages; with 0 (glibc's own adaptive
thresholds) the same loop faults its pages in again every round. Measured in a child process (the
thresholds are process-wide), by the kernel's minor-fault counter."""
from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from p2pswarm import malloc_keep, settings
from p2pswarm.errors import UserError

LOOP = r"""
import resource, numpy as np
from p2pswarm.malloc_keep import keep_freed_memory
print(keep_freed_memory())
def one_request():
    # a reply's buffers: plaintext, payload, array, combine temporaries, ~1 MiB each, all freed
    bufs = [np.ones(256 * 1024, np.float32) for _ in range(4)]
    return float(sum(b[-1] for b in bufs))
for _ in range(5):
    one_request()
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(50):
    one_request()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
"""


def _faults(keep_mb: str) -> tuple[str, int]:
    env = dict(os.environ, P2PSWARM_MALLOC_KEEP_MB=keep_mb)
    out = subprocess.run([sys.executable, "-c", LOOP], env=env, capture_output=True, text=True, timeout=120,
                         check=True).stdout.split()
    return out[0], int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
                    reason="glibc's mallopt thresholds (elsewhere keep_freed_memory does nothing: tested below)")
def test_freed_arrays_stay_mapped_with_the_thresholds_and_fault_again_without():
    kept, with_keep = _faults("64")
    off, without = _faults("0")
    assert (kept, off) == ("64", "None")
    # 50 rounds of 4 MiB: glibc's own thresholds give the 4 MiB back each round (~1,000 pages a
    # round); kept, the same arrays reuse the heap's pages
    assert without > 50 * 500, without
    assert with_keep < 200, with_keep


def test_nothing_is_set_off_glibc_and_a_bad_value_is_one_line(monkeypatch):
    monkeypatch.setattr(malloc_keep, "_applied", None)
    monkeypatch.setattr(platform, "libc_ver", lambda: ("", ""))
    monkeypatch.setenv("P2PSWARM_MALLOC_KEEP_MB", "64")
    assert malloc_keep.keep_freed_memory() is None
    monkeypatch.setenv("P2PSWARM_MALLOC_KEEP_MB", "lots")
    with pytest.raises(UserError, match="P2PSWARM_MALLOC_KEEP_MB='lots': is not an integer"):
        settings.MALLOC_KEEP_MB.get()
