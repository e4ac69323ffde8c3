"""The swarm's Kademlia DHT, one import for its three parts (split along their seams):

* :mod:`p2pswarm.net.kademlia` - our Kademlia client/server over py-libp2p's ``KadDHT``
  (:class:`SwarmDHT`, :func:`open_dht`; the traps it codes around are in its docstring, the
  library patches in :mod:`p2pswarm.net.libp2p_patches`);
* :mod:`p2pswarm.net.advertiser` - the provider side (:class:`ShardAdvertiser`);
* :mod:`p2pswarm.net.coverage` - the backbone side (:class:`CoverageResolver`, :class:`CoverageMap`).

Every public name stays importable from here, so ``from p2pswarm.net.dht import ...`` keeps working.
"""
from __future__ import annotations

from p2pswarm.net.advertiser import ShardAdvertiser
from p2pswarm.net.coverage import CoverageMap, CoverageResolver, OwnerInfo, ResolverStats
from p2pswarm.net.kademlia import (ALPHA, BETA, IDENTIFY_WAIT_S, INBOUND_KAD_STREAMS, K, KAD_PROTOCOL, LOOKUP_TIMEOUT_S,
                                   MAX_DHT_MESSAGE, OUTBOUND_KAD_STREAMS, PROVIDE_RATE_MAX, REPROVIDE_S, RETRY_PAUSE_S,
                                   RPC_TIMEOUT_S, DHTStats, SwarmDHT, open_dht)
from p2pswarm.net.libp2p_patches import install_kad_protocol_id

__all__ = ["ALPHA", "BETA", "IDENTIFY_WAIT_S", "INBOUND_KAD_STREAMS", "K", "KAD_PROTOCOL", "LOOKUP_TIMEOUT_S",
           "MAX_DHT_MESSAGE", "OUTBOUND_KAD_STREAMS", "PROVIDE_RATE_MAX", "REPROVIDE_S", "RETRY_PAUSE_S",
           "RPC_TIMEOUT_S", "CoverageMap", "CoverageResolver", "DHTStats", "OwnerInfo", "ResolverStats",
           "ShardAdvertiser", "SwarmDHT", "install_kad_protocol_id", "open_dht"]
