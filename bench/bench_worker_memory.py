"""Worker peak memory vs its shard's size (geometry-122b Q4_K experts, numpy kernel).

    python bench/bench_worker_memory.py

Starts a real `p2pswarm worker` process on a shard of 8 and of 64 experts (2 layers), sends one
request touching every expert it holds (so each is dequantised into the cache), then reads the
process's peak resident set (VmHWM). The numpy kernel keeps float32 copies: ~7.1x the Q4_K bytes.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import trio
from common import header, peak_rss_mb

from p2pswarm.backbone.session import WorkerProcess
from p2pswarm.backbone.socket_owner import SocketOwner
from p2pswarm.model.slicer import slice_experts
from p2pswarm.model.synth import make_model
from p2pswarm.worker.expert_worker import ExpertWorker


async def touch_all(wp: WorkerProcess, shard: Path) -> float:
    info = ExpertWorker.describe_shard(shard)
    owner = SocketOwner("w", wp.host, wp.port, model_fingerprint=info.model_fingerprint, kernel="numpy",
                        layers=(info.layer_begin, info.layer_end), experts=(info.expert_begin, info.expert_end),
                        timeout_s=600)
    idle = peak_rss_mb(wp.proc.pid)
    rows = np.random.default_rng(0).standard_normal((4, info.n_embd)).astype(np.float32)
    for layer in range(info.layer_begin, info.layer_end):
        groups = [(e, np.arange(4)) for e in range(info.expert_begin, info.expert_end)]
        await owner.compute(layer, rows, groups)
    await owner.aclose()
    return idle


def main() -> None:
    d = Path("/tmp/p2pswarm-bench")
    d.mkdir(parents=True, exist_ok=True)
    model = d / "geometry-122b-2l.gguf"
    if not model.exists():
        make_model(model, preset="geometry-122b", layers=2)
    text = header("Worker memory vs shard size (geometry-122b, numpy kernel)", "python bench/bench_worker_memory.py")
    text += ("| experts/layer x layers | shard MB | idle peak RSS MB | peak RSS after touching every expert MB | "
             "peak / shard |\n|---|---|---|---|---|\n")
    for n in (8, 64):
        shard = d / f"mem-shard-{n}.gguf"
        slice_experts(model, shard, None, (0, n))
        wp = WorkerProcess.start(shard, extra_args=[])
        try:
            idle = trio.run(touch_all, wp, shard)
            peak = peak_rss_mb(wp.proc.pid)
        finally:
            wp.stop()
        size = shard.stat().st_size / 2**20
        text += f"| {n} x 2 | {size:.0f} | {idle:.0f} | {peak:.0f} | {peak / size:.1f} |\n"
        shard.unlink()
    print(text)


if __name__ == "__main__":
    main()
