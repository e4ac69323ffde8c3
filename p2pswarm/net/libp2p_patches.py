"""Every py-libp2p 0.8.1 workaround p2pswarm needs, in one place, applied explicitly once.

p2pswarm runs on py-libp2p 0.8.1 (pinned in pyproject.toml). The library works, but some of its
behaviour is wrong for a swarm (stalls, resets, silent drops, an IPFS-colliding protocol id). Each
workaround below replaces or wraps a *private* part of the library, so each is tied to the pinned
version: :func:`apply` checks the installed version (a mismatch logs a warning naming the patches
to re-check, as the tests below will) and that every private name a patch replaces still exists
(if not, :class:`PatchError` says which patch broke, instead of an AttributeError deep in a
handshake). Every patch has a regression test that fails without it; most have a
``*_trap_still_present`` control that fails once the library no longer needs it.

Process-wide patches (:func:`apply`, called by :func:`p2pswarm.net.host.open_host` and
:class:`p2pswarm.net.kademlia.SwarmDHT`; idempotent):

=============================================  =================================================  ==============================================================
trap (py-libp2p 0.8.1)                          patch                                              regression test
=============================================  =================================================  ==============================================================
A task cancelled mid-frame-write (after Noise   :func:`install_write_shield`: yamux frame writes   tests/test_net_host.py::test_workaround_cancelled_writers_do_not_kill_the_connection
encrypted it, before it was sent) desyncs the   are shielded; a write stalled 30 s closes the
Noise nonces: the whole connection dies.        connection instead.
yamux sends a WINDOW_UPDATE after every read:   :func:`install_window_update_batching`: credit in  tests/test_net_host.py::test_workaround_window_updates_batched
one more Noise message per data frame (half a   batches of half a window, as go-yamux does.
relay's frames).
A stream write goes out one yamux frame at a    :func:`install_coalesced_writes`: the frames of    tests/test_net_host.py::test_workaround_coalesced_writes_and_buffered_reads
time, and a full frame (65,536 bytes) is two    one write (up to 256 KiB) framed together, sent
Noise messages (65,519 + 17), each a send: a    as full Noise messages in one send.
128 KiB reply was 5 messages, 5 sends.
Every Noise message is read with 2+ socket      :func:`install_buffered_tcp_reads`: TCP reads of   tests/test_net_host.py::test_workaround_coalesced_writes_and_buffered_reads
reads (its 2-byte length, then its body),       up to 256 KiB, small reads served from the
each a lock and a trio checkpoint.              buffer.
Identify over a relayed connection reports      :func:`install_relayed_identify_fix`: no observed  tests/test_relay_host.py::test_workaround_identify_sends_no_observed_address_over_a_circuit
``/p2p/<own id>/p2p-circuit/...``; js-libp2p    address on relayed connections (as go/js do).
discards the whole identify message over it.
The kad protocol id is hard-coded to            :func:`install_kad_protocol_id`: rebind the        tests/test_net_dht.py::test_workaround_kad_protocol_id_is_ours
``/ipfs/kad/1.0.0`` (``protocol_prefix`` is     constant in every kad module to
ignored): our DHT would merge with IPFS.        ``/p2pswarm/kad/1.0.0``.
A server keeps at most 20 providers per key     :func:`raise_providers_per_key`: 4,096 per key     tests/test_net_dht.py::test_workaround_more_than_20_providers_per_key
(``BUCKET_SIZE``) and silently ignores the      (provider_store's ``BUCKET_SIZE`` rebound; the     (control: test_providers_per_key_trap_still_present)
21st: the model index (every worker provides    routing table keeps k = 20).
the model key) listed 20 of 30 workers.
=============================================  =================================================  ==============================================================

Per-host patches (used by ``open_host``):

=============================================  =================================================  ==============================================================
trap                                            patch                                              regression test
=============================================  =================================================  ==============================================================
``connect()`` sleeps 250 ms after a successful  :func:`connection_config`:                         tests/test_net_host.py::test_workaround_connect_does_not_stall_250ms
dial unless ``max_connections_per_peer`` is 1.  ``max_connections_per_peer=1``.                    (control: test_connect_stall_trap_still_present)
The auto-connector dials every peer in the      :func:`disable_auto_connect` (its                  tests/test_net_host.py::test_workaround_no_auto_connect_to_every_known_peer
peerstore (dead ones too) after any             ``maybe_connect`` becomes a no-op), and one dial
disconnect; a failed dial retries 3x with       retry instead of three.
back-off (0.7 s lost per dead peer).
One address dialled per transport class, and    :func:`forget_peer_addrs`: fresh addresses         tests/test_net_host.py::test_workaround_restarted_peer_reachable_on_its_new_port
a 60 s block after a failed dial: a peer        replace the peerstore's, the negative cache
restarted on a new port is unreachable.         entry is evicted.
A connection that died stays registered;        :func:`drop_dead_connections`, then one redial.    tests/test_net_dht.py::test_workaround_dead_connections_forgotten_and_redialled
``new_stream`` fails "No valid connections".
Listeners use SO_REUSEPORT: a second node on    :func:`check_port_free`: a plain bind probe        tests/test_net_host.py::test_bad_listen_addresses_and_busy_port
a busy port "starts" and steals connections.    refuses a busy fixed port.
Shutdown closes connections one by one, 0.1 s   :func:`close_connections`: all at once.            tests/test_net_host.py::test_workaround_shutdown_closes_connections_concurrently
sleep + goodbye each (4 s for 20 peers).
A host accepts at most 250 inbound             :func:`connection_config` +                        tests/test_net_host.py::test_workaround_more_than_250_inbound_connections
connections (max 300 - min 50; the resource     :func:`raise_connection_limits`: 1,024 by
manager: 256): the 251st peer's dial fails.     default, a relay its reservations + 256.
A WebSocket transport with a TLS context        :func:`install_websocket`: a plain transport       tests/test_relay_host.py::test_workaround_ws_and_wss_listeners_on_one_host
serves TLS on *every* listener, ``/ws`` too;    (listens ``/ws``, dials both) and a TLS one that   (control: test_ws_tls_trap_still_present)
only hosts listening on WebSocket can dial it.  only listens on ``/wss``; every host dials WS.
=============================================  =================================================  ==============================================================

Per-DHT patches (used by ``SwarmDHT``; :func:`patch_kad`):

=============================================  =================================================  ==============================================================
trap                                            patch                                              regression test
=============================================  =================================================  ==============================================================
A server accepts 10 ADD_PROVIDER per peer per   ``_provider_rate_max`` raised to 4,096 per 10 s.    tests/test_net_dht.py::test_workaround_provide_rate_limit_raised
10 s and silently drops the rest.
A server handles 12 inbound kad streams at      ``_inbound_limiter`` raised to 256.                tests/test_net_dht.py::test_workaround_inbound_kad_stream_limit_raised
once and resets the 13th.
Every peer opening a kad stream enters the      ``add_peer`` replaced: such a peer is admitted     tests/test_net_dht.py::test_workaround_client_mode_peers_stay_out_of_routing_tables
routing table (client-mode phones too).         only once identify says it serves kad.
=============================================  =================================================  ==============================================================

Not patches, but our own protocol code over the library's wire helpers, because the library's
versions are wrong for us (in :mod:`p2pswarm.net.kademlia`, each with its ``test_workaround_*`` in
tests/test_net_dht.py): look-ups that never answer from a stale local copy, ``put_value`` that
reaches the closest peers for namespaced keys, de-duplicated provider look-ups, and provides that
never send an empty address list. :class:`p2pswarm.net.stream.StreamAdapter` (read-ahead, whole
reads, EOF as ``b""``; tests/test_net_host.py::test_workaround_read_ahead_keeps_a_stalled_reader_from_resetting_the_writer
and ``test_frames_cross_a_libp2p_stream_intact``) is an adapter, not a patch.

Relay: ``relay.service.GatedHop`` overrides ``CircuitV2Protocol._handle_reserve``,
``_handle_connect`` and ``_splice`` (reservations in another peer's name refused; one circuit's
streams kept to itself; EOF ends a splice at once - tests/test_relay_host.py::
test_workaround_reservation_in_another_peers_name_is_refused (control
test_spoofed_reservation_trap_still_present), test_workaround_two_circuits_from_one_peer_are_independent,
test_relay_sees_only_ciphertext). Those stay in relay/: they are a subclass's overrides that
implement the relay's own policy (token gate, limits) and change nothing for any other
``CircuitV2Protocol`` in the process - the class is ours, not the library's. :func:`apply` still
checks that the private methods they override exist, so a py-libp2p upgrade that renames them fails
with a clear message here, not as a silently ungated relay.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import logging
import socket
import ssl
import struct

import multiaddr
import trio
from libp2p.custom_types import TProtocol
from libp2p.network.config import ConnectionConfig, RetryConfig

from p2pswarm.errors import InternalError, UserError
from p2pswarm.net.addrs import error_reason, is_circuit_addr

log = logging.getLogger("p2pswarm.net")

LIBP2P_VERSION = "0.8.1"  # the version every patch here was written and tested against
KAD_PROTOCOL = TProtocol("/p2pswarm/kad/1.0.0")  # our Kademlia id (protocol.md); beside the patch that makes it ours
_KAD_MODULES = ("libp2p.kad_dht.common", "libp2p.kad_dht.kad_dht", "libp2p.kad_dht.peer_routing",
                "libp2p.kad_dht.provider_store", "libp2p.kad_dht.value_store")
PROVIDE_RATE_MAX = 4096  # ADD_PROVIDER messages accepted per peer per 10 s (py-libp2p: 10)
MAX_PROVIDERS_PER_KEY = 4096  # provider entries a server keeps per key (py-libp2p: 20, then ignores new ones)
INBOUND_KAD_STREAMS = 256  # concurrent inbound kad streams a server handles (py-libp2p: 12, then resets)
DEFAULT_MAX_CONNECTIONS = 1024  # connections a host may hold (py-libp2p: 300, only 250 of them inbound)
WRITE_STALL_S = 30.0  # a shielded frame write that takes longer than this: the connection is dead

# (module, attribute path) of every private name a patch replaces or relies on
_TARGETS = (
    ("libp2p.stream_muxer.yamux.yamux", "Yamux._write_frame", "install_write_shield"),
    ("libp2p.stream_muxer.yamux.yamux", "YamuxStream._auto_tune_and_send_window_update", "install_window_update_batching"),
    ("libp2p.stream_muxer.yamux.yamux", "YamuxStream._grow_threshold", "install_window_update_batching"),
    ("libp2p.io.trio", "TrioTCPStream.read", "install_buffered_tcp_reads"),
    ("libp2p.stream_muxer.yamux.yamux", "YamuxStream.write", "install_coalesced_writes"),
    ("libp2p.stream_muxer.yamux.yamux", "YAMUX_HEADER_FORMAT", "install_coalesced_writes"),
    ("libp2p.stream_muxer.yamux.yamux", "MAX_MESSAGE_SIZE", "install_coalesced_writes"),
    ("libp2p.security.noise.io", "BaseNoiseMsgReadWriter.write_msg", "install_coalesced_writes"),
    ("libp2p.security.noise.io", "MAX_PLAINTEXT_LENGTH", "install_coalesced_writes"),
    ("libp2p.identity.identify.identify", "_prefer_circuit_addr", "install_relayed_identify_fix"),
    ("libp2p.kad_dht.common", "PROTOCOL_ID", "install_kad_protocol_id"),
    ("libp2p.kad_dht.kad_dht", "KadDHT.add_peer", "patch_kad"),
    ("libp2p.kad_dht.provider_store", "BUCKET_SIZE", "raise_providers_per_key"),
    ("libp2p.relay.circuit_v2.protocol", "CircuitV2Protocol._handle_reserve", "relay.service.GatedHop"),
    ("libp2p.relay.circuit_v2.protocol", "CircuitV2Protocol._handle_connect", "relay.service.GatedHop"),
    ("libp2p.relay.circuit_v2.protocol", "CircuitV2Protocol._send_status", "relay.service.GatedHop"),
    ("libp2p.transport.websocket.transport", "WebsocketTransport.can_listen", "install_websocket"),
    ("libp2p.network.swarm", "Swarm.set_resource_manager", "raise_connection_limits"),
)

_applied = False


class PatchError(InternalError):
    """The installed py-libp2p lacks something a workaround replaces: the patch needs updating."""


def installed_version() -> str:
    try:
        return importlib.metadata.version("libp2p")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def check_targets() -> None:
    """Every private name a patch replaces must exist; PatchError naming the patch otherwise."""
    for module, path, patch in _TARGETS:
        obj = importlib.import_module(module)
        for part in path.split("."):
            if not hasattr(obj, part):
                raise PatchError(f"py-libp2p {installed_version()} has no {module}.{path}, which {patch} "
                                 f"replaces (written for {LIBP2P_VERSION}): update p2pswarm/net/libp2p_patches.py")
            obj = getattr(obj, part)


def apply() -> None:
    """Apply the process-wide patches, once (later calls return at once).

    A py-libp2p other than :data:`LIBP2P_VERSION` logs a warning: the patches may still fit (the
    private names are checked, :class:`PatchError` if one is gone), but only the regression tests
    in the module doc can tell whether each trap is still there and each patch still right."""
    global _applied
    if _applied:
        return
    version = installed_version()
    if version != LIBP2P_VERSION:
        log.warning("py-libp2p %s installed, p2pswarm's workarounds are for %s: run the regression tests "
                    "listed in p2pswarm/net/libp2p_patches.py before trusting this combination", version, LIBP2P_VERSION)
    check_targets()
    install_write_shield()
    install_window_update_batching()
    install_buffered_tcp_reads()
    install_coalesced_writes()
    install_relayed_identify_fix()
    install_kad_protocol_id()
    raise_providers_per_key()
    _applied = True


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
    for name in _KAD_MODULES:
        mod = importlib.import_module(name)
        if hasattr(mod, "PROTOCOL_ID"):
            mod.PROTOCOL_ID = TProtocol(protocol)


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


#: Bytes one TCP read asks the kernel for (py-libp2p 0.8.1 asks for exactly what it needs: 2 bytes
#: of a Noise length, then the message - two or more reads, each a trio checkpoint, per message).
TCP_READ_CHUNK = 256 << 10
#: At most this many bytes of one stream's write go out as one connection write (several yamux
#: frames, one run of Noise messages, one send): bounded, so a large transfer (a shard slice) does
#: not hold the connection's write lock - and every other stream's frames - for long.
COALESCE_WRITE_MAX = 256 << 10


def install_buffered_tcp_reads(chunk: int = TCP_READ_CHUNK) -> None:
    """Read a TCP connection in chunks of up to ``chunk`` bytes and serve the Noise layer's small
    reads from that buffer (process-wide, idempotent).

    py-libp2p 0.8.1's Noise reader asks the socket for exactly the 2-byte length of a message, then
    for its body, each through ``TrioTCPStream.read`` (a lock, a ``recv``, a trio checkpoint): for
    a 128 KiB reply that is 6+ reads and as many trips through the scheduler on the receiving
    side. With a buffer, one ``recv`` usually brings several whole messages, and the reads between
    are plain slices. ``read(n)`` still returns at most ``n`` bytes, EOF and errors still come from
    the library's own read (its exception mapping is kept)."""
    from libp2p.io.trio import TrioTCPStream  # noqa: PLC0415

    if getattr(TrioTCPStream, "_p2pswarm_buffered", False):
        return
    library = TrioTCPStream.read

    async def read(self, n: int | None = None) -> bytes:
        buf = self.__dict__.get("_p2pswarm_rbuf")
        if buf:
            if n is None or n >= len(buf):
                data = bytes(buf)
                buf.clear()
            else:
                data = bytes(buf[:n])
                del buf[:n]  # from the front of a bytearray: O(1), no memmove
            return data
        if n is not None and n == 0:
            return b""
        data = await library(self, max(n or 0, chunk))
        if n is not None and len(data) > n:
            if buf is None:
                buf = self._p2pswarm_rbuf = bytearray()
            buf += memoryview(data)[n:]
            data = data[:n]
        return data

    TrioTCPStream._p2pswarm_library_read = library  # for the regression test's control
    TrioTCPStream.read = read
    TrioTCPStream._p2pswarm_buffered = True


def install_coalesced_writes(limit: int = COALESCE_WRITE_MAX) -> None:
    """One connection write per stream write of up to ``limit`` bytes (process-wide, idempotent).

    py-libp2p 0.8.1 writes a stream's data one yamux frame (64 KiB) at a time, and each frame is
    one ``_write_frame``: a lock, a Noise encryption and a ``send`` - and since a full frame
    (65,536 bytes) is larger than a Noise message may carry (65,519), *two* Noise messages and two
    sends per frame, the second of 17 bytes. A 128 KiB expert reply was 3 frames, 5 Noise
    messages, 5 sends. Now the frames the send window allows (up to ``limit`` bytes) are framed
    together and written as one ``_write_frame``; the Noise writer encrypts the plaintext in
    full-size messages and sends them with one ``send``. The bytes on the wire are the same yamux
    frames (same sizes, same flow control), carried in fewer, fuller Noise messages: a Noise message
    is only a piece of the secured byte stream, which yamux reads without regard to its
    boundaries, so any peer (go, js, rust) reads them alike."""
    from libp2p.security.noise.io import MAX_PLAINTEXT_LENGTH, BaseNoiseMsgReadWriter  # noqa: PLC0415
    from libp2p.stream_muxer.exceptions import MuxedStreamError  # noqa: PLC0415
    from libp2p.stream_muxer.yamux import yamux as ymod  # noqa: PLC0415

    if getattr(ymod.YamuxStream, "_p2pswarm_coalesced", False):
        return
    header = struct.Struct(ymod.YAMUX_HEADER_FORMAT)
    frame_payload = ymod.MAX_MESSAGE_SIZE - ymod.HEADER_SIZE

    async def write(self, data: bytes) -> None:
        if self.send_closed:
            raise MuxedStreamError("Stream is closed for sending")
        view = memoryview(data).cast("B")
        total, sent = len(view), 0
        while sent < total:
            out = None
            while out is None:
                async with self.rw_lock.write_lock():
                    if self.send_closed:
                        raise MuxedStreamError("Stream is closed for sending")
                    async with self.window_lock:
                        if self.closed:
                            raise MuxedStreamError("Stream is closed")
                        if self.send_window > 0:
                            n = min(self.send_window, limit, total - sent)
                            self.send_window -= n
                            parts, pos, end = [], sent, sent + n
                            while pos < end:
                                k = min(frame_payload, end - pos)
                                parts.append(header.pack(0, ymod.TYPE_DATA, 0, self.stream_id, k))
                                parts.append(view[pos : pos + k])
                                pos += k
                            out = parts[0] + parts[1] if len(parts) == 2 else b"".join(parts)
                if out is not None:
                    break
                self._zero_window_waits += 1
                with trio.move_on_after(5.0) as waited:  # as the library: a peer that never credits
                    while True:
                        async with self.window_lock:
                            if self.send_window > 0 or self.closed:
                                break
                        await trio.sleep(0.01)
                if waited.cancelled_caught:
                    raise MuxedStreamError("Timed out waiting for window update after 5 seconds.")
            await self.conn._write_frame(out)
            sent = end

    library_noise_write = BaseNoiseMsgReadWriter.write_msg

    async def write_msg(self, msg: bytes, prefix_encoded: bool = False) -> None:
        if len(msg) <= MAX_PLAINTEXT_LENGTH:
            return await library_noise_write(self, msg, prefix_encoded)
        msg = bytes(msg)  # the noise library encrypts bytes only
        out = []
        for pos in range(0, len(msg), MAX_PLAINTEXT_LENGTH):
            enc = self.encrypt(msg[pos : pos + MAX_PLAINTEXT_LENGTH])
            if prefix_encoded and pos == 0:
                enc = self.prefix + enc
            out.append(len(enc).to_bytes(2, "big"))
            out.append(enc)
        await self.read_writer.read_write_closer.write(b"".join(out))

    ymod.YamuxStream._p2pswarm_library_write = ymod.YamuxStream.write  # for the regression test's control
    ymod.YamuxStream.write = write
    ymod.YamuxStream._p2pswarm_coalesced = True
    BaseNoiseMsgReadWriter._p2pswarm_library_write_msg = library_noise_write
    BaseNoiseMsgReadWriter.write_msg = write_msg


# -- per host --------------------------------------------------------------------------------------
def connection_config(max_connections: int = DEFAULT_MAX_CONNECTIONS) -> ConnectionConfig:
    """Our connection settings. ``max_connections_per_peer=1`` avoids the 250 ms connect stall;
    ``max_connections`` (and the pruning watermark with it) replaces the library's 300, of which
    only ``max_connections - min_connections`` = 250 may be inbound: see :func:`raise_connection_limits`."""
    library = ConnectionConfig()
    return ConnectionConfig(max_connections_per_peer=1, max_connections=max_connections,
                            low_watermark=min(library.low_watermark, max_connections),
                            high_watermark=max_connections)


def raise_connection_limits(host, max_connections: int = DEFAULT_MAX_CONNECTIONS) -> None:
    """Let a host hold ``max_connections`` connections each way (issue 15's relay stall).

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
    tm.add_transport(PlainWebsocket(network.upgrader, tls_client_config=tls_client))
    if tls_server is not None:
        tm.add_transport(SecureWebsocketListener(network.upgrader, tls_server_config=tls_server))



# -- per DHT ---------------------------------------------------------------------------------------
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
