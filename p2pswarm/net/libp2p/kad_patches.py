"""py-libp2p 0.8.1 workarounds for its Kademlia DHT: our protocol id bound in every kad module and
more providers per key kept (process-wide, applied by :func:`p2pswarm.net.libp2p.patches.apply`),
and a KadDHT's private rate limits raised and its ``add_peer`` routed through ours
(:func:`patch_kad`, per :class:`p2pswarm.net.dht.kademlia.SwarmDHT`).

Each trap, its reason and its regression test are in the table of :mod:`p2pswarm.net.libp2p.patches`,
whose checked list names every private name these functions rely on.
"""
from __future__ import annotations

import importlib

import trio
from libp2p.custom_types import TProtocol

KAD_PROTOCOL = TProtocol("/p2pswarm/kad/1.0.0")  # our Kademlia id (protocol.md); beside the patch that makes it ours
KAD_MODULES = ("libp2p.kad_dht.common", "libp2p.kad_dht.kad_dht", "libp2p.kad_dht.peer_routing",
               "libp2p.kad_dht.provider_store", "libp2p.kad_dht.value_store")
PROVIDE_RATE_MAX = 4096  # ADD_PROVIDER messages accepted per peer per 10 s (py-libp2p: 10)
MAX_PROVIDERS_PER_KEY = 4096  # provider entries a server keeps per key (py-libp2p: 20, then ignores new ones)
INBOUND_KAD_STREAMS = 256  # concurrent inbound kad streams a server handles (py-libp2p: 12, then resets)


def raise_providers_per_key(limit: int = MAX_PROVIDERS_PER_KEY) -> None:
    """Let a DHT server keep ``limit`` providers per key (py-libp2p 0.8.1: 20, "per spec", and a
    21st ADD_PROVIDER is acknowledged and dropped).

    Why: every worker provides its model's key, the index a backbone, ``swarm-status`` and every
    ``--auto`` worker resolve the whole coverage map from (coverage.py). With 30 workers each server
    listed the first 20 to provide it; the other 10 were found only through per-unit look-ups, a
    rotating quarter of the units per refresh, so ``swarm-status`` saw 23 of 30 workers. A GET_PROVIDERS
    answer lists every entry (about 250 bytes each with its signed peer record: 4,096 fit in 1 MiB,
    well under the 4 MiB we read). Only the provider store's name is rebound; the routing table's
    k stays 20."""
    import libp2p.kad_dht.provider_store as store

    store.BUCKET_SIZE = limit


def install_kad_protocol_id(protocol: str = KAD_PROTOCOL) -> None:
    """Make every py-libp2p kad module speak ``protocol`` (process-wide, idempotent).

    Must run before a KadDHT is built: its constructor registers the handler under the constant."""
    for name in KAD_MODULES:
        mod = importlib.import_module(name)
        if hasattr(mod, "PROTOCOL_ID"):
            setattr(mod, "PROTOCOL_ID", TProtocol(protocol))


def patch_kad(kad, add_peer):
    """Raise a KadDHT server's private rate limits and route its ``add_peer`` through ours.

    py-libp2p accepts 10 ADD_PROVIDER messages per peer per 10 s and drops the rest silently (a
    worker providing 40 units would be 3/4 invisible), handles 12 inbound kad streams at once and
    resets the 13th (a backbone resolving a few units in parallel lost a tenth of its queries), and
    adds every peer that opens a kad stream to its routing table ("they MUST support server mode").
    ``add_peer(peer_id, *, skip_server_mode_check=False)`` replaces the last; the library's own is
    returned for it to call."""
    kad._provider_rate_max = PROVIDE_RATE_MAX
    kad._inbound_limiter = trio.CapacityLimiter(INBOUND_KAD_STREAMS)
    library = kad.add_peer
    kad.add_peer = add_peer
    return library
