"""Every py-libp2p 0.8.1 workaround p2pswarm needs, in one place, applied explicitly once.

p2pswarm runs on py-libp2p 0.8.1 (pinned in pyproject.toml). The library works, but some of its
behaviour is wrong for a swarm (stalls, resets, silent drops, an IPFS-colliding protocol id). Each
workaround below replaces or wraps a *private* part of the library, so each is tied to the pinned
version: :func:`apply` checks the installed version (a mismatch logs a warning naming the patches
to re-check, as the tests below will) and that every private name a patch replaces still exists
(if not, :class:`PatchError` says which patch broke, instead of an AttributeError deep in a
handshake). Every patch has a regression test that fails without it; most have a
``*_trap_still_present`` control that fails once the library no longer needs it.

The patches live in three modules by what they patch: :mod:`p2pswarm.net.libp2p.stream_patches`
(a connection's byte path), :mod:`p2pswarm.net.libp2p.host_patches` (one host) and
:mod:`p2pswarm.net.libp2p.kad_patches` (the DHT). This module is their register: the tables below,
the checked list of private names, and :func:`apply`.

Process-wide patches (:func:`apply`, called by :func:`p2pswarm.net.libp2p.host.open_host` and
:class:`p2pswarm.net.dht.kademlia.SwarmDHT`; idempotent):

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
versions are wrong for us (in :mod:`p2pswarm.net.dht.kademlia`, each with its ``test_workaround_*`` in
tests/test_net_dht.py): look-ups that never answer from a stale local copy, ``put_value`` that
reaches the closest peers for namespaced keys, de-duplicated provider look-ups, and provides that
never send an empty address list. :class:`p2pswarm.net.libp2p.stream.StreamAdapter` (read-ahead, whole
reads, EOF as ``b""``; tests/test_net_host.py::test_workaround_read_ahead_keeps_a_stalled_reader_from_resetting_the_writer
and ``test_frames_cross_a_libp2p_stream_intact``) is an adapter, not a patch.

Relay: ``p2pswarm.relay.service.GatedHop`` overrides ``CircuitV2Protocol._handle_reserve`` and
``_handle_connect``, calls the library's ``_send_status`` and reads its resource manager's
``_reservations`` (reservations in another peer's name refused; one circuit's streams kept to
itself; EOF ends a circuit at once: its ``_handle_connect`` splices with its own ``_splice``, never
the library's ``_relay_data`` - tests/test_relay_host.py::
test_workaround_reservation_in_another_peers_name_is_refused (control
test_spoofed_reservation_trap_still_present), test_workaround_two_circuits_from_one_peer_are_independent,
test_relay_sees_only_ciphertext). Those stay in p2pswarm/relay/: they are a subclass's overrides that
implement the relay's own policy (token gate, limits) and change nothing for any other
``CircuitV2Protocol`` in the process - the class is ours, not the library's.

:func:`check_targets` (run by :func:`apply`) checks every private name of the library that any of
these patches, overrides or our own DHT code (``SwarmDHT.put_value``: ``ValueStore._store_at_peer``)
replaces, reads or writes - methods and module constants by ``hasattr``, attributes an object only
gets in its constructor by the names its ``__init__`` assigns - so a py-libp2p upgrade that renames
one fails with a clear message naming the patch, not as a silently unpatched (or ungated) node.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import logging
import types

from p2pswarm.errors import InternalError
from p2pswarm.net.libp2p.kad_patches import install_kad_protocol_id, raise_providers_per_key
from p2pswarm.net.libp2p.stream_patches import (install_buffered_tcp_reads, install_coalesced_writes,
                                                install_relayed_identify_fix, install_window_update_batching,
                                                install_write_shield)

log = logging.getLogger("p2pswarm.net")

LIBP2P_VERSION = "0.8.1"  # the version every patch here was written and tested against

_YAMUX = "libp2p.stream_muxer.yamux.yamux"
_KAD = "libp2p.kad_dht.kad_dht"
_HOP = "libp2p.relay.circuit_v2.protocol"
_GATED_HOP = "p2pswarm.relay.service.GatedHop"
#: (module, name, who relies on it) of every private name of py-libp2p a patch replaces, reads or
#: writes, and of the library constants a patch copies. ``Class.name`` is a class attribute or
#: method; ``Class().name`` an attribute the class's constructor sets (checked by the names its
#: ``__init__`` assigns: an instance cannot be built here).
_TARGETS = (
    (_YAMUX, "Yamux._write_frame", "install_write_shield"),
    (_YAMUX, "Yamux()._write_lock", "install_write_shield"),
    (_YAMUX, "YamuxStream._auto_tune_and_send_window_update", "install_window_update_batching"),
    (_YAMUX, "YamuxStream._grow_threshold", "install_window_update_batching"),
    (_YAMUX, "YamuxStream._grow_to_delta", "install_window_update_batching"),
    (_YAMUX, "YamuxStream._apply_autotune_epoch", "install_window_update_batching"),
    (_YAMUX, "YamuxStream()._pending_recv_release", "install_window_update_batching"),
    ("libp2p.io.trio", "TrioTCPStream.read", "install_buffered_tcp_reads"),
    (_YAMUX, "YamuxStream.write", "install_coalesced_writes"),
    (_YAMUX, "YamuxStream()._zero_window_waits", "install_coalesced_writes"),
    (_YAMUX, "YAMUX_HEADER_FORMAT", "install_coalesced_writes"),
    (_YAMUX, "HEADER_SIZE", "install_coalesced_writes"),
    (_YAMUX, "TYPE_DATA", "install_coalesced_writes"),
    (_YAMUX, "MAX_MESSAGE_SIZE", "install_coalesced_writes"),
    ("libp2p.security.noise.io", "BaseNoiseMsgReadWriter.write_msg", "install_coalesced_writes"),
    ("libp2p.security.noise.io", "MAX_PLAINTEXT_LENGTH", "install_coalesced_writes"),
    ("libp2p.identity.identify.identify", "_prefer_circuit_addr", "install_relayed_identify_fix"),
    ("libp2p.kad_dht.common", "PROTOCOL_ID", "install_kad_protocol_id"),
    (_KAD, "PROTOCOL_ID", "install_kad_protocol_id"),
    ("libp2p.kad_dht.peer_routing", "PROTOCOL_ID", "install_kad_protocol_id"),
    ("libp2p.kad_dht.provider_store", "PROTOCOL_ID", "install_kad_protocol_id"),
    ("libp2p.kad_dht.value_store", "PROTOCOL_ID", "install_kad_protocol_id"),
    ("libp2p.kad_dht.provider_store", "BUCKET_SIZE", "raise_providers_per_key"),
    (_KAD, "KadDHT.add_peer", "patch_kad"),
    (_KAD, "KadDHT()._provider_rate_max", "patch_kad"),
    (_KAD, "KadDHT()._inbound_limiter", "patch_kad"),
    ("libp2p.kad_dht.value_store", "ValueStore._store_at_peer", "SwarmDHT.put_value"),
    ("libp2p.network.swarm", "Swarm.set_resource_manager", "raise_connection_limits"),
    ("libp2p.network.swarm", "Swarm()._resource_manager", "raise_connection_limits"),
    ("libp2p.network.swarm", "Swarm()._negative_peer_cache", "forget_peer_addrs"),
    ("libp2p.transport.websocket.transport", "WebsocketTransport.can_listen", "install_websocket"),
    ("libp2p.transport.manager", "TransportManager()._transports", "install_websocket"),
    (_HOP, "CircuitV2Protocol._handle_reserve", _GATED_HOP),
    (_HOP, "CircuitV2Protocol._handle_connect", _GATED_HOP),
    (_HOP, "CircuitV2Protocol._send_status", _GATED_HOP),
    ("libp2p.relay.circuit_v2.resources", "RelayResourceManager()._reservations", _GATED_HOP),
)

_applied = False


class PatchError(InternalError):
    """The installed py-libp2p lacks something a workaround replaces: the patch needs updating."""


def installed_version() -> str:
    try:
        return importlib.metadata.version("libp2p")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _code_names(code: types.CodeType) -> set[str]:
    """Every attribute and global name a code object (and the functions defined in it) uses."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


def _constructor_sets(cls: type, name: str) -> bool:
    """Whether the ``__init__`` of ``cls`` or of a base class names attribute ``name``."""
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is not None and hasattr(init, "__code__") and name in _code_names(init.__code__):
            return True
    return False


def check_targets() -> None:
    """Every private name a patch relies on must exist; PatchError naming the patch otherwise."""
    for module, path, patch in _TARGETS:
        obj = importlib.import_module(module)
        cls_path, _, instance_attr = path.partition("().")
        found = True
        for part in cls_path.split("."):
            if not hasattr(obj, part):
                found = False
                break
            obj = getattr(obj, part)
        if found and instance_attr:
            found = isinstance(obj, type) and _constructor_sets(obj, instance_attr)
        if not found:
            raise PatchError(f"py-libp2p {installed_version()} has no {module}.{path}, which {patch} "
                             f"relies on (written for {LIBP2P_VERSION}): update p2pswarm/net/libp2p/patches.py")


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
                    "listed in p2pswarm/net/libp2p/patches.py before trusting this combination", version, LIBP2P_VERSION)
    check_targets()
    install_write_shield()
    install_window_update_batching()
    install_buffered_tcp_reads()
    install_coalesced_writes()
    install_relayed_identify_fix()
    install_kad_protocol_id()
    raise_providers_per_key()
    _applied = True
