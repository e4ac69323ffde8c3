"""bench/cpu_groups.py: a process in a CPU cgroup with a quota of q cores uses about q of a core,
and the groups are gone afterwards (real processes, the kernel's own cgroups; needs root)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from cpu_groups import CgroupError, CpuGroups

BUSY = "while True: pass"


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.fixture
def groups():
    try:
        g = CpuGroups()
    except CgroupError as exc:
        pytest.fail(f"{exc}", pytrace=False)
    with g:
        yield g


@pytest.mark.slow
def test_a_quota_caps_a_busy_process_and_the_groups_are_removed(groups):
    """Two busy processes, one at 0.1 and one at 0.3 of a core: each uses about its quota (wide
    bounds: 2 shared cores, other jobs), and neither group exists after close()."""
    quotas = (0.1, 0.3)
    made = [groups.make(f"t{i}", q) for i, q in enumerate(quotas)]
    procs = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in quotas]
    try:
        for g, p in zip(made, procs):
            g.add(p.pid)
            assert g.pids() == [p.pid]
        c0 = [cpu_s(p.pid) for p in procs]
        t0 = time.monotonic()
        time.sleep(3.0)
        used = [(cpu_s(p.pid) - c) / (time.monotonic() - t0) for p, c in zip(procs, c0)]
        throttled = [g.throttled() for g in made]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    for q, u in zip(quotas, used):
        assert 0.5 * q <= u <= 1.3 * q, (quotas, used)
    assert all(t > 0 for t in throttled)  # the quota, not the machine's load, held them back
    paths = [g.path for g in made]
    assert all(p.exists() for p in paths)
    groups.close()
    assert not any(p.exists() for p in paths)


def test_bad_quotas_are_refused(groups):
    with pytest.raises(ValueError, match="> 0 cores"):
        groups.make("zero", 0)
    with pytest.raises(ValueError, match="bad cgroup name"):
        groups.make("../escape", 0.5)
