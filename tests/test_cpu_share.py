"""ggml graphs use the CPUs other processes leave free (p2pswarm.engine.ggml.cpu_share): real processes."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from helpers.ggml import needs_ggml

from p2pswarm.engine.ggml import cpu_share

# A child pinned to two CPUs, with a busy process pinned to the first: before any interval every
# CPU counts, after the first one CPU is free.
_CHILD = textwrap.dedent("""
    import os, subprocess, sys, time
    from p2pswarm.engine.ggml.cpu_share import CpuShare, INTERVAL_S
    cpus = sorted(os.sched_getaffinity(0))[:2]
    os.sched_setaffinity(0, cpus)
    hog = subprocess.Popen([sys.executable, "-c",
                            f"import os; os.sched_setaffinity(0, [{cpus[0]}])\\nwhile True: pass"])
    try:
        time.sleep(0.3)
        share = CpuShare()
        first = share.free()
        time.sleep(INTERVAL_S + 0.3)
        busy = share.free()
    finally:
        hog.kill()
        hog.wait()
    print(first, busy)
""")


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux and two CPUs this process may use")
def test_a_busy_process_takes_its_cpu_out_of_the_graphs_share():
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    first, busy = (int(x) for x in out.stdout.split())
    assert first == 2  # nothing measured yet: every CPU counts
    assert busy == 1   # the busy process holds one of the two


def test_the_share_is_off_when_told(monkeypatch):
    monkeypatch.setenv("P2PSWARM_ADAPT_THREADS", "off")
    assert cpu_share.free_cpus() is None
    monkeypatch.setenv("P2PSWARM_ADAPT_THREADS", "on")
    got = cpu_share.free_cpus()
    assert got is not None and 1 <= got <= len(os.sched_getaffinity(0))


@needs_ggml
def test_a_graphs_threads_follow_the_share(monkeypatch):
    """GgmlRunner.compute asks for no more threads than the share says are free."""
    import numpy as np

    from p2pswarm.engine.ggml import runner as ggml_runner
    from p2pswarm.engine.ggml.lib import GGML_TYPE_F32, load_libggml

    lib = load_libggml()
    r = ggml_runner.GgmlRunner(lib, 2)
    asked = []
    real = lib.backend_cpu_set_n_threads
    monkeypatch.setattr(lib, "backend_cpu_set_n_threads", lambda b, n: (asked.append(n), real(b, n))[1])

    def build(g):
        x = lib.new_tensor_1d(g.ctx, GGML_TYPE_F32, 64)
        y = lib.rms_norm(g.ctx, x, 1e-5)
        lib.build_forward_expand(g.graph, y)
        return ggml_runner.f32_view(lib, x, (64,)), ggml_runner.f32_view(lib, y, (64,))

    for free in (1, 2):
        monkeypatch.setattr(ggml_runner, "free_cpus", lambda free=free: free)
        r.run_one(None, 4096, 4, build, np.ones(64, np.float32), 1 << 40)
    monkeypatch.setattr(ggml_runner, "free_cpus", lambda: None)
    r.run_one(None, 4096, 4, build, np.ones(64, np.float32), 1 << 40)
    r.close()
    assert asked == [1, 2, 2]
