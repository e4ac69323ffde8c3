"""Time to resolve a full coverage map through the DHT.

    python bench/bench_coverage.py [--nodes 20] [--layers 48] [--blocks 32] [--block-size 8] [--workers 4]

`--nodes` DHT servers in one process on 127.0.0.1 (node 0 the bootstrap); `--workers` of them
advertise stripes of experts covering every layer (signed records + one provider record per
coverage unit); then a node that advertises nothing resolves every (layer, block) unit, as a
backbone does at start. Reports the time to advertise and the time to resolve, and how many units
came back covered. Then the steady state: a periodic refresh (re-read the known owners' records,
look up the uncovered units and a rotating quarter of the rest) against a full re-resolution
(every unit looked up again), both timed in the same run. Everything shares 2 cores here, so the
times are pessimistic.
"""
from __future__ import annotations

import argparse
import os
import time
from contextlib import AsyncExitStack

import trio
from common import header

from p2pswarm.model.slicer import split_ranges
from p2pswarm.market.swarm_dht import open_dht
from p2pswarm.net.dht.advertiser import ShardAdvertiser
from p2pswarm.net.dht.coverage import CoverageResolver
from p2pswarm.net.libp2p.host import open_host
from p2pswarm.net.signed.identity import Identity
from p2pswarm.net.signed.records import ShardEntry

MODEL = "bench-coverage-model"


async def run(args) -> tuple[float, float, int, int, float, float]:
    n_expert = args.blocks * args.block_size
    async with AsyncExitStack() as stack:
        nodes = []
        for i in range(args.nodes):
            net = await stack.enter_async_context(open_host(Identity.generate()))
            boot = [] if i == 0 else [nodes[0][0].full_addrs()[0]]
            dht = await stack.enter_async_context(open_dht(net, server=True, bootstrap=boot))
            nodes.append((net, dht))
        for _, dht in nodes[1:]:  # let every table learn of the late joiners
            await dht.refresh()
        t0 = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for w, (e0, e1) in enumerate(split_ranges(n_expert, args.workers)):
                net, dht = nodes[1 + w]
                adv = ShardAdvertiser(dht, net.identity, shards=[ShardEntry(MODEL, f"shard{w}", (0, args.layers), (e0, e1))],
                                      protocol=1, kernel="numpy", block_size=args.block_size, ttl_s=3600)
                nursery.start_soon(adv.publish)
        t_adv = time.perf_counter() - t0
        resolver = CoverageResolver(nodes[-1][1], model=MODEL, layers=range(args.layers), n_expert=n_expert,
                                    block_size=args.block_size, protocol=1, kernel="numpy")
        t0 = time.perf_counter()
        cmap = await resolver.refresh()
        t_res = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(resolver.rotation):  # one full rotation of periodic refreshes
            await resolver.refresh()
        t_periodic = (time.perf_counter() - t0) / resolver.rotation
        assert not resolver.map.missing()
        t0 = time.perf_counter()
        await resolver.refresh(resolver.units)  # everything looked up again, as before rotation
        t_full = time.perf_counter() - t0
        return t_adv, t_res, len(cmap.units), len(cmap.missing()), t_periodic, t_full


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=20)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--blocks", type=int, default=32)
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--workers", type=int, default=4)
    args = ap.parse_args()
    os.environ.setdefault("P2PSWARM_LOG_LEVEL", "WARNING")
    t_adv, t_res, units, missing, t_periodic, t_full = trio.run(run, args)
    text = header(f"Coverage map resolution, {args.layers} layers x {args.blocks} blocks, {args.nodes} DHT nodes",
                  f"python bench/bench_coverage.py --nodes {args.nodes} --layers {args.layers} --blocks {args.blocks}")
    text += (f"{args.workers} workers advertised {units} units ({args.block_size} experts each) in {t_adv:.1f} s; "
             f"a backbone resolved all of them in **{t_res:.1f} s** ({t_res / max(units, 1) * 1000:.1f} ms a unit), "
             f"{units - missing} covered, {missing} missing. All {args.nodes} nodes in one process on 2 shared cores.\n"
             f"Steady state: a periodic refresh {t_periodic:.1f} s vs a full re-resolution {t_full:.1f} s "
             f"(**ratio {t_periodic / t_full:.2f}**).\n")
    print(text)


if __name__ == "__main__":
    main()
