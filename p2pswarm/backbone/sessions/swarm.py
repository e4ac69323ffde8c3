"""A backbone that finds its expert owners in the swarm: DHT look-ups, libp2p expert RPC.

``open_swarm_backbone(model, bootstrap=[...])`` is `open_backbone(workers=0)` (dense path + every
expert as the local fallback replica) plus a libp2p host and DHT node, a
:class:`CoverageResolver` that maps every (layer, expert) to owners and replicas through DHT
look-ups (refreshed periodically and at once on a failure), and a :class:`SwarmOwners` pool the
dispatcher routes to (least loaded, then nearest replica first). Nothing here is a static list.

The market's checks ride along (docs/market.md, "Receipts and verification"): the dispatcher
recomputes a sample (``verify_rate``) of every worker's outputs and bans a worker caught lying
(:class:`~p2pswarm.market.bans.BanKeeper`: a signed ban record in the DHT, honoured by backbones
that trust us); it credits the work it used to each worker and sends signed receipts every
``receipt_period_s`` and once more on the way out.

It also publishes the backbone's signed demand record (:mod:`p2pswarm.market.demand`: the
dispatcher's decayed routing counts per unit) for workers that enrol by themselves (``--auto``).
"""
from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass

import trio

from p2pswarm.backbone.owners.libp2p_owner import SwarmOwners
from p2pswarm.backbone.serving.runner import Backbone
from p2pswarm.backbone.sessions.local import LocalSwarm, open_backbone
from p2pswarm.market.bans import BanKeeper
from p2pswarm.market.last_receipt import serve_receipt_requests
from p2pswarm.market.receipts import ContributionLedger, ReceiptIssuer
from p2pswarm.market.verify import DEFAULT_CHECK_FETCH_BYTES, DEFAULT_VERIFY_RATE, CheckFetchBudget, Verifier
from p2pswarm.model.layout import ModelLayout
from p2pswarm.model.manifest import source_fingerprint
from p2pswarm.net.wire import expert_protocol as proto
from p2pswarm.market.swarm_dht import open_dht
from p2pswarm.net.dht.coverage import CoverageResolver
from p2pswarm.net.libp2p.addrs import DEFAULT_LISTEN
from p2pswarm.net.libp2p.host import NetHost, open_host
from p2pswarm.net.signed.identity import Identity
from p2pswarm.net.signed.records import DEFAULT_BLOCK_SIZE

log = logging.getLogger("p2pswarm.backbone")


@dataclass
class SwarmBackbone:
    local: LocalSwarm
    net: NetHost
    resolver: CoverageResolver
    pool: SwarmOwners
    bans: BanKeeper | None = None
    receipts: ReceiptIssuer | None = None
    demand: object = None  # its DemandPublisher (None for a short-lived backbone)

    @property
    def backbone(self) -> Backbone:
        return self.local.backbone


@asynccontextmanager
async def open_swarm_backbone(model_path, *, bootstrap: list[str], identity: Identity | None = None,
                              listen: list[str] | None = None, announce: list[str] | None = None,
                              block_size: int = DEFAULT_BLOCK_SIZE,
                              kernel: str | None = None, threads: int | None = None, timeout_s: float = 30.0,
                              refresh_s: float = 30.0, dht_server: bool = True,
                              verify_rate: float = DEFAULT_VERIFY_RATE, verify_seed: int | None = None,
                              trust_bans: tuple[str, ...] | list[str] = (), receipt_period_s: float = 60.0,
                              ban_refresh_s: float = 30.0, demand_ttl_s: float | None = None, direct: bool = True,
                              hot_experts: bool | None = False, expert_cache=None, shard_token: str | None = None,
                              trust_issuers: list[str] | None = None, cache_refill_s: float = 30.0,
                              verify_fetch_budget: int = DEFAULT_CHECK_FETCH_BYTES):
    """``dht_server=False`` for a short-lived backbone (``logits/generate --swarm``): it looks
    things up but does not join other nodes' routing tables, where it would linger as a dead or
    unresponsive entry after it exits. ``verify_rate``: the fraction of remote output rows
    recomputed locally (0 turns verification off); ``trust_bans``: backbones whose ban records
    we honour besides our own. ``demand_ttl_s``: lifetime of the published demand record
    (re-published every third of it; default 120 s); a short-lived backbone publishes none.
    ``direct``: take the direct lanes workers offer (p2pswarm/net/wire/direct.py). ``hot_experts``:
    compute locally what a slow owner would take longer to return (:class:`Dispatcher`).
    ``expert_cache``: ``--expert-cache`` (:mod:`p2pswarm.backbone.owners.expert_cache`); ``model_path``
    may be the backbone file (`slice --backbone`), whose experts the swarm computes; then
    ``shard_token`` (a node token for shard downloads, issued by one of ``trust_issuers``, who
    also sign the manifest) lets it fetch units into its cache from the model's shard sources
    (:mod:`p2pswarm.backbone.sessions.cache_fill`): the hottest by demand every ``cache_refill_s``, and
    any unit no live owner holds, on demand, and, at most ``verify_fetch_budget`` bytes a minute,
    the units a verification check picks that the cache lacks (p2pswarm.market.verify)."""
    identity = identity or Identity.generate()
    ledger = ContributionLedger(identity, source_fingerprint(ModelLayout.open(model_path)))
    verifier = Verifier(verify_rate, verify_seed) if verify_rate > 0 else None
    async with open_backbone(model_path, workers=0, kernel=kernel, threads=threads, hot_experts=hot_experts,
                             verifier=verifier, ledger=ledger, expert_cache=expert_cache) as local:
        layout = local.layout
        assert layout is not None  # (open_backbone always sets it)
        bank = local.backbone.dispatcher.local.bank
        async with open_host(identity, listen or [DEFAULT_LISTEN], announce=announce) as net:
            async with open_dht(net, server=dht_server, bootstrap=bootstrap) as dht:
                resolver = CoverageResolver(dht, model=local.fingerprint, layers=layout.expert_layers,
                                            n_expert=layout.n_expert, block_size=block_size,
                                            protocol=proto.PROTOCOL_VERSION, kernel=bank.kernel,
                                            refresh_s=refresh_s)
                pool = SwarmOwners(net, model_fingerprint=local.fingerprint, kernel=bank.kernel,
                                   timeout_s=timeout_s, resolver=resolver, direct=direct)
                resolver.vouch = pool.answered_within  # a worker we talk to stays, found or not
                dispatcher = local.backbone.dispatcher
                serve_receipt_requests(net, ledger)  # a worker leaving asks for its last receipts
                bans = BanKeeper(identity, local.fingerprint, dispatcher.bans, dht=dht, trusted=trust_bans, ledger=ledger,
                                 refresh_s=ban_refresh_s)
                dispatcher.on_mismatch = bans.ban  # (it needs the DHT, opened after the dispatcher)
                issuer = ReceiptIssuer(ledger, pool.send_receipt, period_s=receipt_period_s)

                async def on_change(cmap) -> None:
                    # A newly found worker is checked for bans before its first request.
                    await bans.check([o.peer for o in cmap.peers().values()])
                    await pool.sync(cmap)

                resolver.on_change = on_change
                pool.attach(dispatcher)
                notices = _refusal_notices(net, resolver, pool, dispatcher)
                try:
                    async with trio.open_nursery() as nursery:
                        await nursery.start(bans.run, lambda: [o.peer for o in resolver.map.peers().values()])
                        await nursery.start(notices.run)
                        await nursery.start(resolver.run)
                        nursery.start_soon(pool.keepalive)
                        nursery.start_soon(issuer.run)
                        publisher = None
                        if dht_server:
                            from p2pswarm.market.demand import DEFAULT_DEMAND_TTL_S, DemandPublisher

                            publisher = DemandPublisher(
                                dht, net.identity, local.backbone.dispatcher.demand, model=local.fingerprint,
                                layers=layout.expert_layers, n_expert=layout.n_expert, block_size=block_size,
                                unit_bytes=[layout.expert_bytes(layer) * block_size for layer in layout.expert_layers],
                                ttl_s=demand_ttl_s or DEFAULT_DEMAND_TTL_S)
                            if local.cache is not None:  # workers learn which units we cannot compute
                                cache = local.cache
                                publisher.lacks = lambda: cache.lacks(layout.expert_layers, block_size)
                            nursery.start_soon(publisher.run)
                        _start_cache_fill(nursery, local, net, dht, shard_token, trust_issuers or [],
                                          cache_refill_s, pool, verify_fetch_budget)
                        cmap = resolver.map
                        log.info("coverage: %d units, %d missing (computed locally), %d remote owners",
                                 len(cmap.units), len(cmap.missing()), len(pool.owners))
                        yield SwarmBackbone(local, net, resolver, pool, bans, issuer, publisher)
                        nursery.cancel_scope.cancel()
                finally:
                    with trio.CancelScope(shield=True):
                        with trio.move_on_after(5):  # the last receipts and any ban not yet in the DHT
                            await bans.publish_pending()
                            sent = await issuer.round()
                            if sent:
                                log.info("sent %d contribution receipts on the way out", sent)
                        await pool.aclose()


def _start_cache_fill(nursery, local: LocalSwarm, net, dht, token: str | None, trusted: list[str],
                      refill_s: float, pool: SwarmOwners | None = None,
                      check_bytes: int = DEFAULT_CHECK_FETCH_BYTES) -> None:
    """The expert cache's refill by demand, and its on-demand fetch of units no live owner holds:
    from the model's file where it is the full model, else from the swarm's shard sources and the
    workers in ``pool`` whose shards hold the unit (only with a token to show them). The same
    fetch brings the units a check picks that the cache lacks, ``check_bytes`` a minute at most."""
    cache = local.cache
    dispatcher = local.backbone.dispatcher
    if cache is None:
        return
    if cache.store is None:
        async def refill_loop() -> None:
            while True:
                await trio.sleep(refill_s)
                cache.rebalance(dispatcher.demand.top(len(cache.layers) * cache.n_expert))

        nursery.start_soon(refill_loop)
        return
    if token is None:
        log.warning("expert cache: no --token for shard downloads: nothing will be fetched into the cache, and a "
                    "unit whose every replica is gone fails its requests")
        return
    from p2pswarm.backbone.sessions.cache_fill import CacheFiller
    from p2pswarm.model.expert_store import source_header

    assert local.layout is not None
    filler = CacheFiller(cache, net, dht, model=local.fingerprint, token=token, trusted_issuers=trusted,
                         source_header=source_header(local.layout)[0], demand=dispatcher.demand, refill_s=refill_s,
                         holders=_shard_holders(pool) if pool is not None else None)
    dispatcher.fetch = filler.fetch
    dispatcher.check_budget = cache.check_budget = CheckFetchBudget(check_bytes)
    nursery.start_soon(filler.run)
    local.filler = filler


def _shard_holders(pool: SwarmOwners):
    """``holders(layer)`` for the cache filler: each known worker whose shard covers ``layer``, once
    per (peer, expert range), with the range (a worker serves only its own shard's slabs)."""
    def holders(layer: int) -> list:
        seen, out = set(), []
        for o in list(pool.owners):
            shard = o.info.shard
            key = (o.peer, shard.experts)
            if shard.layers[0] <= layer < shard.layers[1] and key not in seen:
                seen.add(key)
                out.append((o.info.peer_info(), tuple(shard.experts)))
        return out

    return holders


def _refusal_notices(net, resolver, pool, dispatcher):
    """Every way this backbone stops using a worker (its record, its hello, a ban) tells the
    worker why (p2pswarm/backbone/sessions/refusal_notice.py)."""
    from p2pswarm.backbone.sessions.refusal_notice import RefusalNotices

    def addrs_of(peer: str):
        rec = resolver._known.get(peer) or resolver.refused.get(peer, (None, None))[1]
        return rec.addrs if rec is not None else ()

    notices = RefusalNotices(net, addrs_of)
    resolver.on_refused = notices.note
    pool.on_refused = notices.note
    dispatcher.bans.listeners.append(lambda peer: notices.note(peer, f"banned: {dispatcher.bans.banned.get(peer, '')}"))
    return notices
