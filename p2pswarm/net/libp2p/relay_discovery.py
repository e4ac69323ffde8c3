"""Relay discovery: relays share nothing but the DHT, where each of them provides one key.

Scale-out (one relay process carries ~25 relayed workers at 10 requests/s on WebSocket, see
docs/benchmarks.md) means adding relay processes, and adding one must be trivial: start it with
``--bootstrap`` pointing into the swarm and it provides :data:`RELAY_KEY` (re-provided every
:data:`REPROVIDE_S`). A worker behind NAT asks the DHT for that key's providers to learn every
relay's advertised address, picks among them (:class:`p2pswarm.net.libp2p.relay_client.RelayKeeper`: in random order,
moving on when a relay is full or unreachable), and moves to another when its relay dies. No relay
knows about any other; backbones dial each worker through the relay its signed record names.
"""
from __future__ import annotations

import hashlib
import logging
import random
from collections.abc import Collection

import trio

from p2pswarm.net.libp2p.addrs import error_reason, is_circuit_addr

log = logging.getLogger("p2pswarm.relay")

RELAY_KEY = b"\x12\x20" + hashlib.sha256(b"p2pswarm/relay-443/v1").digest()  # a sha2-256 multihash
REPROVIDE_S = 300.0
FIND_TIMEOUT_S = 10.0


async def advertise_relay(dht, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Provide :data:`RELAY_KEY` now (``task_status.started(peers that took it)``), then every
    :data:`REPROVIDE_S`, until cancelled."""
    started = False
    while True:
        try:
            n = await dht.provide(RELAY_KEY)
        except Exception as exc:  # a DHT hiccup must not stop the relay; try again next round
            log.warning("could not advertise this relay in the DHT: %s", error_reason(exc))
            n = 0
        if not started:
            log.info("advertised this relay in the DHT (%d peers took it)", n)
            task_status.started(n)
            started = True
        await trio.sleep(REPROVIDE_S * random.uniform(0.9, 1.0))


async def find_relays(dht, *, exclude: Collection[str] = ()) -> list[str]:
    """Full addresses (``ADDR/p2p/ID``) of the relays the DHT knows, one per relay (its first direct
    address), in random order; peers in ``exclude`` (base58 ids) left out."""
    try:
        providers = await dht.find_providers(RELAY_KEY, timeout_s=FIND_TIMEOUT_S)
    except Exception as exc:
        log.info("looking up relays in the DHT failed: %s", error_reason(exc))
        return []
    out = []
    for info in providers:
        pid = info.peer_id.to_base58()
        direct = [str(a) for a in info.addrs if not is_circuit_addr(a)]
        if pid in exclude or pid == dht.peer_id.to_base58() or not direct:
            continue
        out.append(f"{direct[0]}/p2p/{pid}")
    random.shuffle(out)
    return out
