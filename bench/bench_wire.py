"""CPU and wall time of one expert request over libp2p (Noise + yamux) or the direct lane, both ends in one process.

    python bench/bench_wire.py [--rows 64] [--requests 200 --blocks 5] [--depth 1 --depth 4] [--profile OUT]
                               [--transport libp2p|direct]

A real worker (``ExpertWorker`` on a tiny q8_0 shard, the ggml kernel) served by the real
``handle_connection`` on its own libp2p host, and a real ``Libp2pOwner`` on another host, on
127.0.0.1, in one trio process. It sends ``--blocks`` blocks of ``--requests`` compute requests of ``--rows`` distinct rows
(a decode step of that many sequences: each row to ``--experts-per-row`` of the worker's experts,
as the tiny model's router would send them), ``--depth`` of them in flight at once, and reports per
request (the median block): wall time, process CPU time (both ends together: the cost a 2-core host pays per request),
and the expert math alone (the same requests through ``worker.compute``, no transport). So
``CPU - compute`` is the transport's per-request cost: msgpack, framing, yamux, Noise, trio
scheduling, the worker's thread hop; and trio task steps per request (both ends; each a trip
through the scheduler), which unlike CPU time a shared machine does not make noisy. ``--profile OUT`` records the process with py-spy (``--gil``)
and writes its collapsed stacks to OUT.

This is the measurement behind the "per-request transport cost" section of docs/benchmarks.md;
PYTHONPATH picks the code under test (main vs a branch, alternating).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def _cpu() -> float:
    return time.process_time()


class StepCounter(trio.abc.Instrument):
    """Counts trio task steps (each a trip through the scheduler): a noise-free measure of the
    event-loop work per request, beside the CPU time that a shared machine makes noisy."""

    def __init__(self) -> None:
        self.steps = 0

    def before_task_step(self, task) -> None:
        self.steps += 1


async def run(args) -> list[dict]:
    from helpers.owners import libp2p_owner, served  # after sys.path

    from p2pswarm.backbone.dispatch.dispatcher import pack_rows
    from p2pswarm.backbone.sessions.local import ensure_shards
    from p2pswarm.model.layout import ModelLayout
    from p2pswarm.model.manifest import model_fingerprint
    from p2pswarm.model.synth import make_model
    from p2pswarm.net.libp2p.host import open_host
    from p2pswarm.net.signed.identity import Identity
    from p2pswarm.worker.expert_worker import ExpertWorker

    work = Path(tempfile.mkdtemp(prefix="bench-wire-"))
    model = work / "tiny-q8.gguf"
    make_model(model, preset="tiny", qtype="q8_0", seed=2, layers=4)
    layout = ModelLayout.open(model)
    shard = ensure_shards(layout, model_fingerprint(layout), 4, work / "shards")[0]
    worker = ExpertWorker(shard)
    info = worker.info
    rng = np.random.default_rng(1)
    experts = np.arange(info.expert_begin, info.expert_end)

    def request(rows: int):
        cur = rng.standard_normal((rows, info.n_embd)).astype(np.float32)
        pick = np.array([rng.choice(experts, args.experts_per_row, replace=False) for _ in range(rows)])
        groups = [(int(e), np.nonzero((pick == e).any(axis=1))[0]) for e in experts]
        return cur, [(e, idx) for e, idx in groups if len(idx)]

    from p2pswarm.net.wire.direct import DirectLane
    from p2pswarm.net.wire.framing import DEFAULT_MAX_FRAME

    results = []
    lane = DirectLane("127.0.0.1", 0, max_frame=DEFAULT_MAX_FRAME) if args.transport == "direct" else None
    async with trio.open_nursery() as lanes, served(worker, direct=lane) as wnet, \
            open_host(Identity.generate()) as bnet:
        if lane is not None:
            await lanes.start(lane.serve)
        owner = libp2p_owner(bnet, wnet, worker, timeout_s=60, direct=lane is not None)
        reqs = [request(args.rows) for _ in range(16)]
        for _ in range(20):  # warm-up: connection, handshake, caches
            await owner.compute(info.layer_begin, *reqs[0])
        # the expert math alone, for the same requests (no transport)
        per_block = []
        for _ in range(args.blocks):
            t0 = _cpu()
            for i in range(args.requests):
                cur, groups = reqs[i % len(reqs)]
                rows, local = pack_rows(cur, groups)
                worker.compute(info.layer_begin + i % (info.layer_end - info.layer_begin), rows, local)
            per_block.append((_cpu() - t0) / args.requests)
        compute_cpu = statistics.median(per_block)
        spy = None
        if args.profile:
            spy = subprocess.Popen(["py-spy", "record", "--pid", str(os.getpid()), "--rate", "500", "--format", "raw",
                                    "--gil", "--nonblocking", "-o", args.profile],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            await trio.sleep(1.5)
        for depth in args.depth:
            blocks = []
            for _ in range(args.blocks):  # the median block: the machine is shared, single runs are noisy
                lat: list[float] = []

                async def client(k: int) -> None:
                    for i in range(k, args.requests, depth):
                        cur, groups = reqs[i % len(reqs)]
                        t = time.perf_counter()
                        await owner.compute(info.layer_begin + i % (info.layer_end - info.layer_begin), cur, groups)
                        lat.append(time.perf_counter() - t)

                counter = StepCounter()
                trio.lowlevel.add_instrument(counter)
                c0, w0 = _cpu(), time.perf_counter()
                async with trio.open_nursery() as nursery:
                    for k in range(depth):
                        nursery.start_soon(client, k)
                wall, cpu = time.perf_counter() - w0, _cpu() - c0
                trio.lowlevel.remove_instrument(counter)
                blocks.append((1000 * cpu / args.requests, 1000 * wall / args.requests, 1000 * statistics.median(lat),
                               counter.steps / args.requests))
            out_rows = sum(len(idx) for _, idx in reqs[0][1])
            results.append({"depth": depth, "rows": args.rows, "out_rows": out_rows,
                            "cpu_ms": statistics.median(b[0] for b in blocks),
                            "wall_ms": statistics.median(b[1] for b in blocks),
                            "rtt_median_ms": statistics.median(b[2] for b in blocks),
                            "steps": statistics.median(b[3] for b in blocks),
                            "compute_ms": 1000 * compute_cpu})
        if spy is not None:
            spy.send_signal(2)
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(spy.wait)
        assert owner.lane == ("direct" if lane is not None else "libp2p"), owner.lane
        await owner.aclose()
        lanes.cancel_scope.cancel()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=64, help="distinct rows per request (sequences in the step)")
    ap.add_argument("--experts-per-row", type=int, default=2,
                    help="of this worker's experts, per row (tiny: top-4 of 16 over 4 workers: ~1-2)")
    ap.add_argument("--requests", type=int, default=200, help="per block")
    ap.add_argument("--blocks", type=int, default=5, help="blocks per depth; the median block is reported")
    ap.add_argument("--depth", type=int, action="append", default=None, help="requests in flight (repeatable)")
    ap.add_argument("--profile", help="py-spy collapsed stacks of the measured part to this file")
    ap.add_argument("--transport", choices=["libp2p", "direct"], default="libp2p",
                    help="libp2p: the yamux + Noise stream; direct: the worker's direct lane, a sealed TCP "
                         "connection keyed through that stream (p2pswarm/net/wire/direct.py)")
    args = ap.parse_args()
    args.depth = args.depth or [1, 4]
    os.environ.setdefault("P2PSWARM_KERNEL", "ggml")
    os.environ.setdefault("P2PSWARM_THREADS", "1")
    for r in trio.run(run, args):
        print(f"{args.transport:6s} rows {r['rows']:3d} (out {r['out_rows']:3d}) depth {r['depth']}: wall {r['wall_ms']:.3f} ms/request, "
              f"CPU {r['cpu_ms']:.3f} ms/request (expert math alone {r['compute_ms']:.3f}, "
              f"transport {r['cpu_ms'] - r['compute_ms']:.3f}), round trip median {r['rtt_median_ms']:.3f} ms, "
              f"{r['steps']:.1f} trio task steps/request", flush=True)


if __name__ == "__main__":
    main()
