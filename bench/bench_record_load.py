"""DHT load of a worker's advertising: short-lived records refreshed often vs the old cadence.

    python bench/bench_record_load.py [--nodes 10] [--layers 12] [--blocks 8] [--rounds 3]

`--nodes` DHT servers in one process on 127.0.0.1; one of them advertises a shard of `--layers` x
`--blocks` coverage units. Measured, alternating A B A B in the same run: A = one record refresh
(`ShardAdvertiser.publish_record`: one look-up and the stores of the signed record, what the
worker now sends every ttl/3 = 20 s) and B = one full publish (record + every unit + the model key:
what it sent every ttl/3 = 200 s before, and now every 300 s). Reports kad RPCs (value stores
included) and seconds of each, and what they add up to per hour for both schemes, with the liveness bound each gives (a
killed worker drops out of look-ups within one TTL: 600 s before, 60 s now).
"""
from __future__ import annotations

import argparse
import time
from contextlib import AsyncExitStack

import trio
from common import header

from p2pswarm.market.swarm_dht import open_dht
from p2pswarm.net.dht.advertiser import ShardAdvertiser
from p2pswarm.net.dht.kademlia import REPROVIDE_S
from p2pswarm.net.libp2p.host import open_host
from p2pswarm.net.signed.identity import Identity
from p2pswarm.net.signed.records import DEFAULT_RECORD_TTL_S, ShardEntry

MODEL = "ab" * 32
OLD_TTL_S = 600.0


async def run(args) -> dict[str, list[tuple[int, float]]]:
    async with AsyncExitStack() as stack:
        nodes = []
        for i in range(args.nodes):
            net = await stack.enter_async_context(open_host(Identity.generate()))
            boot = [] if i == 0 else [nodes[0][0].full_addrs()[0]]
            dht = await stack.enter_async_context(open_dht(net, server=True, bootstrap=boot))
            nodes.append((net, dht))
        for _, dht in nodes[1:]:
            await dht.refresh()
        net, dht = nodes[-1]
        # Value stores go through the library's sender, not SwarmDHT._rpc: count them too.
        store, stores = dht.kad.value_store._store_at_peer, [0]

        async def counted_store(*a, **kw):
            stores[0] += 1
            return await store(*a, **kw)

        dht.kad.value_store._store_at_peer = counted_store
        shard = ShardEntry(MODEL, "s", (0, args.layers), (0, args.blocks * 8))
        adv = ShardAdvertiser(dht, net.identity, shards=[shard], protocol=1, kernel="numpy", block_size=8)
        await adv.publish()  # warm: connections open, tables full
        out: dict[str, list[tuple[int, float]]] = {"record": [], "full": []}
        for _ in range(args.rounds):
            for name, step in (("record", adv.publish_record), ("full", adv.publish)):
                rpcs, t0 = dht.stats.rpcs + stores[0], time.perf_counter()
                await step()
                out[name].append((dht.stats.rpcs + stores[0] - rpcs, time.perf_counter() - t0))
        return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=10)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    import sys

    print(header(f"Worker advertising load: record refresh vs full publish ({args.nodes} DHT nodes, "
                 f"{args.layers * args.blocks} units)", "python " + " ".join(sys.argv)))
    res = trio.run(run, args)
    med = {k: sorted(v)[len(v) // 2] for k, v in res.items()}
    for k, v in res.items():
        print(f"{k:>6}: RPCs {[r for r, _ in v]}, seconds {[round(s, 2) for _, s in v]}")
    rec, full = med["record"][0], med["full"][0]
    old = 3600 / (OLD_TTL_S / 3) * full
    new = 3600 / (DEFAULT_RECORD_TTL_S / 3) * rec + 3600 / REPROVIDE_S * full
    print(f"per hour: before (TTL {OLD_TTL_S:.0f} s, everything every {OLD_TTL_S / 3:.0f} s) {old:.0f} RPCs; "
          f"now (record every {DEFAULT_RECORD_TTL_S / 3:.0f} s, units every {REPROVIDE_S:.0f} s) {new:.0f} RPCs: "
          f"{new / old:.2f}x the RPCs for a {OLD_TTL_S / DEFAULT_RECORD_TTL_S:.0f}x tighter liveness bound "
          f"({OLD_TTL_S:.0f} s -> {DEFAULT_RECORD_TTL_S:.0f} s)")


if __name__ == "__main__":
    main()
