"""What one verifier spot check costs the backbone's CPU, through the dispatcher's own check path.

A spot check recomputes a worker's sampled rows on the backbone's replica
(``Verification.check_layer`` -> ``LocalOwner.compute`` -> the ggml bank's ``forward_groups``).
This drives that path in one process, one check of one row of one expert at a time, on the model
bench/device_swarm.py serves (geometry-122b, ``--layers 2``, Q4_K experts of 5.3 MB), and prints
the process CPU per check (every thread: ggml's included):

* cold: each unit checked for the first time in this process (its slab's pages not yet mapped here;
  the file is in the page cache), what a short-lived backbone's checks mostly are;
* warm: the same units again.

``--threads`` is the bank's ggml threads (the backbone's default: every CPU); the checks run on
``CHECK_THREADS`` of them where the tree has that cap (p2pswarm.backbone.dispatch.verify). Run it
with PYTHONPATH set to each tree from a directory outside both to compare two trees.

    python bench/spot_check_cpu.py [--model M.gguf] [--checks 200] [--threads N] [--seed 1]
"""
from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
from pathlib import Path

import numpy as np
import trio

from p2pswarm.backbone.dispatch.dispatcher import Dispatcher
from p2pswarm.backbone.dispatch.verify import LayerChecks
from p2pswarm.backbone.sessions.local import local_experts
from p2pswarm.model.layout import ModelLayout
from p2pswarm.model.synth import make_model


class _Remote:
    """A stand-in remote owner: ``check_layer`` reads only the plan and the picks."""

    remote = True
    name = peer = "w"


async def _measure(disp: Dispatcher, units: list[tuple[int, int]], cur: np.ndarray) -> dict[str, np.ndarray]:
    owner = _Remote()

    async def one(layer: int, expert: int) -> float:
        checks = LayerChecks({owner: [(0, np.array([0]))]})  # type: ignore[dict-item]
        c0 = time.process_time()
        await disp.check_layer(layer, cur, [(expert, np.array([5]))], {owner: [0]}, checks)  # type: ignore[dict-item]
        return (time.process_time() - c0) * 1e3

    await one(*units[0])  # the graph built, the offload measured
    return {phase: np.array([await one(layer, e) for layer, e in units[1:]]) for phase in ("cold", "warm")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, help="a GGUF (default: geometry-122b --layers 2, made in a temp dir)")
    ap.add_argument("--checks", type=int, default=200)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="spot-check-") as tmp:
        model = a.model
        if model is None:
            model = Path(tmp) / "m.gguf"
            make_model(model, preset="geometry-122b", qtype="q8_0", seed=2, layers=2)
        layout = ModelLayout.open(model)
        bank, _, _ = local_experts(layout, "ggml", None, threads=a.threads, graph_cache_bytes=256 << 20,
                                   scratch_keep_bytes=2048 << 20)
        disp = Dispatcher(bank, [])
        cur = np.random.default_rng(0).standard_normal((16, bank.n_embd)).astype(np.float32)
        units = [(layer, e) for layer in sorted(bank.layers) for e in range(layout.n_expert)]
        random.Random(a.seed).shuffle(units)
        got = trio.run(_measure, disp, units[:a.checks + 1], cur)
    for phase, x in got.items():
        print(f"{phase}: CPU per check median {np.median(x):.3f} ms, mean {x.mean():.3f} ms ({len(x)} checks, "
              f"bank threads {bank.threads}, load {os.getloadavg()[0]:.2f})")


if __name__ == "__main__":
    main()
