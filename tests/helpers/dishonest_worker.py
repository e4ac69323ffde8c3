"""A worker node that returns wrong numbers for a fraction of its output rows (tests only).

The fault is injected here, in a subclass launched as its own process, so production code has no
"be dishonest" switch anywhere. Everything else is the real thing: the shard, the signed
DHT record (truthful), the expert protocol server and the receipt store of `p2pswarm node --role
worker`. Each output row is perturbed with probability ``--fraction`` (default 0.01, seeded by
``--seed``): one element moved by ``--delta``, small enough that the output still looks plausible.
With ``--honest-rows N`` it answers its first N rows honestly (earning receipts) before it cheats.
With ``--trust-issuer`` it serves its shard's (honest) slabs onwards, as a worker with a ``.source``
sidecar does. Prints ``READY <multiaddr>`` like a real node and logs how many rows it falsified on shutdown."""
from __future__ import annotations

import argparse
import logging
import sys

import numpy as np
import trio

from p2pswarm.market.receipts import ReceiptStore
from p2pswarm.net.wire import expert_protocol as proto
from p2pswarm.market.swarm_dht import open_dht
from p2pswarm.net.dht.advertiser import ShardAdvertiser
from p2pswarm.net.libp2p.host import open_host
from p2pswarm.net.signed.identity import load_or_create_identity
from p2pswarm.net.signed.records import ShardEntry
from p2pswarm.worker.expert_worker import worker_shard_hash
from p2pswarm.worker.expert_worker import ExpertWorker
from p2pswarm.worker.server import ServeStats, serve_libp2p

log = logging.getLogger("p2pswarm.worker")


class DishonestWorker(ExpertWorker):
    def __init__(self, shard, *, fraction: float, delta: float, seed: int, honest_rows: int = 0, **kw):
        super().__init__(shard, **kw)
        self.honest_rows = honest_rows
        self.fraction, self.delta = fraction, delta
        self.rng = np.random.default_rng(seed)
        self.rows = self.falsified = 0

    def compute(self, layer, rows, groups, family=None):
        outs = super().compute(layer, rows, groups, family)
        for out in outs:
            hit = self.rng.random(len(out)) < self.fraction
            hit[: max(0, self.honest_rows - self.rows)] = False
            out[hit, 0] += np.float32(self.delta)
            self.rows += len(out)
            self.falsified += int(hit.sum())
        return outs


async def main(args) -> None:
    worker = DishonestWorker(args.shard, kernel="numpy", fraction=args.fraction, delta=args.delta, seed=args.seed,
                             honest_rows=args.honest_rows)
    info = worker.info
    identity = load_or_create_identity(args.identity)
    entry = ShardEntry(info.model_fingerprint, worker_shard_hash(worker), (info.layer_begin, info.layer_end),
                       (info.expert_begin, info.expert_end))
    async with open_host(identity, ["/ip4/127.0.0.1/tcp/0"]) as net, \
            open_dht(net, server=True, bootstrap=[args.bootstrap]) as dht:
        receipts = ReceiptStore(args.receipts_dir, identity.peer_id_str)
        serve_libp2p(net, worker, stats=ServeStats(), receipts=receipts)
        if args.trust_issuer:  # its shard's slabs onwards, as a real worker does (they are honest bytes)
            from p2pswarm.net.shards.server import ShardFiles, load_source_sidecar
            from p2pswarm.net.signed.tokens import TokenGate

            manifest, header = load_source_sidecar(args.shard)
            ShardFiles(net, TokenGate([args.trust_issuer], what="shard server")).add(args.shard, manifest, header)
        adv = ShardAdvertiser(dht, identity, shards=[entry], protocol=proto.PROTOCOL_VERSION, kernel=info.kernel,
                              block_size=8, ttl_s=120)
        async with trio.open_nursery() as nursery:
            await nursery.start(adv.run)
            print(f"READY {net.full_addrs()[0]}", flush=True)
            with trio.open_signal_receiver(2, 15) as signals:
                async for _ in signals:
                    break
            nursery.cancel_scope.cancel()
        log.info("DISHONEST: served %d rows, falsified %d; stored %d receipts", worker.rows, worker.falsified,
                 receipts.stored)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--shard", required=True)
    p.add_argument("--bootstrap", required=True)
    p.add_argument("--identity", required=True)
    p.add_argument("--receipts-dir", required=True)
    p.add_argument("--fraction", type=float, default=0.01)
    p.add_argument("--delta", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--honest-rows", type=int, default=0)
    p.add_argument("--trust-issuer", help="serve the shard's slabs (its .source sidecar) to this issuer's tokens")
    logging.basicConfig(level="INFO", format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    trio.run(main, p.parse_args())
