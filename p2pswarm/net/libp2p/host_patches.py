"""py-libp2p 0.8.1 workarounds for one host, applied by :func:`p2pswarm.net.libp2p.host.open_host`: our
connection settings and limits, no auto-connector, forgetting stale addresses and dead connections,
closing connections at once, a busy port refused, and our WebSocket transports.

Each trap, its reason and its regression test are in the table of :mod:`p2pswarm.net.libp2p.patches`,
whose checked list names every private name these functions rely on.
"""
from __future__ import annotations

import logging
import socket
import ssl

import multiaddr
import trio
from libp2p.network.config import ConnectionConfig, RetryConfig

from p2pswarm.errors import UserError
from p2pswarm.net.libp2p.addrs import error_reason

log = logging.getLogger("p2pswarm.net")

DEFAULT_MAX_CONNECTIONS = 1024  # connections a host may hold (py-libp2p: 300, only 250 of them inbound)


def connection_config(max_connections: int = DEFAULT_MAX_CONNECTIONS) -> ConnectionConfig:
    """Our connection settings. ``max_connections_per_peer=1`` avoids the 250 ms connect stall;
    ``max_connections`` (and the pruning watermark with it) replaces the library's 300, of which
    only ``max_connections - min_connections`` = 250 may be inbound: see :func:`raise_connection_limits`."""
    library = ConnectionConfig()
    return ConnectionConfig(max_connections_per_peer=1, max_connections=max_connections,
                            low_watermark=min(library.low_watermark, max_connections),
                            high_watermark=max_connections)


def raise_connection_limits(host, max_connections: int = DEFAULT_MAX_CONNECTIONS) -> None:
    """Let a host hold ``max_connections`` connections each way (a relay stalled at 250 peers without it).

    py-libp2p 0.8.1 caps a host at 250 inbound connections (the swarm's inbound limiter is
    ``max_connections - min_connections`` = 300 - 50) and, in its default resource manager, at 256
    established inbound and outbound and 1,000 "connection resources" (each inbound connection
    takes two: one at admission, one once upgraded). The 251st peer's dial simply fails. A relay
    sized for 1,024 reservations, or a bootstrap node a swarm of phones joins through, would refuse
    every peer past the 250th; measured: 270 peers dialling one host, 250 connected."""
    rm = getattr(host.get_network(), "_resource_manager", None)
    if rm is None:
        return
    rm.limits.max_connections = max(rm.limits.max_connections, 2 * max_connections + 64)
    cl = rm.connection_limits
    for name in ("max_established_inbound", "max_established_outbound"):
        if getattr(cl, name, None) is not None:
            setattr(cl, name, max(getattr(cl, name), max_connections))
    if getattr(cl, "max_established_total", None) is not None:
        cl.max_established_total = max(cl.max_established_total, 2 * max_connections)


async def _no_auto_connect() -> None:
    """Replaces py-libp2p's AutoConnector.maybe_connect: we decide whom to dial."""


def disable_auto_connect(host, *, dial_retries: int = 1) -> None:
    """No dials behind our back, and ``dial_retries`` retries of a failed dial (library: 3, with
    back-off). The auto-connector tries to hold 150 connections: after any disconnect, and every
    10 s while below 50, it dials every peer in the peerstore - any peer a DHT answer ever
    mentioned, dead ones included, racing our own dials. Watermarks cannot turn it off without
    turning on pruning, so its ``maybe_connect`` becomes a no-op: our DHT and resolver decide."""
    network = host.get_network()
    auto = getattr(network, "auto_connector", None)
    if auto is not None:
        auto.maybe_connect = _no_auto_connect
    if hasattr(network, "retry_config"):
        network.retry_config = RetryConfig(max_retries=dial_retries, initial_delay=0.05, max_delay=1.0)


def forget_peer_addrs(host, peer_id) -> None:
    """Forget every address we know for ``peer_id`` and a recent failed dial to it.

    py-libp2p dials at most ONE address per transport class (the first TCP one it has) and then
    refuses to redial a peer for 60 s after a failure. A worker restarted on a new port would be
    unreachable: the peerstore still lists the dead port first. The caller then dials fresh
    addresses (from the peer's newest signed record or from the user)."""
    try:
        host.get_peerstore().clear_addrs(peer_id)
    except Exception:
        pass
    cache = getattr(host.get_network(), "_negative_peer_cache", None)
    if cache is not None:
        cache.evict(str(peer_id))


async def drop_dead_connections(host, peer) -> bool:
    """Drop connections to ``peer`` that are closed but still registered; True if any were.

    py-libp2p sometimes leaves a connection the remote has just closed in the swarm's table for a
    while; until it goes, ``new_stream`` fails with "No valid connections" instead of redialling."""
    network = host.get_network()
    conns = network.connections.get(peer) or []
    if conns and all(getattr(c, "is_closed", False) for c in conns):
        with trio.CancelScope(shield=True), trio.move_on_after(2):
            try:
                await network.close_peer(peer)
            except Exception as exc:
                log.debug("forgetting dead connection to %s: %s", peer, error_reason(exc))
        return True
    return False


async def close_connections(host) -> None:
    """Close every connection at once. py-libp2p's own shutdown closes them one after another,
    each with a fixed 0.1 s sleep plus a yamux goodbye: 4 s for a DHT node with 20 peers."""
    network = host.get_network()

    async def close(pid) -> None:
        try:
            await network.close_peer(pid)
        except Exception as exc:
            log.debug("closing connection to %s: %s", pid, error_reason(exc))

    async with trio.open_nursery() as nursery:
        for pid in list(network.connections):
            nursery.start_soon(close, pid)



def check_port_free(ma: multiaddr.Multiaddr) -> None:
    """Refuse a fixed port another process already listens on.

    py-libp2p binds its listeners with SO_REUSEPORT (for hole punching), so a second node started
    on a busy port does not fail: the kernel silently splits incoming connections between the two
    processes. A plain bind (no SO_REUSEPORT) of the same address fails if anyone holds it."""
    try:
        port = int(ma.value_for_protocol("tcp"))
    except Exception:
        return
    if port == 0:
        return
    family, host = socket.AF_INET, None
    for proto, fam in (("ip4", socket.AF_INET), ("ip6", socket.AF_INET6)):
        try:
            host = ma.value_for_protocol(proto)
            family = fam
            break
        except Exception:
            continue
    if host is None:
        return
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # tolerate TIME_WAIT leftovers
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise UserError(f"cannot listen on {ma}: {exc.strerror or exc}") from None



def install_websocket(host, tls_server: ssl.SSLContext | None, tls_client: ssl.SSLContext) -> None:
    """Replace py-libp2p's WebSocket transport by ours (see module doc): a plain one that listens
    on /ws and dials /ws and /wss, and, with a certificate, one that only listens on /wss."""
    from libp2p.transport.websocket.transport import WebsocketTransport

    class PlainWebsocket(WebsocketTransport):
        def can_listen(self, maddr) -> bool:
            return "wss" not in {p.name for p in maddr.protocols()} and super().can_listen(maddr)

    class SecureWebsocketListener(WebsocketTransport):
        def can_dial(self, maddr) -> bool:
            return False

        def can_listen(self, maddr) -> bool:
            # (the library's can_listen is can_dial, which we turned off above)
            return "wss" in {p.name for p in maddr.protocols()} and WebsocketTransport.can_dial(self, maddr)

    network = host.get_network()
    tm = network.transport_manager
    tm._transports = [t for t in tm._transports if not isinstance(t, WebsocketTransport)]
    tm.add_transport(PlainWebsocket(network.upgrader, tls_client_config=tls_client))
    if tls_server is not None:
        tm.add_transport(SecureWebsocketListener(network.upgrader, tls_server_config=tls_server))
