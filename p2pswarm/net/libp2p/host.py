"""Our thin wrapper over a py-libp2p 0.8.1 host: TCP + Noise + yamux (+ WebSocket and circuit relay
v2), explicit addresses, our framing.

Everything in p2pswarm that touches libp2p goes through :func:`open_host` and :class:`NetHost`.
The library's quirks are worked around in :mod:`p2pswarm.net.libp2p.patches` (its docstring has the
table: trap -> patch -> regression test); ``open_host`` applies them (``libp2p_patches.apply()``,
once per process) and uses its per-host helpers (:mod:`p2pswarm.net.libp2p.host_patches`).
Addresses and one-line errors live in :mod:`p2pswarm.net.libp2p.addrs`, the trio view of a libp2p stream
in :mod:`p2pswarm.net.libp2p.stream`.

What the host itself does, and why:

* :meth:`NetHost.connect` makes the addresses it is given (fresh, from a signed record or the
  user) the peer's only ones, because py-libp2p dials one address per transport class and blocks a
  peer 60 s after a failed dial; opening a stream retries once after dropping a dead connection.
* ``host.connect()`` never dials ``/p2p-circuit`` addresses (the swarm filters them out as
  "relay-only"). :meth:`NetHost.connect` dials them itself through the circuit relay v2
  transport, after any direct address failed; the relayed connection is Noise + yamux end to end
  over the relay's stream, so the relay only ever carries ciphertext.
* Every host runs the circuit v2 STOP side, so an inbound relayed connection is accepted; a
  host's own relayed addresses (``<relay>/p2p/<relay id>/p2p-circuit``) are kept by
  :meth:`NetHost.set_relay_addrs` and advertised by :meth:`NetHost.addrs` (py-libp2p rewrites
  announced circuit addresses, so ``announce`` cannot carry them).
* Listen addresses that share a host and port are refused (``check_listen_addrs``): py-libp2p's
  port demultiplexer breaks WebSocket upgrades. Every host can *dial* ``/ws`` and ``/wss``, so a
  TCP-only backbone reaches a relay behind a CDN.

Only Noise is offered for security (py-libp2p's default list also offers TLS, SECIO and plaintext)
and only yamux for multiplexing. Identify's observed-address discovery is off: we advertise exactly
the addresses we were told to (``listen`` or ``announce``), never a guessed NAT mapping.
"""
from __future__ import annotations

import logging
import ssl
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Awaitable, Callable, Sequence

import multiaddr
import trio
from libp2p import new_host
from libp2p.crypto.x25519 import create_new_key_pair as new_x25519_key_pair
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.tools.anyio_service import background_trio_service

from p2pswarm import settings
from p2pswarm.errors import SwarmError, UserError
from p2pswarm.net.libp2p import host_patches as libp2p_host_patches, patches as libp2p_patches
from p2pswarm.errors import single_error
from p2pswarm.net.libp2p.addrs import DEFAULT_LISTEN, NetError, check_listen_addrs, error_reason, id_mismatch, is_circuit_addr, is_wildcard, parse_multiaddr, parse_peer_addr
from p2pswarm.net.signed.identity import Identity
from p2pswarm.net.libp2p.stream import DEFAULT_READ_AHEAD, StreamAdapter

log = logging.getLogger("p2pswarm.net")


# py-libp2p logs routine peer churn (a peer closing a DHT stream, a refused dial) as WARNING or
# ERROR with no context; our own log lines say what matters. P2PSWARM_LIBP2P_LOG=DEBUG restores it.
_LIBP2P_LOG_LEVEL = (settings.LIBP2P_LOG.raw() or settings.LIBP2P_LOG.default).upper()
logging.getLogger("libp2p").setLevel(getattr(logging, _LIBP2P_LOG_LEVEL, logging.CRITICAL))

StreamHandler = Callable[["StreamAdapter"], Awaitable[None]]


@dataclass
class HostStats:
    connects: int = 0
    connect_seconds: float = 0.0
    streams_opened: int = 0
    streams_accepted: int = 0
    handler_errors: int = 0


class NetHost:
    """A running libp2p host. Made by :func:`open_host`; valid until its context exits."""

    def __init__(self, identity: Identity, host, nursery: trio.Nursery, announce: list[multiaddr.Multiaddr] | None,
                 read_ahead: int, circuit=None):
        self.identity = identity
        self.host = host
        self.peer_id: ID = host.get_id()
        self._nursery = nursery
        self._announce = announce
        self.read_ahead = read_ahead
        self.stats = HostStats()
        self.circuit = circuit  # CircuitV2Transport: dials /p2p-circuit addresses (see module doc)
        self._relay_addrs: list[str] = []
        self.relay_only = False
        self._via_relay: set[ID] = set()  # peers our last dial reached through a circuit relay
        # shown to a relay before a circuit through it, for relays that want tokens of both ends
        # (``p2pswarm relay --circuits-need-token``); $P2PSWARM_RELAY_TOKEN: a token or a file
        self.relay_token: str | None = None

    @property
    def peer_id_str(self) -> str:
        return self.peer_id.to_base58()

    @property
    def nursery(self) -> trio.Nursery:
        """For background tasks that must end with the host (read-ahead pumps, DHT upkeep)."""
        return self._nursery

    def transport_addrs(self) -> list[multiaddr.Multiaddr]:
        """Where we listen (real ports after binding port 0), without /p2p/."""
        return list(self.host.get_transport_addrs())

    def addrs(self) -> list[str]:
        """What we advertise: our relayed addresses (:meth:`set_relay_addrs`) first, then
        ``announce`` if given, else the listen addresses minus wildcards (none of those when
        ``relay_only``: a NATed node's own listen addresses are not dialable)."""
        if self._announce:
            base = [str(a) for a in self._announce]
        elif self.relay_only:
            base = []
        else:
            base = [str(a) for a in self.transport_addrs() if not is_wildcard(a)]
        return list(self._relay_addrs) + [a for a in base if a not in self._relay_addrs]

    def set_relay_addrs(self, addrs: Sequence[str], *, relay_only: bool | None = None) -> None:
        """Our relayed addresses, ``RELAY/p2p/RELAY_ID/p2p-circuit`` (no trailing /p2p/ of ours),
        as a relay reservation made them valid. py-libp2p's announce rewrites circuit addresses,
        so we keep them here and :meth:`addrs` (what records carry) puts them first."""
        self._relay_addrs = [str(a) for a in addrs]
        if relay_only is not None:
            self.relay_only = relay_only

    def full_addrs(self) -> list[str]:
        """What others dial: advertised addresses with our /p2p/ peer id."""
        return [f"{a}/p2p/{self.peer_id_str}" for a in self.addrs()]

    async def connect(self, target: str | PeerInfo, *, timeout_s: float = 10.0) -> ID:
        """Dial a peer (``/ip4/../tcp/../p2p/ID`` or a PeerInfo); NetError on failure, never hangs."""
        info = parse_peer_addr(target) if isinstance(target, str) else target
        if info.peer_id == self.peer_id:
            raise NetError("refusing to dial ourselves")
        circuits = [a for a in info.addrs if is_circuit_addr(a)]
        direct = [a for a in info.addrs if not is_circuit_addr(a)]
        if info.addrs and not self.is_connected(info.peer_id):
            self._replace_addrs(PeerInfo(info.peer_id, direct))
        t0 = time.perf_counter()
        try:
            with trio.fail_after(timeout_s):
                if self.is_connected(info.peer_id) or not circuits:
                    if not self.is_connected(info.peer_id):
                        self._via_relay.discard(info.peer_id)
                    await self.host.connect(PeerInfo(info.peer_id, direct) if circuits else info)
                else:
                    await self._connect_direct_or_relayed(info.peer_id, direct, circuits)
        except trio.TooSlowError:
            raise NetError(f"dialling {info.peer_id.to_base58()} timed out after {timeout_s:.0f} s") from None
        except NetError:
            raise
        except Exception as exc:
            actual = id_mismatch(exc)
            if actual:
                where = ", ".join(str(a) for a in info.addrs)
                raise NetError(f"the peer at {where} has another peer id ({actual}), not "
                               f"{info.peer_id.to_base58()}: fix the /p2p/ part of the address "
                               f"(e.g. {where}/p2p/{actual})") from None
            raise NetError(f"cannot dial {info.peer_id.to_base58()} at "
                           f"{', '.join(str(a) for a in info.addrs) or 'no address'}: {error_reason(exc)}") from None
        self.stats.connects += 1
        self.stats.connect_seconds += time.perf_counter() - t0
        return info.peer_id

    async def _connect_direct_or_relayed(self, peer: ID, direct: list, circuits: list) -> None:
        """Direct addresses first (cheaper when they work), then each relayed address through
        the circuit v2 transport: ``host.connect()`` filters ``/p2p-circuit`` out and would fail."""
        errors = []
        if direct:
            try:
                await self.host.connect(PeerInfo(peer, direct))
                self._via_relay.discard(peer)
                return
            except Exception as exc:
                errors.append(error_reason(exc))
        if self.circuit is None:
            raise NetError(f"cannot dial {peer.to_base58()}: relayed address but no circuit transport")
        for ma in circuits:
            text = str(ma)
            if not text.endswith(f"/p2p/{peer.to_base58()}"):
                text = f"{text}/p2p/{peer.to_base58()}"
            try:
                if self.relay_token:
                    from p2pswarm.net.libp2p.relay_token import present_token  # only for relayed dials

                    relay_part = text.split("/p2p-circuit", 1)[0]
                    await present_token(self, relay_part, self.relay_token)
                await self.circuit.dial(multiaddr.Multiaddr(text))
                if self.is_connected(peer):
                    self._via_relay.add(peer)
                    return
                errors.append("relayed connection did not register")
            except Exception as exc:
                errors.append(error_reason(exc))
        raise NetError(f"cannot dial {peer.to_base58()} directly or through its relay: "
                       f"{'; '.join(errors) or 'no address'}")

    def _replace_addrs(self, info: PeerInfo) -> None:
        """Make ``info.addrs`` the only addresses we know for the peer (see
        :func:`~p2pswarm.net.libp2p.host_patches.forget_peer_addrs`); the caller dials them."""
        libp2p_host_patches.forget_peer_addrs(self.host, info.peer_id)

    async def forget_dead_connections(self, peer: ID) -> bool:
        """Drop connections to ``peer`` that are closed but still registered; True if any were
        (:func:`~p2pswarm.net.libp2p.host_patches.drop_dead_connections`). Callers retrying after a
        failed stream call this first."""
        return await libp2p_host_patches.drop_dead_connections(self.host, peer)

    def is_connected(self, peer: ID) -> bool:
        return bool(self.host.get_network().connections.get(peer))

    def via_relay(self, peer: ID) -> bool:
        """Whether our connection to ``peer`` goes through a circuit relay (we dialled it there):
        what the status page calls "relayed" - not whether its record lists a relayed address."""
        return peer in self._via_relay and self.is_connected(peer)

    async def open_stream(self, peer: ID | PeerInfo | str, protocol: str, *, timeout_s: float = 10.0,
                          read_ahead: bool = True) -> StreamAdapter:
        """A new stream to ``peer`` speaking ``protocol`` (dialling first if needed)."""
        target = peer
        if isinstance(peer, (str, PeerInfo)):
            peer = await self.connect(peer, timeout_s=timeout_s)
        try:
            with trio.fail_after(timeout_s):
                for attempt in range(2):
                    try:
                        raw = await self.host.new_stream(peer, [TProtocol(protocol)])
                        break
                    except Exception:
                        # The connection may have been closed by the peer a moment ago and still
                        # be registered (see forget_dead_connections): forget it, redial once.
                        if attempt:
                            raise
                        await trio.sleep(0.25)
                        await self.forget_dead_connections(peer)
                        if isinstance(target, (str, PeerInfo)):
                            await self.connect(target, timeout_s=timeout_s)
        except trio.TooSlowError:
            raise NetError(f"opening {protocol} to {peer.to_base58()} timed out after {timeout_s:.0f} s") from None
        except NetError:
            raise
        except Exception as exc:
            raise NetError(f"cannot open {protocol} to {peer.to_base58()}: {error_reason(exc)}") from None
        self.stats.streams_opened += 1
        adapter = StreamAdapter(raw, read_ahead=self.read_ahead)
        if read_ahead:
            adapter.start_reading(self._nursery)
        return adapter

    def set_handler(self, protocol: str, handler: StreamHandler, *, read_ahead: bool = True) -> None:
        """Serve ``protocol``: each inbound stream is handed to ``handler`` as a StreamAdapter. The
        handler's exceptions are logged and close that stream only; the host keeps serving."""

        async def serve(raw) -> None:
            adapter = StreamAdapter(raw, read_ahead=self.read_ahead)
            self.stats.streams_accepted += 1
            try:
                async with trio.open_nursery() as nursery:
                    if read_ahead:
                        adapter.start_reading(nursery)
                    try:
                        await handler(adapter)
                    finally:
                        nursery.cancel_scope.cancel()
            except Exception as exc:  # one bad stream must not take the host down
                leaf = single_error(exc) if isinstance(exc, BaseExceptionGroup) else exc
                if isinstance(leaf, (trio.BrokenResourceError, trio.ClosedResourceError)):
                    log.debug("%s stream from %s broken: %s", protocol, adapter.peer_name, error_reason(leaf))
                else:
                    self.stats.handler_errors += 1
                    log.warning("%s handler failed for %s: %s", protocol, adapter.peer_name, error_reason(leaf))
            finally:
                await adapter.aclose()

        self.host.set_stream_handler(TProtocol(protocol), serve)

    def remove_handler(self, protocol: str) -> None:
        self.host.remove_stream_handler(TProtocol(protocol))


def _tls_server_context(cert: str, key: str) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError, ValueError) as exc:
        raise UserError(f"cannot load TLS certificate {cert} / key {key}: {getattr(exc, 'strerror', None) or exc}") from None
    return ctx


def tls_client_context() -> ssl.SSLContext:
    """What ``/wss`` dials verify against: the system's CAs, plus ``$P2PSWARM_WSS_CA`` (a PEM
    bundle, e.g. a test or private CA) when set."""
    ctx = ssl.create_default_context()
    extra = settings.WSS_CA.raw()
    if extra:
        try:
            ctx.load_verify_locations(cafile=extra)
        except (OSError, ssl.SSLError) as exc:
            raise UserError(f"cannot load P2PSWARM_WSS_CA={extra}: {getattr(exc, 'strerror', None) or exc}") from None
    return ctx


def _stop_only_protocol(host):
    """Circuit relay v2 without HOP: accepts relayed connections (STOP), relays nothing."""
    from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol

    return CircuitV2Protocol(host, allow_hop=False)


def _circuit_transport(host, protocol):
    """The dialler for /p2p-circuit addresses. STOP only, no CLIENT role: with CLIENT, every dial
    would first ask the relay for a reservation of our own (refused without a token, and
    pointless for a backbone)."""
    from libp2p.relay.circuit_v2.config import RelayConfig, RelayRole
    from libp2p.relay.circuit_v2.transport import CircuitV2Transport

    return CircuitV2Transport(host, protocol, RelayConfig(roles=RelayRole.STOP))


@asynccontextmanager
async def open_host(identity: Identity, listen: Sequence[str] = (DEFAULT_LISTEN,), *,
                    announce: Sequence[str] | None = None, read_ahead: int = DEFAULT_READ_AHEAD,
                    dial_retries: int = 1, tls_cert: str | None = None, tls_key: str | None = None,
                    circuit_protocol: Callable | None = None,
                    max_connections: int = libp2p_host_patches.DEFAULT_MAX_CONNECTIONS):
    """Start a host listening on ``listen`` (multiaddrs; port 0 picks a free port) and yield a
    :class:`NetHost`. On exit: background tasks cancelled, listeners and connections closed.

    ``announce`` replaces the listen addresses in what we advertise (a public address in front of
    a NAT or a relay). ``dial_retries``: py-libp2p retries a failed dial 3 times with back-off by
    default (0.7 s lost on every dead peer); one retry is plenty on our networks.

    Listen addresses may be TCP, ``/ws`` or ``/wss`` (the latter with ``tls_cert``/``tls_key``
    PEM files). ``circuit_protocol(host)`` builds the circuit relay v2 service the host runs (the
    relay passes its token-gated HOP); by default a STOP-only one, so relayed peers can reach us.
    ``NetHost.circuit`` dials ``/p2p-circuit`` addresses. ``max_connections``: how many peers the
    host may be connected to at once (py-libp2p alone: 250 inbound; a relay passes its
    reservation limit plus room for backbones)."""
    if not listen:
        raise UserError("a host needs at least one listen address")
    libp2p_patches.apply()
    listen_addrs = [parse_multiaddr(a, "listen address") for a in listen]
    if bool(tls_cert) != bool(tls_key):
        raise UserError("a TLS certificate needs its key and the other way round (--tls-cert and --tls-key)")
    check_listen_addrs(listen_addrs, tls=bool(tls_cert))
    tls_server = _tls_server_context(tls_cert, tls_key) if tls_cert and tls_key else None
    for a in listen_addrs:
        libp2p_host_patches.check_port_free(a)
    announce_addrs = [parse_multiaddr(a, "announce address") for a in announce] if announce else None
    sec = {NOISE_PROTOCOL_ID: NoiseTransport(identity.key_pair, noise_privkey=new_x25519_key_pair().private_key)}
    host = new_host(
        key_pair=identity.key_pair,
        sec_opt=sec,
        muxer_preference="YAMUX",
        listen_addrs=listen_addrs,
        connection_config=libp2p_host_patches.connection_config(max_connections),
        announce_addrs=announce_addrs,
        disable_identify_address_discovery=True,
    )
    libp2p_host_patches.install_websocket(host, tls_server, tls_client_context())
    libp2p_host_patches.disable_auto_connect(host, dial_retries=dial_retries)
    libp2p_host_patches.raise_connection_limits(host, max_connections)
    started = False
    try:
        async with host.run(listen_addrs):
            started = True
            circuit_proto = (circuit_protocol or _stop_only_protocol)(host)
            async with background_trio_service(circuit_proto), trio.open_nursery() as nursery:
                await circuit_proto.event_started.wait()
                net = NetHost(identity, host, nursery, announce_addrs, read_ahead,
                              circuit=_circuit_transport(host, circuit_proto))
                if settings.RELAY_TOKEN.is_set:
                    from p2pswarm.net.signed.tokens import load_token

                    net.relay_token = load_token(settings.RELAY_TOKEN.raw() or "")
                if len(net.transport_addrs()) < len(listen_addrs):
                    raise UserError(f"could not listen on {', '.join(map(str, listen_addrs))} "
                                    f"(listening on {', '.join(map(str, net.transport_addrs())) or 'nothing'})")
                log.debug("host %s listening on %s", net.peer_id_str, ", ".join(map(str, net.transport_addrs())))
                try:
                    yield net
                finally:
                    nursery.cancel_scope.cancel()
                    with trio.CancelScope(shield=True), trio.move_on_after(10):
                        await libp2p_host_patches.close_connections(host)
    except BaseExceptionGroup as group:  # our nursery and py-libp2p's wrap the body's own error
        leaf = single_error(group)
        if leaf is group:
            raise
        if not started and isinstance(leaf, Exception) and not isinstance(leaf, SwarmError):
            raise UserError(f"cannot listen on {', '.join(map(str, listen_addrs))}: {error_reason(leaf)}") from None
        raise leaf from None
    except Exception as exc:
        if started or isinstance(exc, SwarmError):
            raise
        raise UserError(f"cannot listen on {', '.join(map(str, listen_addrs))}: {error_reason(exc)}") from None
    finally:
        with trio.CancelScope(shield=True), trio.move_on_after(10):
            try:
                await host.close()
            except Exception as exc:
                log.debug("host close: %s", error_reason(exc))
