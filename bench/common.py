"""Shared helpers for the benchmarks: timing, medians, and appending results to docs/benchmarks.md."""
from __future__ import annotations

import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def median_time(fn, repeat: int = 5, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def header(title: str, command: str) -> str:
    return (f"\n## {title}\n\n`{command}` — {datetime.date.today().isoformat()}, "
            f"{os.cpu_count()} cores, Python {platform.python_version()}\n\n")


def publish(text: str, append: bool) -> None:
    """Print a benchmark's results; with ``append`` (the ``--write`` flag) add them to docs/benchmarks.md."""
    print(text)
    if append:
        with open(REPO / "docs" / "benchmarks.md", "a") as f:
            f.write(text)


def peak_rss_mb(pid: int) -> float:
    """Peak resident set (VmHWM) of a live process, in MB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def geometry_model(bench_dir, layers: int):
    """The geometry-122b model with ``layers`` layers in ``bench_dir`` (made once, then reused),
    read through once so the page cache holds it: benchmarks time copies, not the first disk read."""
    import subprocess
    from pathlib import Path

    from p2pswarm.model.synth import make_model

    d = Path(bench_dir)
    d.mkdir(parents=True, exist_ok=True)
    model = d / f"geometry-122b-{layers}l.gguf"
    if not model.exists():
        make_model(model, preset="geometry-122b", layers=layers)
    subprocess.run(["cat", str(model)], stdout=subprocess.DEVNULL, check=True)
    return model
