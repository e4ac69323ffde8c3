"""Sample the CPU time of every running ``p2pswarm.cli`` process (bootstrap, backbone, workers) from
/proc, so a multi-process test's per-process cost can be measured from outside it.

Why from outside: the test under measurement must run unchanged; /proc/PID/stat gives each
process's user+system ticks, and the deltas over a window give its CPU share there.

    python bench/proc_cpu.py record OUT.jsonl [MATCH]    # until killed, one sample every 5 s
    python bench/proc_cpu.py report OUT.jsonl [--after-ready N]
    python bench/proc_cpu.py phases TMPDIR/test_auto_workers_cover_every_0   # start-up phases

``report`` prints, per role, the median and max CPU % of a process over the steady window: from
30 s after the first sample at which N workers are alive, for 60 s (or until a worker disappears).
"""
from __future__ import annotations

import json
import os
import sys
import time

TICK = os.sysconf("SC_CLK_TCK")


def _role(argv: list[str]) -> str | None:
    if "p2pswarm.cli" not in argv:
        return None
    rest = argv[argv.index("p2pswarm.cli") + 1:]
    if not rest:
        return None
    if rest[0] == "node" and "--role" in rest:
        role = rest[rest.index("--role") + 1]
        return "auto-worker" if role == "worker" and "--auto" in rest else role
    return rest[0]


def sample(match: str = "") -> dict:
    """``match``: only processes whose command line contains it (a test's tmp dir: other
    p2pswarm processes on a shared machine are not counted)."""
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            argv = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace").split("\0")
            role = _role(argv)
            if role is None or match not in "\0".join(argv):
                continue
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            out[pid] = [role, (int(fields[11]) + int(fields[12])) / TICK]
        except OSError:
            continue
    return {"t": time.time(), "p": out}


def record(path: str, match: str = "", every: float = 5.0) -> None:
    with open(path, "a") as f:
        while True:
            f.write(json.dumps(sample(match)) + "\n")
            f.flush()
            time.sleep(every)


def report(path: str, n: int, window: float = 60.0, skip: float = 30.0) -> None:
    rows = [json.loads(line) for line in open(path)]
    workers = lambda r: {p for p, (role, _) in r["p"].items() if role == "auto-worker"}
    first = next((i for i, r in enumerate(rows) if len(workers(r)) >= n), None)
    if first is None:
        sys.exit(f"never {n} auto workers alive at once")
    # the last wave's start-up (imports, download, load) is not the idle cost: skip it
    start = next((i for i in range(first, len(rows)) if rows[i]["t"] - rows[first]["t"] >= skip), first)
    base = rows[start]
    end = start
    while end + 1 < len(rows) and workers(rows[end + 1]) >= workers(base) and rows[end + 1]["t"] - base["t"] <= window:
        end += 1
    last = rows[end]
    dt = last["t"] - base["t"]
    by_role: dict[str, list[float]] = {}
    for pid, (role, cpu) in last["p"].items():
        if pid in base["p"]:
            by_role.setdefault(role, []).append(100 * (cpu - base["p"][pid][1]) / dt)
    print(f"steady window: {dt:.0f} s with {len(workers(base))} auto workers alive")
    for role, vals in sorted(by_role.items()):
        vals.sort()
        print(f"  {role:12s} n={len(vals):2d}  median {vals[len(vals) // 2]:5.1f} %  max {vals[-1]:5.1f} %  "
              f"sum {sum(vals):6.1f} %")
    total = {role: sum(cpu for r2, cpu in [v for v in last["p"].values()] if r2 == role)
             for role in by_role}
    print("  CPU seconds so far per role:", {k: round(v) for k, v in total.items()})


def phases(test_dir: str) -> None:
    """Median seconds of each start-up phase of the ``w*.log`` workers in a market test's tmp dir:
    spawn (the key file's mtime, written just before) -> first log line (interpreter and imports)
    -> joined the swarm (DHT bootstrap) -> market geometry read (demand look-up) -> first
    enrolment (download + load + record)."""
    import datetime
    import glob
    import re
    import statistics

    def ts(line: str) -> float:
        return datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").replace(
            tzinfo=datetime.timezone.utc).timestamp()

    marks = {"imports": r"identity ", "bootstrap": r"joined the swarm", "demand": r"market: model",
             "enrol": r"enrolled in"}
    out: dict[str, list[float]] = {k: [] for k in marks}
    for log in glob.glob(os.path.join(test_dir, "w*.log")):
        key = log[:-4] + ".key"
        prev = os.stat(key).st_mtime
        lines = open(log).read().splitlines()
        for name, pat in marks.items():
            hit = next((ts(x) for x in lines if re.search(pat, x)), None)
            if hit is None:
                break
            out[name].append(hit - prev)
            prev = hit
    for name, vals in out.items():
        if vals:
            print(f"  {name:10s} median {statistics.median(vals):5.1f} s  max {max(vals):5.1f} s  (n={len(vals)})")


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="sample every 5 s until killed")
    r.add_argument("out")
    r.add_argument("match", nargs="?", default="")
    p = sub.add_parser("report", help="per role, median and max CPU %% over the steady window")
    p.add_argument("log")
    p.add_argument("--after-ready", type=int, default=30, help="the workers alive that start the window")
    ph = sub.add_parser("phases", help="start-up phases of a test's processes")
    ph.add_argument("test_dir")
    a = ap.parse_args()
    if a.cmd == "record":
        record(a.out, a.match)
    elif a.cmd == "phases":
        phases(a.test_dir)
    else:
        report(a.log, a.after_ready)
