"""A backbone that finds its expert owners in the swarm: DHT look-ups, libp2p expert RPC.

``open_swarm_backbone(model, bootstrap=[...])`` is `open_backbone(workers=0)` (dense path + every
expert as the local fallback replica) plus a libp2p host and DHT node, a
:class:`CoverageResolver` that maps every (layer, expert) to owners and replicas through DHT
look-ups (refreshed periodically and at once on a failure), and a :class:`SwarmOwners` pool the
dispatcher routes to (least loaded, then nearest replica first). Nothing here is a static list.
It also publishes the backbone's signed demand record (:mod:`p2pswarm.market.demand`: the
dispatcher's decayed routing counts per unit) for workers that enrol by themselves (``--auto``).
"""
from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass

import trio

from p2pswarm.backbone.libp2p_owner import SwarmOwners
from p2pswarm.backbone.session import LocalSwarm, open_backbone
from p2pswarm.model.layout import ModelLayout
from p2pswarm.net import expert_protocol as proto
from p2pswarm.net.dht import CoverageResolver, open_dht
from p2pswarm.net.host import DEFAULT_LISTEN, NetHost, open_host
from p2pswarm.net.identity import Identity
from p2pswarm.net.records import DEFAULT_BLOCK_SIZE

log = logging.getLogger("p2pswarm.backbone")


@dataclass
class SwarmBackbone:
    local: LocalSwarm
    net: NetHost
    resolver: CoverageResolver
    pool: SwarmOwners
    demand: object = None  # its DemandPublisher (None for a short-lived backbone)

    @property
    def backbone(self):
        return self.local.backbone


@asynccontextmanager
async def open_swarm_backbone(model_path, *, bootstrap: list[str], identity: Identity | None = None,
                              listen: list[str] | None = None, announce: list[str] | None = None,
                              block_size: int = DEFAULT_BLOCK_SIZE,
                              kernel: str | None = None, threads: int | None = None, timeout_s: float = 30.0,
                              refresh_s: float = 30.0, dht_server: bool = True, demand_ttl_s: float | None = None):
    """``dht_server=False`` for a short-lived backbone (``logits/generate --swarm``): it looks
    things up but does not join other nodes' routing tables, where it would linger as a dead or
    unresponsive entry after it exits. ``demand_ttl_s``: lifetime of the published demand record
    (re-published every third of it; default 120 s); a short-lived backbone publishes none."""
    async with open_backbone(model_path, workers=0, kernel=kernel, threads=threads) as local:
        layout = ModelLayout.open(model_path)
        bank = local.backbone.dispatcher.local.bank
        async with open_host(identity or Identity.generate(), listen or [DEFAULT_LISTEN], announce=announce) as net:
            async with open_dht(net, server=dht_server, bootstrap=bootstrap) as dht:
                resolver = CoverageResolver(dht, model=local.fingerprint, layers=layout.expert_layers,
                                            n_expert=layout.n_expert, block_size=block_size,
                                            protocol=proto.PROTOCOL_VERSION, kernel=bank.kernel,
                                            refresh_s=refresh_s)
                pool = SwarmOwners(net, model_fingerprint=local.fingerprint, kernel=bank.kernel,
                                   timeout_s=timeout_s, resolver=resolver)
                resolver.on_change = pool.sync
                pool.attach(local.backbone.dispatcher)
                try:
                    async with trio.open_nursery() as nursery:
                        await nursery.start(resolver.run)
                        nursery.start_soon(pool.keepalive)
                        publisher = None
                        if dht_server:
                            from p2pswarm.market.demand import DEFAULT_DEMAND_TTL_S, DemandPublisher

                            publisher = DemandPublisher(
                                dht, net.identity, local.backbone.dispatcher.demand, model=local.fingerprint,
                                layers=layout.expert_layers, n_expert=layout.n_expert, block_size=block_size,
                                unit_bytes=[layout.expert_bytes(layer) * block_size for layer in layout.expert_layers],
                                ttl_s=demand_ttl_s or DEFAULT_DEMAND_TTL_S)
                            nursery.start_soon(publisher.run)
                        cmap = resolver.map
                        log.info("coverage: %d units, %d missing (computed locally), %d remote owners",
                                 len(cmap.units), len(cmap.missing()), len(pool.owners))
                        yield SwarmBackbone(local, net, resolver, pool, publisher)
                        nursery.cancel_scope.cancel()
                finally:
                    with trio.CancelScope(shield=True):
                        await pool.aclose()
