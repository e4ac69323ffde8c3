"""Worker peak memory vs its shard's size (geometry-122b Q4_K experts), per expert kernel.

    python bench/bench_worker_memory.py [--kernel numpy|ggml|auto] [--layers 2] [--model M.gguf]

Starts a real `p2pswarm worker --kernel K` process on a shard of 8 and of 64 experts (``--layers``
layers), sends one request per layer touching every expert it holds, then reads the process's peak
resident set (VmHWM) and what it is made of (RssAnon: private memory; RssFile: mapped file pages,
the shard's among them). The numpy kernel keeps float32 copies: ~7.1x the Q4_K bytes. The ggml
kernel computes on the mapped bytes: peak = shard + a fixed overhead (Python, numpy, trio, libggml).
``--model`` cuts the shards from another model instead (e.g. ``make-model --arch gpt-oss --preset
geometry-gpt-oss-120b --layers 2``: MXFP4 experts with their bias rows).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import trio
from common import header, peak_rss_mb

from p2pswarm.backbone.sessions.local import WorkerProcess
from p2pswarm.backbone.owners.socket_owner import SocketOwner
from p2pswarm.engine.kernels import kernel_id, resolve_kernel
from p2pswarm.model.layout import ModelLayout
from p2pswarm.model.slicer import slice_experts
from p2pswarm.model.synth import make_model
from p2pswarm.worker.expert_worker import ExpertWorker


def rss_mb(pid: int) -> dict[str, float]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(rest.split()[0]) / 1024
    return out


async def touch_all(wp: WorkerProcess, shard: Path, kernel: str) -> float:
    info = ExpertWorker.describe_shard(shard, kernel)
    owner = SocketOwner("w", wp.host, wp.port, model_fingerprint=info.model_fingerprint, kernel=kernel_id(kernel),
                        layers=(info.layer_begin, info.layer_end), experts=(info.expert_begin, info.expert_end),
                        timeout_s=600)
    idle = peak_rss_mb(wp.proc.pid)
    rows = np.random.default_rng(0).standard_normal((4, info.n_embd)).astype(np.float32)
    for layer in ModelLayout.open(shard).expert_layers:  # a dense layer (deepseek2's first) holds none
        groups = [(e, np.arange(4)) for e in range(info.expert_begin, info.expert_end)]
        await owner.compute(layer, rows, groups)
    await owner.aclose()
    return idle


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernel", choices=("auto", "numpy", "ggml"), default="numpy")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--model", type=Path, help="cut the shards from this GGUF (default: geometry-122b, made)")
    args = ap.parse_args()
    kernel = resolve_kernel(args.kernel)
    d = Path("/tmp/p2pswarm-bench")
    d.mkdir(parents=True, exist_ok=True)
    model = args.model or d / f"geometry-122b-{args.layers}l.gguf"
    if not model.exists():
        make_model(model, preset="geometry-122b", layers=args.layers)
    text = header(f"Worker memory vs shard size ({model.name if args.model else 'geometry-122b'}, {kernel} kernel)",
                  f"python bench/bench_worker_memory.py --kernel {args.kernel} --layers {args.layers}"
                  + (f" --model {model.name}" if args.model else ""))
    text += (f"Kernel `{kernel_id(kernel)}`. MiB throughout.\n\n"
             "| experts/layer x layers | shard | idle peak RSS | peak RSS after touching every expert | "
             "peak - shard | peak / shard | RssAnon | RssFile |\n|---|---|---|---|---|---|---|---|\n")
    for n in (8, 64):
        shard = d / f"mem-shard-{n}.gguf"
        slice_experts(model, shard, None, (0, n))
        wp = WorkerProcess.start(shard, kernel=kernel)
        try:
            idle = trio.run(touch_all, wp, shard, kernel)
            peak = peak_rss_mb(wp.proc.pid)
            now = rss_mb(wp.proc.pid)
        finally:
            wp.stop()
        size = shard.stat().st_size / 2**20
        text += (f"| {n} x {args.layers} | {size:.0f} | {idle:.0f} | {peak:.0f} | {peak - size:.0f} | "
                 f"{peak / size:.2f} | {now['RssAnon']:.0f} | {now['RssFile']:.0f} |\n")
        shard.unlink()
    print(text)


if __name__ == "__main__":
    main()
