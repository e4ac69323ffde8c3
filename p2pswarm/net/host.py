"""Our thin wrapper over a py-libp2p 0.8.1 host: TCP + Noise + yamux, explicit addresses, our framing.

Everything in p2pswarm that touches libp2p goes through :func:`open_host` and :class:`NetHost`, so the
library's quirks are handled in one place. The ones handled here (each has a regression test in
``tests/test_net_host.py`` that fails when its workaround is removed):

* ``connect()`` sleeps a fixed 250 ms "happy eyeballs" head start after a *successful* dial unless
  the per-peer connection limit is 1 (the dial loop only cancels its timer when it reaches
  ``max_connections_per_peer``). We set ``ConnectionConfig(max_connections_per_peer=1)``: one
  connection per peer is all we want anyway (yamux multiplexes streams over it).
* ``stream.read(n)`` returns at most 65,524 bytes (one yamux frame) whatever ``n`` is, and raises
  ``StreamEOF`` instead of returning ``b""`` at the end. :class:`StreamAdapter` turns a libp2p
  stream into a trio-style ``receive_some``/``send_all`` stream, so :mod:`p2pswarm.net.framing`
  (which accumulates until a frame is whole) works unchanged over it.
* A writer whose reader has not read for 5 s with its receive window full (>= 8 MB queued) is reset
  by yamux. :class:`StreamAdapter` therefore reads ahead in a background task (bounded: at most
  ``read_ahead`` bytes buffered, then ordinary back-pressure), so a busy consumer - a worker
  computing while the next request arrives, a backbone in numpy while a large reply arrives - never
  makes its peer's write fail.
* The dialler tries one address per transport class - the first TCP address in the peerstore -
  and blocks a peer for 60 s after a failed dial, so a peer restarted on a new port stays
  unreachable. :meth:`NetHost.connect` makes the addresses it is given (fresh, from a signed
  record or the user) the peer's only ones.
* Listeners are bound with SO_REUSEPORT, so a second node on a busy port starts "fine" and the
  kernel splits incoming connections between the two processes. We probe a fixed port with a
  plain bind first and refuse a busy one.
* A task cancelled in the middle of a yamux frame write - after Noise has encrypted the frame
  (advancing its nonce), before the bytes are sent - desynchronises the two Noise states: the
  peer fails to decrypt everything after it ("Failed authentication of message") and the whole
  connection dies with all its streams. Any timeout or cancelled look-up can do that; in a 20-node
  DHT on one machine, puts and provides lost a peer or two this way every few rounds.
  :func:`install_write_shield` makes frame writes atomic.
* The swarm's auto-connector tries to hold 150 connections (the midpoint of its watermarks): after
  any disconnect, and every 10 s while below 50, it dials every peer in the peerstore - any peer a
  DHT answer ever mentioned, dead ones included, racing our own dials. Watermarks cannot turn it
  off without turning on pruning, so we replace its ``maybe_connect`` with a no-op: our DHT and
  resolver decide whom to dial.
* A connection that died under us (see the write shield above, or a peer that crashed) can stay in the
  swarm's table, marked closed, and ``new_stream`` then fails with "No valid connections" instead
  of redialling. :meth:`NetHost.forget_dead_connections` removes such entries; opening a stream
  retries once after it.
* Shutting a host down closes its connections one at a time, each with a fixed 0.1 s sleep and a
  goodbye round trip: ~0.2 s per connected peer, 4 s for a DHT node with 20 peers. We close them
  all concurrently first.

Relay and WebSocket support (issue M2b, relay-443); each with a regression test in
``tests/test_relay_host.py``:

* A WebSocket transport that has a TLS server context serves TLS on *every* listener it makes,
  plain ``/ws`` ones included, so a host listening on both ``/ws`` and ``/wss`` breaks its ``/ws``
  listener. We register two transports: one plain (listens on ``/ws``, dials both) and one with
  the TLS context that only listens on ``/wss``.
* Listen addresses that share a host and port (``/tcp/0`` and ``/wss`` alike) are put behind
  py-libp2p's port demultiplexer, which breaks WebSocket upgrades. We refuse such a combination
  with one line: give each transport its own explicit port.
* Every host can *dial* ``/ws`` and ``/wss`` (py-libp2p only adds the WebSocket transport when a
  listen address needs it), so a TCP-only backbone reaches a relay behind a CDN.
* ``host.connect()`` never dials ``/p2p-circuit`` addresses (the swarm filters them out as
  "relay-only"). :meth:`NetHost.connect` dials them itself through the circuit relay v2
  transport, after any direct address failed; the relayed connection is Noise + yamux end to end
  over the relay's stream, so the relay only ever carries ciphertext.
* Every host runs the circuit v2 STOP side, so an inbound relayed connection is accepted; a
  host's own relayed addresses (``<relay>/p2p/<relay id>/p2p-circuit``) are kept by
  :meth:`NetHost.set_relay_addrs` and advertised by :meth:`NetHost.addrs` (py-libp2p rewrites
  announced circuit addresses, so ``announce`` cannot carry them).

* Identify on a relayed connection reports the peer's "observed address" as the circuit address
  py-libp2p's STOP side made up, ``/p2p/<our own id>/p2p-circuit/p2p/<peer>`` (our id in the
  relay's place, no transport part); js-libp2p discards the whole identify message over it, so it
  never learns a relayed worker's protocols. :func:`install_relayed_identify_fix` sends no observed
  address on relayed connections, as go-libp2p and js-libp2p do.

Performance (measured by ``bench/bench_relay.py``, docs/benchmarks.md "Relay-443"; regression test
``test_workaround_window_updates_batched`` counts the WINDOW_UPDATE frames):

* yamux in py-libp2p 0.8.1 credits a stream's receive window after (nearly) every read, so every
  data frame is answered by a WINDOW_UPDATE frame: one more Noise message and socket write each.
  A relay pays for it twice over: its own updates to both ends of every circuit, and the circuit's
  inner updates (end to end, inside the ciphertext), which it must forward as data. That was half
  the frames a relay handled per relayed request. :func:`install_window_update_batching` credits in
  batches of half a window, as go-yamux does, and still on every read when the peer is down to
  less than half a window (a slow reader), so no sender waits on credit for bytes already read.

Only Noise is offered for security (py-libp2p's default list also offers TLS, SECIO and plaintext)
and only yamux for multiplexing. Identify's observed-address discovery is off: we advertise exactly
the addresses we were told to (``listen`` or ``announce``), never a guessed NAT mapping.
"""
from __future__ import annotations

import logging
import socket
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
from libp2p.network.config import ConnectionConfig, RetryConfig
from libp2p.network.stream.exceptions import StreamEOF, StreamError
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.tools.anyio_service import background_trio_service

from p2pswarm import settings
from p2pswarm.errors import UserError, clip, single_error
from p2pswarm.net.identity import Identity

log = logging.getLogger("p2pswarm.net")

# Every protocol id p2pswarm speaks lives under /p2pswarm/, is versioned (docs/protocol.md) and is
# defined beside its protocol; re-exported here for the callers that open expert streams.
from p2pswarm.net.expert_protocol import PROTOCOL_EXPERT  # noqa: E402,F401

PROTOCOL_CIRCUIT = "p2p-circuit"

DEFAULT_LISTEN = "/ip4/127.0.0.1/tcp/0"
DEFAULT_READ_AHEAD = 24 << 20  # > the 8-16 MB yamux window, so a stalled consumer never stalls the peer
YAMUX_MAX_READ = 65524  # what one read() returns at most (one yamux frame payload)

# py-libp2p logs routine peer churn (a peer closing a DHT stream, a refused dial) as WARNING or
# ERROR with no context; our own log lines say what matters. P2PSWARM_LIBP2P_LOG=DEBUG restores it.
_LIBP2P_LOG_LEVEL = settings.LIBP2P_LOG.raw() or settings.LIBP2P_LOG.default
_LIBP2P_LOG_LEVEL = _LIBP2P_LOG_LEVEL.upper()
logging.getLogger("libp2p").setLevel(getattr(logging, _LIBP2P_LOG_LEVEL, logging.CRITICAL))

StreamHandler = Callable[["StreamAdapter"], Awaitable[None]]


class NetError(UserError):
    """A peer that cannot be dialled, or a stream that cannot be opened, in one line."""


def parse_multiaddr(text: str, what: str = "address") -> multiaddr.Multiaddr:
    try:
        return multiaddr.Multiaddr(text)
    except Exception as exc:
        raise UserError(f"bad {what} {clip(text, 200)!r}: {clip(exc, 200) or 'not a multiaddr'} "
                        f"(expected e.g. /ip4/127.0.0.1/tcp/4001)") from None


def parse_peer_addr(text: str) -> PeerInfo:
    """``/ip4/H/tcp/P/p2p/PEERID`` -> PeerInfo; a clear error for anything else."""
    ma = parse_multiaddr(text, "peer address")
    try:
        peer = ma.get_peer_id()
    except Exception:
        peer = None
    if not peer:
        raise UserError(f"peer address {text[:80]!r} lacks its /p2p/PEERID part "
                        f"(the bootstrap node prints its full address at start)")
    try:
        pid = ID.from_base58(peer)
    except Exception:
        raise UserError(f"peer address {text[:80]!r}: malformed peer id {peer[:60]!r}") from None
    base = ma.decapsulate(multiaddr.Multiaddr(f"/p2p/{peer}"))
    return PeerInfo(pid, [base])


def _is_wildcard(ma: multiaddr.Multiaddr) -> bool:
    for proto in ("ip4", "ip6"):
        try:
            if ma.value_for_protocol(proto) in ("0.0.0.0", "::"):
                return True
        except Exception:
            pass
    return False


def is_circuit_addr(ma) -> bool:
    """Whether a multiaddr goes through a relay (``.../p2p/RELAY/p2p-circuit[/p2p/PEER]``)."""
    try:
        return PROTOCOL_CIRCUIT in {p.name for p in multiaddr.Multiaddr(str(ma)).protocols()}
    except Exception:
        return False


def circuit_addr(relay_addr: str | multiaddr.Multiaddr, peer: str | None = None) -> str:
    """``RELAY_ADDR/p2p/RELAY_ID`` -> ``RELAY_ADDR/p2p/RELAY_ID/p2p-circuit[/p2p/PEER]``."""
    text = str(relay_addr).rstrip("/")
    out = f"{text}/{PROTOCOL_CIRCUIT}"
    return f"{out}/p2p/{peer}" if peer else out


def _map_stream_error(exc: BaseException, what: str) -> trio.BrokenResourceError:
    return trio.BrokenResourceError(f"{what}: {type(exc).__name__}{': ' + str(exc) if str(exc) else ''}")


class StreamAdapter:
    """A libp2p stream seen as a trio byte stream: ``receive_some``, ``send_all``, ``send_eof``,
    ``aclose``. Errors become :class:`trio.BrokenResourceError` (peer reset, connection lost) or
    :class:`trio.ClosedResourceError` (we closed it), the same as a TCP socket's, so the framing and
    the expert-protocol handlers treat both transports alike.

    With :meth:`start_reading` a background task reads ahead into a buffer of at most
    ``read_ahead`` bytes (see the module doc for why)."""

    def __init__(self, stream, *, read_ahead: int = DEFAULT_READ_AHEAD):
        self.stream = stream
        self.read_ahead = max(read_ahead, YAMUX_MAX_READ)
        try:
            self.peer_id: ID | None = stream.muxed_conn.peer_id
        except Exception:
            self.peer_id = None
        self.peer_name = self.peer_id.to_base58() if self.peer_id else "peer"
        self._buf = bytearray()
        self._eof = False
        self._error: BaseException | None = None
        self._closed = False
        self._pumping = False
        self._pump_scope: trio.CancelScope | None = None
        self._readable = trio.Event()
        self._space = trio.Event()
        self._send_lock = trio.Lock()

    # -- reading -------------------------------------------------------------------------------
    def start_reading(self, nursery: trio.Nursery) -> None:
        """Read ahead in ``nursery`` until EOF, error or :meth:`aclose`."""
        if not self._pumping:
            self._pumping = True
            self._pump_scope = trio.CancelScope()
            nursery.start_soon(self._pump)

    async def _pump(self) -> None:
        with self._pump_scope:
            try:
                while True:
                    while len(self._buf) >= self.read_ahead:
                        self._space = trio.Event()
                        await self._space.wait()
                    chunk = await self.stream.read(self.read_ahead - len(self._buf))
                    if not chunk:
                        break
                    self._buf += chunk
                    self._readable.set()
            except StreamEOF:
                pass
            except (StreamError, Exception) as exc:  # reset, muxer error, connection lost
                self._error = _map_stream_error(exc, "stream broken")
            finally:
                self._eof = True
                self._readable.set()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if self._closed:
            raise trio.ClosedResourceError("stream was closed")
        n = max_bytes or YAMUX_MAX_READ
        if not self._pumping:
            try:
                return await self.stream.read(n)
            except StreamEOF:
                return b""
            except Exception as exc:
                raise _map_stream_error(exc, "stream broken") from None
        while not self._buf:
            if self._eof:
                if self._error is not None:
                    raise self._error
                return b""
            self._readable = trio.Event()
            await self._readable.wait()
            if self._closed:
                raise trio.ClosedResourceError("stream was closed")
        out = bytes(self._buf[:n])
        del self._buf[:n]
        self._space.set()
        return out

    # -- writing -------------------------------------------------------------------------------
    async def send_all(self, data) -> None:
        if self._closed:
            raise trio.ClosedResourceError("stream was closed")
        async with self._send_lock:
            try:
                await self.stream.write(bytes(data))
            except Exception as exc:
                raise _map_stream_error(exc, "stream broken") from None

    async def send_eof(self) -> None:
        """Half-close: the peer reads EOF after what we sent; we may keep reading."""
        try:
            await self.stream.close_write()
        except Exception as exc:
            raise _map_stream_error(exc, "stream broken") from None

    async def aclose(self) -> None:
        """Close both ways. Bounded and shielded, so it also completes under trio.aclose_forcefully."""
        if self._closed:
            return
        self._closed = True
        if self._pump_scope is not None:
            self._pump_scope.cancel()
        self._readable.set()
        with trio.CancelScope(shield=True), trio.move_on_after(2):
            try:
                await self.stream.close()
            except Exception:
                try:
                    await self.stream.reset()
                except Exception:
                    pass

    async def reset(self) -> None:
        """Abort both ways (the peer sees a reset, not EOF)."""
        self._closed = True
        if self._pump_scope is not None:
            self._pump_scope.cancel()
        with trio.CancelScope(shield=True), trio.move_on_after(2):
            try:
                await self.stream.reset()
            except Exception:
                pass


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
            base = [str(a) for a in self.transport_addrs() if not _is_wildcard(a)]
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
                    await self.host.connect(PeerInfo(info.peer_id, direct) if circuits else info)
                else:
                    await self._connect_direct_or_relayed(info.peer_id, direct, circuits)
        except trio.TooSlowError:
            raise NetError(f"dialling {info.peer_id.to_base58()} timed out after {timeout_s:.0f} s") from None
        except NetError:
            raise
        except Exception as exc:
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
                    from p2pswarm.net.relay_token import present_token  # noqa: PLC0415 - only for relayed dials

                    relay_part = text.split("/p2p-circuit", 1)[0]
                    await present_token(self, relay_part, self.relay_token)
                await self.circuit.dial(multiaddr.Multiaddr(text))
                if self.is_connected(peer):
                    return
                errors.append("relayed connection did not register")
            except Exception as exc:
                errors.append(error_reason(exc))
        raise NetError(f"cannot dial {peer.to_base58()} directly or through its relay: "
                       f"{'; '.join(errors) or 'no address'}")

    def _replace_addrs(self, info: PeerInfo) -> None:
        """Make ``info.addrs`` the only addresses we know for the peer, and forget a recent failure.

        py-libp2p dials at most ONE address per transport class (the first TCP one it has) and then
        refuses to redial a peer for 60 s after a failure. A worker restarted on a new port would be
        unreachable: the peerstore still lists the dead port first. Addresses we are given here
        come from the peer's freshest signed record or from the user, so they replace the rest."""
        try:
            self.host.get_peerstore().clear_addrs(info.peer_id)
        except Exception:
            pass
        cache = getattr(self.host.get_network(), "_negative_peer_cache", None)
        if cache is not None:
            cache.evict(str(info.peer_id))

    async def forget_dead_connections(self, peer: ID) -> bool:
        """Drop connections to ``peer`` that are closed but still registered; True if any were.

        py-libp2p sometimes leaves a connection the remote has just closed in the swarm's table for
        a while; until it goes, ``new_stream`` fails with "No valid connections" instead of
        redialling. Callers retrying after a failed stream call this first."""
        conns = self.host.get_network().connections.get(peer) or []
        if conns and all(getattr(c, "is_closed", False) for c in conns):
            with trio.CancelScope(shield=True), trio.move_on_after(2):
                try:
                    await self.host.get_network().close_peer(peer)
                except Exception as exc:
                    log.debug("forgetting dead connection to %s: %s", peer, error_reason(exc))
            return True
        return False

    def is_connected(self, peer: ID) -> bool:
        return bool(self.host.get_network().connections.get(peer))

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


def error_reason(exc: BaseException) -> str:
    """One line out of py-libp2p's nested exceptions."""
    parts, seen = [], 0
    while exc is not None and seen < 4:
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if text not in parts:
            parts.append(clip(text, 200))
        exc = exc.__cause__ or (exc.exceptions[0] if isinstance(exc, BaseExceptionGroup) else None)
        seen += 1
    return ": ".join(parts)


def _check_port_free(ma: multiaddr.Multiaddr) -> None:
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


WRITE_STALL_S = 30.0  # a shielded frame write that takes longer than this: the connection is dead


def install_write_shield() -> None:
    """Make every yamux frame write atomic with respect to cancellation (process-wide, idempotent).

    A yamux frame goes out as one Noise message: encrypt (which advances the nonce), then send. A
    task cancelled between the two - a timeout, or a look-up cancelling its now useless queries -
    leaves the nonce advanced and the message unsent; the peer fails to decrypt every later message
    ("Failed authentication of message") and the connection, with every stream on it, dies. We
    shield the write; a write stuck for WRITE_STALL_S closes the connection instead of hanging."""
    from libp2p.stream_muxer.yamux.yamux import Yamux  # noqa: PLC0415

    if getattr(Yamux, "_p2pswarm_shielded", False):
        return

    async def _write_frame(self, data: bytes) -> None:
        async with self._write_lock:
            with trio.CancelScope(shield=True):
                with trio.move_on_after(WRITE_STALL_S) as stall:
                    await self.secured_conn.write(data)
                if stall.cancelled_caught:
                    log.warning("a write to %s stalled %.0f s: closing the connection", self.peer_id, WRITE_STALL_S)
                    with trio.move_on_after(2):
                        try:
                            await self.secured_conn.close()
                        except Exception:
                            pass
                    raise trio.BrokenResourceError("connection write stalled")
        await trio.lowlevel.checkpoint()

    Yamux._write_frame = _write_frame
    Yamux._p2pswarm_shielded = True


def install_window_update_batching() -> None:
    """Credit a stream's receive window in batches of half a window, as go-yamux does (process-wide,
    idempotent). py-libp2p 0.8.1 sends a WINDOW_UPDATE after (nearly) every read: one more Noise
    message - and on WebSocket one more WebSocket message and send() - per data frame, which for
    small request/reply traffic doubles the frames a connection carries; through a relay it is
    worse, since the circuit's inner updates are data the relay must forward too (module doc).

    The policy: ``delta`` = bytes read but not yet credited (the window target minus what the peer
    may still send minus what we hold unread). We credit all of it, with the library's own window
    auto-tuning, once it reaches the library's hysteresis threshold (half the target) - or, as the
    library did, on every read while the peer has less than half a window left (a backlogged or
    slow reader), so a sender is never left waiting on credit for bytes already read: py-libp2p's
    writer gives up after 5 s at a zero window."""
    from libp2p.stream_muxer.yamux.yamux import YamuxStream  # noqa: PLC0415

    if getattr(YamuxStream, "_p2pswarm_batched_credit", False):
        return

    async def _auto_tune_and_send_window_update(self, *, bytes_read: int = 0) -> None:
        total = 0
        async with self.window_lock:
            buffered = len(self.conn.stream_buffers.get(self.stream_id, b""))
            delta = self.target_recv_window - (self.recv_window + buffered)
            threshold = self._grow_threshold()
            if delta > 0 and (delta >= threshold or self.recv_window < threshold):
                total = self._grow_to_delta(buffered) + self._apply_autotune_epoch(buffered)
                self._pending_recv_release = 0
        if total > 0:
            await self.send_window_update(total, skip_lock=True)

    YamuxStream._p2pswarm_library_credit = YamuxStream._auto_tune_and_send_window_update  # for the test
    YamuxStream._auto_tune_and_send_window_update = _auto_tune_and_send_window_update
    YamuxStream._p2pswarm_batched_credit = True


def install_relayed_identify_fix() -> None:
    """Send no identify observed address on a relayed connection (process-wide, idempotent).

    py-libp2p 0.8.1 reports, as the observed address of a peer reached through a relay, the circuit
    address its STOP side made up: ``/p2p/<OUR OWN id>/p2p-circuit/p2p/<peer>`` -- our id where the
    relay's belongs, and no transport part. js-libp2p rejects that address and with it the whole
    identify message, so a js peer never learns a relayed worker's protocols. go-libp2p and
    js-libp2p do not report observed addresses on relayed connections either; we send none there.
    Direct connections keep reporting the socket's remote address."""
    from libp2p.identity.identify import identify as ident  # noqa: PLC0415

    if getattr(ident._prefer_circuit_addr, "_p2pswarm", False):
        return
    library = ident._prefer_circuit_addr

    def observed_addr(host, peer_id, fallback):
        addr = library(host, peer_id, fallback)
        return None if addr is not None and is_circuit_addr(addr) else addr

    observed_addr._p2pswarm = True
    observed_addr.library = library  # for the regression test's control
    ident._prefer_circuit_addr = observed_addr


async def _no_auto_connect() -> None:
    """Replaces py-libp2p's AutoConnector.maybe_connect: we decide whom to dial."""


async def _close_connections(host) -> None:
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


def check_listen_addrs(addrs: Sequence[multiaddr.Multiaddr], *, tls: bool) -> None:
    """TCP, WebSocket (``/ws``) or TLS WebSocket (``/wss``, needs a certificate) over IPv4/IPv6;
    no two of them on one host and port (see module doc: the port demultiplexer breaks WebSocket)."""
    seen: dict[tuple[str, str], multiaddr.Multiaddr] = {}
    for a in addrs:
        names = [p.name for p in a.protocols()]
        ok = (len(names) in (2, 3) and names[0] in ("ip4", "ip6") and names[1] == "tcp"
              and (len(names) == 2 or names[2] in ("ws", "wss")))
        if not ok:
            raise UserError(f"listen address {a} is not TCP or WebSocket over IPv4/IPv6 "
                            f"(expected /ip4/HOST/tcp/PORT, /ip4/HOST/tcp/PORT/ws or .../wss)")
        if "wss" in names and not tls:
            raise UserError(f"listen address {a} is /wss: give a TLS certificate and key (--tls-cert, --tls-key)")
        key = (a.value_for_protocol(names[0]), a.value_for_protocol("tcp"))
        if key in seen and ({"ws", "wss"} & (set(names) | {p.name for p in seen[key].protocols()})):
            raise UserError(f"listen addresses {seen[key]} and {a} share port {key[1]}: give each transport "
                            f"its own explicit port (e.g. /tcp/4001 and /tcp/443/wss)")
        seen[key] = a


def _tls_server_context(cert: str, key: str) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError, ValueError) as exc:
        raise UserError(f"cannot load TLS certificate {cert} / key {key}: {getattr(exc, 'strerror', None) or exc}") from None
    return ctx


def _tls_client_context() -> ssl.SSLContext:
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


def _install_websocket(host, tls_server: ssl.SSLContext | None) -> None:
    """Replace py-libp2p's WebSocket transport by ours (see module doc): a plain one that listens
    on /ws and dials /ws and /wss, and, with a certificate, one that only listens on /wss."""
    from libp2p.transport.websocket.transport import WebsocketTransport  # noqa: PLC0415

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
    tm.add_transport(PlainWebsocket(network.upgrader, tls_client_config=_tls_client_context()))
    if tls_server is not None:
        tm.add_transport(SecureWebsocketListener(network.upgrader, tls_server_config=tls_server))


def connection_config() -> ConnectionConfig:
    """Our connection settings; ``max_connections_per_peer=1`` avoids the 250 ms connect stall."""
    return ConnectionConfig(max_connections_per_peer=1)


def _stop_only_protocol(host):
    """Circuit relay v2 without HOP: accepts relayed connections (STOP), relays nothing."""
    from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol  # noqa: PLC0415

    return CircuitV2Protocol(host, allow_hop=False)


def _circuit_transport(host, protocol):
    """The dialler for /p2p-circuit addresses. STOP only, no CLIENT role: with CLIENT, every dial
    would first ask the relay for a reservation of our own (refused without a token, and
    pointless for a backbone)."""
    from libp2p.relay.circuit_v2.config import RelayConfig, RelayRole  # noqa: PLC0415
    from libp2p.relay.circuit_v2.transport import CircuitV2Transport  # noqa: PLC0415

    return CircuitV2Transport(host, protocol, RelayConfig(roles=RelayRole.STOP))


@asynccontextmanager
async def open_host(identity: Identity, listen: Sequence[str] = (DEFAULT_LISTEN,), *,
                    announce: Sequence[str] | None = None, read_ahead: int = DEFAULT_READ_AHEAD,
                    dial_retries: int = 1, tls_cert: str | None = None, tls_key: str | None = None,
                    circuit_protocol: Callable | None = None):
    """Start a host listening on ``listen`` (multiaddrs; port 0 picks a free port) and yield a
    :class:`NetHost`. On exit: background tasks cancelled, listeners and connections closed.

    ``announce`` replaces the listen addresses in what we advertise (a public address in front of
    a NAT or a relay). ``dial_retries``: py-libp2p retries a failed dial 3 times with back-off by
    default (0.7 s lost on every dead peer); one retry is plenty on our networks.

    Listen addresses may be TCP, ``/ws`` or ``/wss`` (the latter with ``tls_cert``/``tls_key``
    PEM files). ``circuit_protocol(host)`` builds the circuit relay v2 service the host runs (the
    relay passes its token-gated HOP); by default a STOP-only one, so relayed peers can reach us.
    ``NetHost.circuit`` dials ``/p2p-circuit`` addresses."""
    if not listen:
        raise UserError("a host needs at least one listen address")
    install_write_shield()
    install_window_update_batching()
    install_relayed_identify_fix()
    listen_addrs = [parse_multiaddr(a, "listen address") for a in listen]
    if bool(tls_cert) != bool(tls_key):
        raise UserError("a TLS certificate needs its key and the other way round (--tls-cert and --tls-key)")
    check_listen_addrs(listen_addrs, tls=bool(tls_cert))
    tls_server = _tls_server_context(tls_cert, tls_key) if tls_cert else None
    for a in listen_addrs:
        _check_port_free(a)
    announce_addrs = [parse_multiaddr(a, "announce address") for a in announce] if announce else None
    sec = {NOISE_PROTOCOL_ID: NoiseTransport(identity.key_pair, noise_privkey=new_x25519_key_pair().private_key)}
    host = new_host(
        key_pair=identity.key_pair,
        sec_opt=sec,
        muxer_preference="YAMUX",
        listen_addrs=listen_addrs,
        connection_config=connection_config(),
        announce_addrs=announce_addrs,
        disable_identify_address_discovery=True,
    )
    _install_websocket(host, tls_server)
    network = host.get_network()
    auto = getattr(network, "auto_connector", None)
    if auto is not None:
        auto.maybe_connect = _no_auto_connect  # see module doc
    if hasattr(network, "retry_config"):
        network.retry_config = RetryConfig(max_retries=dial_retries, initial_delay=0.05, max_delay=1.0)
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
                    from p2pswarm.net.tokens import load_token  # noqa: PLC0415

                    net.relay_token = load_token(settings.RELAY_TOKEN.raw())
                if len(net.transport_addrs()) < len(listen_addrs):
                    raise UserError(f"could not listen on {', '.join(map(str, listen_addrs))} "
                                    f"(listening on {', '.join(map(str, net.transport_addrs())) or 'nothing'})")
                log.debug("host %s listening on %s", net.peer_id_str, ", ".join(map(str, net.transport_addrs())))
                try:
                    yield net
                finally:
                    nursery.cancel_scope.cancel()
                    with trio.CancelScope(shield=True), trio.move_on_after(10):
                        await _close_connections(host)
    except BaseExceptionGroup as group:  # our nursery and py-libp2p's wrap the body's own error
        leaf = single_error(group)
        if leaf is group:
            raise
        if not started and isinstance(leaf, Exception) and not isinstance(leaf, UserError):
            raise UserError(f"cannot listen on {', '.join(map(str, listen_addrs))}: {error_reason(leaf)}") from None
        raise leaf from None
    except Exception as exc:
        if started or isinstance(exc, UserError):
            raise
        raise UserError(f"cannot listen on {', '.join(map(str, listen_addrs))}: {error_reason(exc)}") from None
    finally:
        with trio.CancelScope(shield=True), trio.move_on_after(10):
            try:
                await host.close()
            except Exception as exc:
                log.debug("host close: %s", error_reason(exc))
