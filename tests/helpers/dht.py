"""DHT swarms on real libp2p hosts on 127.0.0.1, inside one trio process (the DHT and market tests)."""
from __future__ import annotations

from contextlib import asynccontextmanager

import trio

from p2pswarm.market.swarm_dht import open_dht
from p2pswarm.net.libp2p.host import open_host
from p2pswarm.net.dht.advertiser import ShardAdvertiser
from p2pswarm.net.dht.coverage import CoverageResolver
from p2pswarm.net.signed.identity import Identity

MODEL = "ab" * 32  # the model key the DHT tests advertise and resolve
OTHER_MODEL = "ef" * 32


class Node:
    def __init__(self, net, dht):
        self.net, self.dht = net, dht

    @property
    def addr(self) -> str:
        return self.net.full_addrs()[0]


@asynccontextmanager
async def dht_swarm(n: int, *, clients: int = 0, refresh: bool = True):
    """``n`` DHT servers (node 0 the bootstrap) and ``clients`` client-mode nodes, started and
    stopped concurrently. Yields the list of Nodes, servers first."""
    nodes: list[Node | None] = [None] * (n + clients)
    stop = trio.Event()

    async def run(i: int, boot: list[str], task_status=trio.TASK_STATUS_IGNORED):
        async with open_host(Identity.generate()) as net:
            async with open_dht(net, server=i < n, bootstrap=boot) as dht:
                nodes[i] = Node(net, dht)
                task_status.started()
                await stop.wait()

    async with trio.open_nursery() as nursery:
        with trio.fail_after(120):
            await nursery.start(run, 0, [])
            boot = [nodes[0].addr]
            async with trio.open_nursery() as starters:
                for i in range(1, n + clients):
                    starters.start_soon(nursery.start, run, i, boot)
            if refresh:  # everyone joined: one more round so early joiners learn the late ones
                async with trio.open_nursery() as refreshers:
                    for node in nodes[:n]:
                        refreshers.start_soon(node.dht.refresh)
        try:
            yield nodes
        finally:
            stop.set()


def advertiser(node: Node, shards, *, block_size=4, ttl_s=120.0, **kw) -> ShardAdvertiser:
    return ShardAdvertiser(node.dht, node.net.identity, shards=shards, protocol=1, kernel="numpy",
                           block_size=block_size, ttl_s=ttl_s, **kw)


def resolver(node: Node, *, model=MODEL, layers=4, n_expert=16, block_size=4, **kw) -> CoverageResolver:
    return CoverageResolver(node.dht, model=model, layers=range(layers), n_expert=n_expert, block_size=block_size,
                            protocol=1, kernel="numpy", **kw)
