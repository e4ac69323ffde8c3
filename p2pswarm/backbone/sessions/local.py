"""Stand up a backbone with N expert workers on this host: slice shards, start workers, connect.

``open_backbone(model, workers=N, transport=...)`` is what `p2pswarm logits`, `generate` and `demo`
use. With ``workers=0`` it is the monolithic run (M0): every expert computed by the backbone's own
replica. With N > 0 the experts of every layer are split into N contiguous ranges (sizes differing
by at most one), each cut into a shard mini-GGUF and served by one worker, either in this process
(``inproc``) or as a separate OS process on a local socket (``socket``).

``kernel`` ("auto" | "numpy" | "ggml", see :mod:`p2pswarm.engine.kernels`) is resolved once here and
used by the backbone's fallback replica, its dense path and every worker it starts, so all of them
compute the same way (the handshake refuses a worker that does not).
"""
from __future__ import annotations

import logging
import signal
import subprocess
import sys
import threading
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import trio

from p2pswarm import settings
from p2pswarm.backbone.dispatch.dispatcher import Dispatcher, InProcessOwner, Owner
from p2pswarm.backbone.serving.runner import Backbone
from p2pswarm.backbone.owners.socket_owner import SocketOwner
from p2pswarm.engine.arch import load_dense
from p2pswarm.engine.ggml.lib import default_threads
from p2pswarm.engine.kernels import make_bank, resolve_kernel
from p2pswarm.errors import UserError
from p2pswarm.model.layout import ModelLayout
from p2pswarm.model.manifest import model_fingerprint, source_fingerprint
from p2pswarm.backbone.owners.expert_cache import CacheSize, ExpertCache, cache_bound
from p2pswarm.model.slicer import slice_experts, split_ranges
from p2pswarm.worker.expert_worker import ExpertWorker

log = logging.getLogger("p2pswarm.backbone")


cache_dir = settings.cache_dir  # the one cache directory (kept importable from here)


def ensure_shards(layout: ModelLayout, fingerprint: str, n_workers: int, shard_dir: Path | None = None) -> list[Path]:
    """Shard files for N workers (all layers, experts split evenly); reused when already cut."""
    shard_dir = Path(shard_dir or cache_dir() / "shards" / fingerprint[:16])
    shard_dir.mkdir(parents=True, exist_ok=True)
    layers = layout.expert_layers
    paths = []
    for e0, e1 in split_ranges(layout.n_expert, n_workers):
        path = shard_dir / f"layers{layers[0]}-{layers[-1]}_experts{e0}-{e1 - 1}.gguf"
        if not path.exists():
            slice_experts(layout.path, path, (layers[0], layers[-1] + 1), (e0, e1), layout=layout,
                          fingerprint=fingerprint)
            log.debug("cut shard %s", path.name)
        paths.append(path)
    return paths


def start_cli_process(args: list[str], what: str, timeout_s: float = 60.0, *, env: dict | None = None,
                      stderr=None) -> tuple[subprocess.Popen, str]:
    """Start ``p2pswarm ARGS`` and wait for its ``READY <where>`` line; returns (process, where).
    ``env`` and ``stderr`` as for :class:`subprocess.Popen` (default: ours).

    The child starts with SIGINT blocked (a signal mask survives fork and exec): a Ctrl-C at a
    terminal reaches the whole process group, and the command that started the child is the one to
    report it and stop the child (SIGTERM, :func:`stop_process`). Without that, a Ctrl-C landing
    while the child was still importing printed its own "interrupted" line, or the interpreter's
    fatal-error traceback when it landed inside ``site``. SIGTERM and SIGHUP still reach it."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        proc = subprocess.Popen([sys.executable, "-m", "p2pswarm.cli", *args], stdout=subprocess.PIPE,
                                stdin=subprocess.DEVNULL, text=True, env=env, stderr=stderr)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
    line: list[str] = []
    out = proc.stdout
    assert out is not None  # (stdout=PIPE)
    try:
        reader = threading.Thread(target=lambda: line.append(out.readline()), daemon=True)
        reader.start()
        reader.join(timeout_s)
    except BaseException:  # interrupted while waiting: the child is not ours to leave behind
        proc.kill()
        proc.wait()
        raise
    if not line or not line[0].startswith("READY "):
        proc.kill()
        proc.wait()
        raise UserError(f"{what} did not start (exit code {proc.returncode})")
    return proc, line[0].split()[1]


def stop_process(proc: subprocess.Popen) -> None:
    """SIGTERM (a clean shutdown), then SIGKILL after 10 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@dataclass
class WorkerProcess:
    """A `p2pswarm worker` OS process serving one shard on 127.0.0.1."""

    proc: subprocess.Popen
    host: str
    port: int
    shard: Path

    @classmethod
    def start(cls, shard: Path, timeout_s: float = 60.0, extra_args: list[str] | None = None, *,
              kernel: str | None = None, threads: int | None = None) -> "WorkerProcess":
        args = ["worker", "--shard", str(shard), "--listen", "127.0.0.1:0",
                *(["--kernel", kernel] if kernel else []), *(["--threads", str(threads)] if threads else []),
                *(extra_args or [])]
        proc, where = start_cli_process(args, f"worker for {shard.name}", timeout_s)
        host, port = where.rsplit(":", 1)
        return cls(proc, host, int(port), shard)

    def stop(self) -> None:
        stop_process(self.proc)


@dataclass
class LocalSwarm:
    backbone: Backbone
    fingerprint: str
    workers: list[WorkerProcess]
    owners: list[Owner]
    #: the model's map as the backbone sees it (for a backbone file: its routed experts described
    #: from the source's header, their bytes in the expert store)
    layout: ModelLayout | None = None
    cache: ExpertCache | None = None
    filler: object = None  # its CacheFiller, once the swarm session starts one (cache_fill.py)


def local_experts(layout: ModelLayout, kernel: str, expert_cache: CacheSize | None, **bank_kw):
    """(bank, fingerprint, cache) of a backbone: the full model's bank, bounded by ``--expert-cache``
    (:class:`~p2pswarm.backbone.owners.expert_cache.ExpertCache`) when it is not ``all``; or, from a
    backbone file, a cache over the sparse expert store (empty at start: the swarm fills it).
    A backbone file's ``layout.expert_tensors`` is set from the store's: the dense path reads
    which layers route, and their shapes (never their bytes) there."""
    total = sum(layout.expert_bytes(layer) for layer in layout.expert_layers) * layout.n_expert
    if layout.shard_kind == "backbone":
        from p2pswarm.model.expert_store import ExpertStore, source_header

        fingerprint = source_fingerprint(layout)
        source_header(layout)  # a backbone file cut without it: one line now
        store = ExpertStore.for_backbone_file(layout, cache_dir("expert-store") / f"{fingerprint[:16]}.gguf")
        layout.expert_tensors = store.layout.expert_tensors
        total = sum(layout.expert_bytes(layer) for layer in layout.expert_layers) * layout.n_expert
        bound = cache_bound(expert_cache, total, holds_experts=False, what=str(layout.path))
        cache = ExpertCache(make_bank(store.layout, kernel, **bank_kw), bound, store=store)
        log.info("backbone from the backbone file %s: no routed experts held; expert cache of %.1f MB of %.1f MB, "
                 "in %s", layout.path.name, bound / 1e6, total / 1e6, store.path)
        return cache, fingerprint, cache
    layout.require_full_model()
    bank = make_bank(layout, kernel, **bank_kw)
    fingerprint = model_fingerprint(layout)
    if expert_cache is None or expert_cache.kind == "all":
        return bank, fingerprint, None
    bound = cache_bound(expert_cache, total, holds_experts=True, what=str(layout.path))
    cache = ExpertCache(bank, bound)
    cache.fill_from_file()
    log.info("expert cache: %d of %d units (%.1f of %.1f MB) computed here; the swarm's workers compute the rest",
             len(cache.held), len(cache.layers) * cache.n_expert, cache.used / 1e6, total / 1e6)
    return cache, fingerprint, cache


@asynccontextmanager
async def open_backbone(model_path, *, workers: int = 0, transport: str = "socket", shard_dir=None,
                        fallback: bool = True, timeout_s: float = 30.0, kernel: str | None = None,
                        threads: int | None = None, hot_experts: bool | None = False, verifier=None, ledger=None,
                        expert_cache: CacheSize | None = None):
    """Yield a :class:`LocalSwarm` whose backbone computes through ``workers`` expert workers.

    ``kernel``: None means $P2PSWARM_KERNEL, else auto; ``threads``: ggml threads per node.
    ``hot_experts``, ``verifier``, ``ledger``: the dispatcher's (:class:`Dispatcher`).
    ``hot_experts`` None: on when the backbone keeps only part of the experts (a cache), else off.
    ``expert_cache``: ``--expert-cache`` (None: the default, :func:`local_experts`); a backbone
    file (``slice --backbone``) as ``model_path`` holds no experts: the swarm computes them."""
    layout = ModelLayout.open(model_path)
    if layout.shard_kind == "backbone" and workers > 0:
        raise UserError(f"{layout.path} is a backbone file: local workers are cut from the full model; "
                        "serve it with `node --role backbone` and the swarm's workers")
    if layout.shard_kind != "backbone":
        layout.require_full_model()
    kernel = resolve_kernel(kernel)
    bank, fingerprint, cache = local_experts(layout, kernel, expert_cache, threads=threads,
                                             graph_cache_bytes=settings.GRAPH_CACHE_MB.get() << 20,
                                             scratch_keep_bytes=settings.SCRATCH_MB.get() << 20)
    model = load_dense(layout, kernel, threads=threads)
    # Workers on this host compute at the same time and share its CPUs; ggml's barriers spin, so
    # unless told otherwise each gets its share (the bits do not depend on the thread count).
    worker_threads = threads
    if worker_threads is None and workers > 0 and kernel == "ggml" and not settings.THREADS.is_set:
        worker_threads = max(1, default_threads() // workers)
    procs: list[WorkerProcess] = []
    owners: list[Owner] = []
    try:
        if workers > 0:
            shards = await trio.to_thread.run_sync(ensure_shards, layout, fingerprint, workers, shard_dir)
            for i, shard in enumerate(shards):
                worker_name = f"worker{i}"
                if transport == "inproc":
                    owners.append(InProcessOwner(ExpertWorker(shard, kernel=kernel, threads=worker_threads),
                                                 worker_name))
                elif transport == "socket":
                    wp = await trio.to_thread.run_sync(
                        partial(WorkerProcess.start, shard, kernel=kernel, threads=worker_threads))
                    procs.append(wp)
                    info = ExpertWorker.describe_shard(shard, kernel)
                    owners.append(SocketOwner(
                        worker_name, wp.host, wp.port, model_fingerprint=fingerprint, kernel=bank.kernel,
                        layers=(info.layer_begin, info.layer_end), experts=(info.expert_begin, info.expert_end),
                        timeout_s=timeout_s,
                    ))
                else:
                    raise UserError(f"unknown transport {transport!r} (use socket or inproc)")
        if hot_experts is None:
            hot_experts = cache is not None
        dispatcher = Dispatcher(bank, owners, fallback=fallback, hot_experts=hot_experts, verifier=verifier,
                                ledger=ledger)
        if cache is not None and cache.store is None:  # the full model: a unit nobody holds is here
            dispatcher.fetch = cache.fetch_from_file
        yield LocalSwarm(Backbone(model, dispatcher), fingerprint, procs, owners, layout, cache)
    finally:
        if cache is not None and cache.store is not None:
            cache.store.close()
        for o in owners:
            with trio.CancelScope(shield=True):
                await o.aclose()
        for wp in procs:
            wp.stop()
