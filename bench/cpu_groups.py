"""CPU cgroups with a quota: each process of a benchmark swarm on its own share of a core.

Why: on one machine every node of a swarm takes its CPU from the same cores, so a worker's compute
is taken from the backbone's and adding a worker cannot add throughput. A process in a CPU cgroup
with a quota of ``q`` cores (cgroup v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``, or v2
``cpu.max``) gets at most ``q`` of a core over every period, whatever the others do: a backbone
and workers in groups of their own behave like separate weak devices (bench/device_swarm.py).

    with CpuGroups() as groups:          # CgroupError (one line) where none can be made
        g = groups.make("w0", 0.2)        # 0.2 of a core
        g.add(pid)                        # the process and every thread of it; children inherit
    # every group made here is removed (its processes moved back to the root group first)

The groups are named ``p2pswarm-bench-<pid>-<name>`` under the controller's root: a later run
removes the empty groups an earlier one left behind when it was killed (``SIGKILL`` runs no
cleanup), so none pile up.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

V1_ROOT = Path("/sys/fs/cgroup/cpu")
V2_ROOT = Path("/sys/fs/cgroup")
PERIOD_US = 100_000
PREFIX = "p2pswarm-bench-"


class CgroupError(RuntimeError):
    """CPU cgroups cannot be made here (not root, no cpu controller): the message says which."""


def _write(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


class CpuGroup:
    """One group with a quota; :meth:`add` moves a process (all its threads) into it."""

    def __init__(self, path: Path, cpus: float, version: int):
        self.path = path
        self.cpus = cpus
        self.version = version

    def add(self, pid: int) -> None:
        _write(self.path / "cgroup.procs", str(pid))

    def pids(self) -> list[int]:
        return [int(x) for x in (self.path / "cgroup.procs").read_text().split()]

    def throttled(self) -> int:
        """How many periods the quota held the group back (``nr_throttled``): > 0 means the quota bound."""
        m = re.search(r"nr_throttled (\d+)", (self.path / "cpu.stat").read_text())
        return int(m.group(1)) if m else 0


class CpuGroups:
    """The groups of one run; a context manager that removes them all on exit (errors and Ctrl-C too)."""

    def __init__(self):
        self.groups: list[CpuGroup] = []
        self.version, self.root = self._controller()

    @staticmethod
    def _controller() -> tuple[int, Path]:
        if hasattr(os, "geteuid") and os.geteuid() != 0:
            raise CgroupError("CPU cgroups need root: run as root")
        if (V1_ROOT / "cpu.cfs_quota_us").exists():
            return 1, V1_ROOT
        controllers = V2_ROOT / "cgroup.controllers"
        if controllers.exists() and "cpu" in controllers.read_text().split():
            try:  # the cpu controller must be enabled for the root's children
                _write(V2_ROOT / "cgroup.subtree_control", "+cpu")
            except OSError as exc:
                raise CgroupError(f"cannot enable the cgroup v2 cpu controller: {exc.strerror}") from None
            return 2, V2_ROOT
        raise CgroupError("no CPU cgroup controller here: neither cgroup v1 /sys/fs/cgroup/cpu "
                          "(cpu.cfs_quota_us) nor cgroup v2 with the cpu controller is mounted")

    def __enter__(self) -> "CpuGroups":
        self._remove_stale()
        return self

    def make(self, name: str, cpus: float) -> CpuGroup:
        """A new group allowed ``cpus`` of a core (0 < cpus; above 1 means several cores)."""
        if not cpus > 0:
            raise ValueError(f"a CPU quota must be > 0 cores, not {cpus!r}")
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
            raise ValueError(f"bad cgroup name {name!r}")
        path = self.root / f"{PREFIX}{os.getpid()}-{name}"
        quota = max(1000, int(round(cpus * PERIOD_US)))  # the kernel's least quota is 1 ms
        try:
            path.mkdir()
            group = CpuGroup(path, cpus, self.version)
            self.groups.append(group)
            if self.version == 1:
                _write(path / "cpu.cfs_period_us", str(PERIOD_US))
                _write(path / "cpu.cfs_quota_us", str(quota))
            else:
                _write(path / "cpu.max", f"{quota} {PERIOD_US}")
        except OSError as exc:
            raise CgroupError(f"cannot make CPU cgroup {path}: {exc.strerror}") from None
        return group

    def remove(self, group: CpuGroup) -> None:
        """Remove one group now (its processes, if any are left, back to the root group first)."""
        _remove(group.path, self.root)
        if group in self.groups:
            self.groups.remove(group)

    def close(self) -> None:
        """Move any process still in a group back to the root group, then remove the groups."""
        for g in reversed(self.groups):
            _remove(g.path, self.root)
        self.groups.clear()

    def __exit__(self, *exc) -> None:
        self.close()

    def _remove_stale(self) -> None:
        """Groups of this prefix whose run's process is gone (killed before its cleanup)."""
        for path in self.root.glob(f"{PREFIX}*"):
            m = re.match(rf"{PREFIX}(\d+)-", path.name)
            if m and not Path(f"/proc/{m.group(1)}").exists():
                _remove(path, self.root)


def _remove(path: Path, root: Path) -> None:
    if not path.exists():
        return
    try:
        for pid in (path / "cgroup.procs").read_text().split():
            try:
                _write(root / "cgroup.procs", pid)
            except OSError:  # exited meanwhile
                pass
        path.rmdir()
    except OSError:
        pass  # still busy (a process being created): a later run removes it as stale
