"""The swarm's cost per layer: libp2p expert RPC vs plain TCP, and decode tokens/s swarm vs monolithic.

    python bench/bench_swarm.py [--rounds 200] [--tokens 33]

All on 127.0.0.1 in one process (so the numbers are transport overhead, not network latency):

1. Round trip of one decode step's request for one owner (the rows and indices a layer sends, as
   an `echo` of the same bytes) through the worker's handler, over a plain TCP socket and over a
   libp2p stream (Noise + yamux) to the same worker: median ms and the ratio.
2. Tiny-model decode tokens/s: monolithic vs a backbone whose experts live on 2 worker nodes found
   through the DHT (libp2p), vs 2 local socket workers.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import trio
from common import header

from p2pswarm.backbone.dispatch import pack_rows
from p2pswarm.backbone.libp2p_owner import Libp2pOwner
from p2pswarm.backbone.session import WorkerProcess, ensure_shards, open_backbone
from p2pswarm.backbone.socket_owner import SocketOwner
from p2pswarm.backbone.swarm_session import open_swarm_backbone
from p2pswarm.model.layout import ModelLayout
from p2pswarm.model.manifest import model_fingerprint
from p2pswarm.model.synth import make_model
from p2pswarm.net import expert_protocol as proto
from p2pswarm.market.swarm_dht import open_dht
from p2pswarm.net.advertiser import ShardAdvertiser
from p2pswarm.net.coverage import OwnerInfo
from p2pswarm.net.host import open_host
from p2pswarm.net.identity import Identity
from p2pswarm.net.records import NodeRecord, ShardEntry
from p2pswarm.worker.expert_worker import worker_shard_hash
from p2pswarm.worker.expert_worker import ExpertWorker
from p2pswarm.worker.server import serve_libp2p


async def _median_rtt(owner, payload: bytes, rounds: int) -> float:
    await owner.echo(payload)  # connect + handshake first
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        await owner.echo(payload)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _entry(worker) -> ShardEntry:
    i = worker.info
    return ShardEntry(i.model_fingerprint, worker_shard_hash(worker), (i.layer_begin, i.layer_end),
                      (i.expert_begin, i.expert_end))


async def rtt(shard: Path, rounds: int) -> tuple[int, float, float]:
    worker = ExpertWorker(shard)
    info = worker.info
    # what one decode step sends one owner for one layer: 1 row, top-k experts of which ~2 are its own
    rows = np.random.default_rng(0).standard_normal((1, info.n_embd)).astype(np.float32)
    r, g = pack_rows(rows, [(info.expert_begin, np.array([0])), (info.expert_begin + 1, np.array([0]))])
    payload = proto.ComputeRequest(1, info.layer_begin, r, g).to_wire()
    wp = await trio.to_thread.run_sync(WorkerProcess.start, shard)
    try:
        tcp = SocketOwner("tcp", wp.host, wp.port, model_fingerprint=info.model_fingerprint, kernel=info.kernel,
                          layers=(info.layer_begin, info.layer_end), experts=(info.expert_begin, info.expert_end))
        t_tcp = await _median_rtt(tcp, payload, rounds)
        await tcp.aclose()
    finally:
        wp.stop()
    async with open_host(Identity.generate()) as wnet, open_host(Identity.generate()) as bnet:
        serve_libp2p(wnet, worker)
        rec = NodeRecord.make(wnet.identity, addrs=wnet.addrs(), protocol=proto.PROTOCOL_VERSION, kernel=info.kernel,
                              block_size=8, shards=[_entry(worker)], ttl_s=600)
        owner = Libp2pOwner(bnet, OwnerInfo(wnet.peer_id_str, rec.addrs, _entry(worker), rec),
                            model_fingerprint=info.model_fingerprint, kernel=info.kernel)
        t_p2p = await _median_rtt(owner, payload, rounds)
        await owner.aclose()
    return len(payload), t_tcp, t_p2p


async def decode_rate(model: Path, tokens: list[int], how: str, shards: list[Path]) -> float:
    async def run(backbone) -> float:
        state = backbone.new_state()
        await backbone.forward(tokens[:1], state)
        t = time.perf_counter()
        for tok in tokens[1:]:
            await backbone.forward([tok], state)
        return (len(tokens) - 1) / (time.perf_counter() - t)

    if how == "monolithic":
        async with open_backbone(model, workers=0) as s:
            return await run(s.backbone)
    if how == "socket":
        async with open_backbone(model, workers=len(shards)) as s:
            return await run(s.backbone)
    async with open_host(Identity.generate()) as boot_net, open_dht(boot_net) as _boot:
        boot = boot_net.full_addrs()[0]
        async with trio.open_nursery() as nursery:
            for shard in shards:
                await nursery.start(_worker_node, shard, boot)
            async with open_swarm_backbone(model, bootstrap=[boot]) as s:
                rate = await run(s.backbone)
            nursery.cancel_scope.cancel()
    return rate


async def _worker_node(shard: Path, boot: str, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    worker = ExpertWorker(shard)
    async with open_host(Identity.generate()) as net, open_dht(net, bootstrap=[boot]) as dht:
        serve_libp2p(net, worker)
        adv = ShardAdvertiser(dht, net.identity, shards=[_entry(worker)], protocol=proto.PROTOCOL_VERSION,
                              kernel=worker.info.kernel, block_size=8, ttl_s=600)
        async with trio.open_nursery() as nursery:
            await nursery.start(adv.run)
            task_status.started()
            await trio.sleep_forever()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=33)
    args = ap.parse_args()
    os.environ.setdefault("P2PSWARM_LOG_LEVEL", "WARNING")
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "tiny.gguf"
        make_model(model, preset="tiny")
        layout = ModelLayout.open(model)
        shards = ensure_shards(layout, model_fingerprint(layout), 2, Path(tmp) / "shards")
        nbytes, t_tcp, t_p2p = trio.run(rtt, shards[0], args.rounds)
        tokens = [(7 * i + 3) % 500 for i in range(args.tokens)]
        rates = {how: trio.run(decode_rate, model, tokens, how, shards) for how in ("monolithic", "socket", "libp2p")}
    text = header("Swarm transport: libp2p vs plain TCP, swarm vs monolithic decode",
                  f"python bench/bench_swarm.py --rounds {args.rounds} --tokens {args.tokens}")
    text += (f"One owner's request of one decode layer ({nbytes} bytes, echoed by the worker's handler), median of "
             f"{args.rounds}: plain TCP {t_tcp * 1e3:.3f} ms, libp2p (Noise + yamux) {t_p2p * 1e3:.3f} ms: "
             f"**libp2p / TCP = {t_p2p / t_tcp:.2f}**.\n\n"
             f"Tiny qwen3moe decode over {args.tokens - 1} steps, 2 workers: monolithic {rates['monolithic']:.1f} tok/s, "
             f"local socket workers {rates['socket']:.1f} tok/s ({rates['socket'] / rates['monolithic']:.2f}), "
             f"swarm via DHT + libp2p {rates['libp2p']:.1f} tok/s "
             f"(**swarm / monolithic = {rates['libp2p'] / rates['monolithic']:.2f}**).\n")
    print(text)


if __name__ == "__main__":
    main()
