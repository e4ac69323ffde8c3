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


def time_compute(runner) -> list[float]:
    """Wrap ``runner.compute`` (a ggml GgmlRunner) so that the seconds spent in it accumulate in the
    returned one-item list (reset it to 0 before a timed call)."""
    spent = [0.0]
    real = runner.compute

    def timed(graph, macs):
        t = time.perf_counter()
        real(graph, macs)
        spent[0] += time.perf_counter() - t

    runner.compute = timed
    return spent


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


def llama_model(path, extra_bufts: bool = False):
    """llama.cpp (llama-cpp-python's low-level API) with the GGUF ``path`` loaded for the CPU:
    ``(the llama_cpp module, the model, its vocabulary size)``. ``extra_bufts`` False uses the
    weights in place (the kernels our engine calls; see bench_vs_llama.py)."""
    import llama_cpp as L

    L.llama_backend_init()
    mp = L.llama_model_default_params()
    mp.n_gpu_layers, mp.use_extra_bufts = 0, extra_bufts
    model = L.llama_model_load_from_file(str(path).encode(), mp)
    if not model:
        raise SystemExit("llama.cpp could not load the model")
    return L, model, L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))


def warm_page_cache(path) -> None:
    """Read ``path`` through once so the page cache holds it: a benchmark then times its work, not
    the first read from disk."""
    import subprocess

    subprocess.run(["cat", str(path)], stdout=subprocess.DEVNULL, check=True)


def geometry_model(bench_dir, layers: int):
    """The geometry-122b model with ``layers`` layers in ``bench_dir`` (made once, then reused),
    read through once so the page cache holds it (:func:`warm_page_cache`)."""
    from pathlib import Path

    from p2pswarm.model.synth import make_model

    d = Path(bench_dir)
    d.mkdir(parents=True, exist_ok=True)
    model = d / f"geometry-122b-{layers}l.gguf"
    if not model.exists():
        make_model(model, preset="geometry-122b", layers=layers)
    warm_page_cache(model)
    return model


def tiny_in_process_parts(prefix: str, n_workers: int = 2):
    """What the in-process verification benchmarks start from: a fresh tiny F32 model in a temporary
    folder, its expert shards for ``n_workers`` workers, those workers (numpy kernel) and the dense
    weights. Returns ``(layout, shards, workers, dense)``."""
    import tempfile  # only these benchmarks need it

    from p2pswarm.backbone.sessions.local import ensure_shards
    from p2pswarm.engine.arch import load_dense
    from p2pswarm.model.layout import ModelLayout
    from p2pswarm.model.manifest import model_fingerprint
    from p2pswarm.model.synth import make_model
    from p2pswarm.worker.expert_worker import ExpertWorker

    d = Path(tempfile.mkdtemp(prefix=prefix))
    model = d / "tiny.gguf"
    make_model(model, preset="tiny", qtype="f32", seed=1)
    layout = ModelLayout.open(model)
    shards = ensure_shards(layout, model_fingerprint(layout), n_workers, d)
    return layout, shards, [ExpertWorker(s, kernel="numpy") for s in shards], load_dense(layout)
