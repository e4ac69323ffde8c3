"""A worker node whose signed DHT record lies about its model or kernel (a buggy or malicious peer).

It serves a shard of one model but advertises it as a shard of another (``--claim-model``), so a
backbone of the claimed model finds it through the DHT, dials it, and must refuse it at the
handshake. With ``--claim-kernel`` its record names another kernel (a worker built differently,
without needing that kernel here): a backbone must refuse it from the record alone. Built from the
same library pieces as `p2pswarm node --role worker`; only the record's model or kernel is forged.
Prints ``READY <multiaddr>`` like a real node."""
from __future__ import annotations

import argparse
import logging
import sys

import trio

from p2pswarm.net.wire import expert_protocol as proto
from p2pswarm.market.swarm_dht import open_dht
from p2pswarm.net.dht.advertiser import ShardAdvertiser
from p2pswarm.net.libp2p.host import open_host
from p2pswarm.net.signed.identity import load_or_create_identity
from p2pswarm.net.signed.records import ShardEntry
from p2pswarm.worker.expert_worker import worker_shard_hash
from p2pswarm.worker.expert_worker import ExpertWorker
from p2pswarm.worker.server import ServeStats, serve_libp2p


async def main(args) -> None:
    worker = ExpertWorker(args.shard, kernel="numpy")
    info = worker.info
    identity = load_or_create_identity(args.identity)
    lie = ShardEntry(args.claim_model or info.model_fingerprint, worker_shard_hash(worker),
                     (info.layer_begin, info.layer_end), (info.expert_begin, info.expert_end))
    async with open_host(identity, ["/ip4/127.0.0.1/tcp/0"]) as net, \
            open_dht(net, server=True, bootstrap=[args.bootstrap]) as dht:
        stats = ServeStats()
        serve_libp2p(net, worker, stats=stats)
        adv = ShardAdvertiser(dht, identity, shards=[lie], protocol=proto.PROTOCOL_VERSION,
                              kernel=args.claim_kernel or info.kernel,
                              block_size=8, ttl_s=120)
        await adv.publish()
        print(f"READY {net.full_addrs()[0]}", flush=True)
        with trio.open_signal_receiver(2, 15) as signals:
            async for _ in signals:
                break
        logging.getLogger("p2pswarm.worker").info("served %d requests; refused %d handshakes", stats.requests,
                                                  stats.refused)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--shard", required=True)
    p.add_argument("--claim-model")
    p.add_argument("--claim-kernel")
    p.add_argument("--bootstrap", required=True)
    p.add_argument("--identity", required=True)
    logging.basicConfig(level="INFO", format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    trio.run(main, p.parse_args())
