"""The swarm's DHT: the network layer's Kademlia (:func:`p2pswarm.net.dht.kademlia.open_dht`) given
every signed record kind the swarm stores.

Why here: the DHT stores node records itself and takes every other record kind at construction,
because those kinds are defined above the network layer: the market's demand records
(:mod:`p2pswarm.market.demand`) and ban records (:mod:`p2pswarm.market.bans`). The market is the
lowest layer that knows the whole set, so every node (worker, backbone, bootstrap, relay, the
tools) opens its DHT through :func:`open_dht` here: a DHT server stores, and a client reads, every
kind, and none refuses another node's record as of an unknown kind.
"""
from __future__ import annotations

from p2pswarm.market.bans import BAN_PREFIX, BanValidator
from p2pswarm.market.demand import DEMAND_PREFIX, DemandValidator
from p2pswarm.net.dht import kademlia
from p2pswarm.net.libp2p.host import NetHost
from p2pswarm.net.signed.records import RecordKind


def record_kinds() -> dict[str, RecordKind]:
    """The record kinds besides node records, by key prefix: fresh validators (each counts its own
    refusals)."""
    return {DEMAND_PREFIX: DemandValidator(), BAN_PREFIX: BanValidator()}


def open_dht(net: NetHost, **options):
    """:func:`p2pswarm.net.dht.kademlia.open_dht` (``options``: ``server``, ``bootstrap``, ...) with
    the swarm's record kinds; an async context manager yielding the
    :class:`~p2pswarm.net.dht.kademlia.SwarmDHT`."""
    return kademlia.open_dht(net, kinds=record_kinds(), **options)
