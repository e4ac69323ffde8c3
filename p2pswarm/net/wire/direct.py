"""The direct lane: expert requests on a plain TCP socket, keyed through an authenticated libp2p stream.

Why: an expert request through py-libp2p costs ~1.4 ms of CPU (both ends, Python yamux and Noise,
~35 trio task steps); the same request on a TCP socket costs ~0.4 ms and 5 steps (bench_wire,
``--transport``). At 12.5 requests per generated token that is most of a backbone's CPU per token
at low concurrency. So a worker that is directly reachable offers a second way in:

1. The backbone's ``hello`` on the ``/p2pswarm/expert/1.0.0`` stream (Noise: both peers
   authenticated by their libp2p keys) says ``direct: true``.
2. A worker started with ``--direct HOST:PORT`` answers, in its hello reply, with
   ``direct: {port, host, ticket, key}``: a fresh 16-byte one-time ticket and a fresh 32-byte key,
   both random, sent only over that encrypted stream. The ticket is valid for
   :data:`TICKET_TTL_S` and once.
3. The backbone opens a TCP connection to ``host:port`` (``host`` empty: the address it reached the
   worker at), sends the ticket, and from then on every byte both ways is sealed
   (:class:`SealedStream`: AEAD records, one per write, nonces counting up per direction, so a
   record that is forged, altered, replayed, dropped or reordered ends the connection). Then it
   says ``hello`` again on it and the connection is an expert connection like any other; the
   libp2p stream is closed.

The AEAD is negotiated in step 1-2: the backbone's hello lists the ones it takes
(``direct_aeads``, best first), the worker's offer names the one it chose (``aead``). AES-256-GCM
goes first only where the CPU has AES instructions (both ends: each lists or chooses it only then),
because there it costs ~0.04 ms to open a 340 KB reply against ChaCha20-Poly1305's ~0.10 (this
machine's AMD EPYC; a backbone with 4 workers at N=16 opens ~0.4 MB of replies a token, and the
workers seal them); without AES instructions (many ARM phones) ChaCha20-Poly1305 is the faster
and constant-time one, and it stays the default: a hello without ``direct_aeads`` (an older
backbone) and an offer without ``aead`` (an older worker) both mean ChaCha20-Poly1305, so old and
new peers keep interoperating. A worker that shares no AEAD with the backbone's list sends no offer
but ``direct_error``; a backbone that gets an ``aead`` it did not list refuses the lane (one log
line) and stays on libp2p.

The worker serves the direct connection as it served the stream, as the same authenticated peer
(receipts it stores name that peer). A backbone that cannot reach the direct port (a NAT, a
firewall) keeps the libp2p stream, and does not try that worker's direct lane again until its
record changes. Nothing about exactness changes: the same frames, the same worker code.
"""
from __future__ import annotations

import errno
import logging
import os
import platform
import socket
import struct
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import trio
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305

from p2pswarm import settings
from p2pswarm.errors import FrameError, UserError, clip

log = logging.getLogger("p2pswarm.net")

TICKET_TTL_S = 30.0
TICKET_BYTES = 16
KEY_BYTES = 32
RECORD = struct.Struct("!I")  # ciphertext length (authenticated as associated data)
TAG_BYTES = 16
HANDSHAKE_TIMEOUT_S = 10.0
RECV_BYTES = 256 << 10  # the most one socket read takes (a 64-row request of the 122B is ~0.8 MB: 4 reads)
MAX_TICKETS = 4096  # outstanding tickets a worker keeps (oldest dropped first)

CHACHA = "chacha20-poly1305"  # the default, and what a peer that names no AEAD seals with
AES_GCM = "aes-256-gcm"
AEADS: dict[str, type] = {CHACHA: ChaCha20Poly1305, AES_GCM: AESGCM}
assert set(AEADS) == set(settings.DIRECT_AEADS)


def cpu_has_aes(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU has AES instructions (x86 ``aes`` in ``flags``, ARMv8 ``aes`` in
    ``Features`` of /proc/cpuinfo; Apple silicon always). Unknown: False, so ChaCha20-Poly1305
    (fast in software) is kept."""
    if sys.platform == "darwin" and platform.machine() == "arm64":
        return True
    try:
        with open(cpuinfo, encoding="ascii", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip().lower() in ("flags", "features"):
                    return "aes" in value.split()
    except OSError:  # no /proc (or unreadable): unknown
        return False
    return False


_HAS_AES: bool | None = None


def local_aeads() -> list[str]:
    """The AEADs this process seals a direct lane with, best first: AES-256-GCM first where the
    CPU has AES instructions, ChaCha20-Poly1305 always; only the one ``P2PSWARM_DIRECT_AEAD`` names
    where it is set (benchmarks: the same tree sealing both ways)."""
    global _HAS_AES
    forced = settings.DIRECT_AEAD.get()  # (a bad value: a one-line UserError)
    if forced is not None:
        return [forced]
    if _HAS_AES is None:
        _HAS_AES = cpu_has_aes()
    return [AES_GCM, CHACHA] if _HAS_AES else [CHACHA]


def choose_aead(asked) -> tuple[str | None, str | None]:
    """The worker's choice for a hello's ``direct_aeads`` (None: an older backbone, ChaCha20-Poly1305):
    ``(aead, None)``, or ``(None, why)`` where the lists share none. The backbone's order decides
    among the ones both take."""
    ours = local_aeads()
    if asked is None:
        asked = [CHACHA]
    if not isinstance(asked, list) or not all(isinstance(a, str) for a in asked):
        return None, "direct_aeads must be a list of names"
    for a in asked:
        if a in ours:
            return a, None
    return None, (f"no AEAD in common for the direct lane: the peer takes {', '.join(clip(a, 40) for a in asked[:4])}, "
                  f"this worker seals with {', '.join(ours)}")


class SealedStream:
    """A trio byte stream whose every write is one AEAD record (``aead``: ChaCha20-Poly1305 or
    AES-256-GCM, see the module doc).

    ``receive_some`` is cancel-safe (raw bytes wait in a buffer until a whole record is in), so a
    backbone can resume waiting for a late reply on it. A record longer than ``max_record`` or one
    that does not authenticate raises :class:`FrameError`: the connection is then useless."""

    supports_at_least = False
    cancel_safe_reads = True
    #: ``receive_some()`` with no size hands out a whole decrypted record without a copy
    #: (:class:`~p2pswarm.net.wire.framing.FrameReader` reads a record at a time)
    whole_records = True

    def __init__(self, stream, key: bytes, *, initiator: bool, max_record: int, peer_name: str = "peer",
                 aead: str = CHACHA):
        self.stream = stream
        self.aead = aead
        self._aead = AEADS[aead](key)
        self._send_dir, self._recv_dir = (b"\x01", b"\x02") if initiator else (b"\x02", b"\x01")
        self._send_n = 0
        self._recv_n = 0
        self.max_record = max_record + TAG_BYTES + 64  # a frame's header and payload, sealed
        self.peer_name = peer_name
        self._raw = bytearray()
        self._plain = b""
        self.socket = getattr(stream, "socket", None)
        self._recv_into = getattr(self.socket, "recv_into", None)  # None: a stream without a socket
        self._into: memoryview | None = None  # a receive buffer reused for every read (see _read)
        #: a :class:`~p2pswarm.net.wire.link_rate.LinkRate` timing how each record's bytes arrive
        #: (the backbone's side sets it), or None
        self.rate = None

    def _nonce(self, direction: bytes, n: int) -> bytes:
        return direction + n.to_bytes(11, "big")

    async def send_all(self, data) -> None:
        """One sealed record: sealed straight behind its header in one buffer (not sealed, then
        copied behind the header: a reply is ~0.8 MB of fresh pages a copy)."""
        n = len(data) if isinstance(data, (bytes, bytearray)) else memoryview(data).nbytes
        head = RECORD.pack(n + TAG_BYTES)
        record = bytearray(RECORD.size + n + TAG_BYTES)
        record[: RECORD.size] = head
        with memoryview(record) as out:
            self._aead.encrypt_into(self._nonce(self._send_dir, self._send_n), data, head, out[RECORD.size :])
        self._send_n += 1
        await self.stream.send_all(record)

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        """Up to ``max_bytes`` bytes of plaintext; ``b""`` at a clean end of stream."""
        if not self._plain:
            while True:
                if len(self._raw) >= RECORD.size:
                    (n,) = RECORD.unpack_from(self._raw)
                    if n < TAG_BYTES or n > self.max_record:
                        raise FrameError(f"direct lane: a sealed record of {n} bytes (the most is {self.max_record})")
                    if len(self._raw) >= RECORD.size + n:
                        # decrypted where it lies (views, not two copies of the record each: a
                        # reply is ~0.8 MB, and each copy is fresh pages to fault in); the views
                        # are released before the buffer is cut
                        raw = memoryview(self._raw)
                        try:
                            self._plain = self._aead.decrypt(self._nonce(self._recv_dir, self._recv_n),
                                                             raw[RECORD.size : RECORD.size + n], raw[: RECORD.size])
                        except InvalidTag:
                            raise FrameError("direct lane: a record failed authentication (forged, altered, "
                                             "replayed or out of order)") from None
                        finally:
                            raw.release()
                        del self._raw[: RECORD.size + n]
                        self._recv_n += 1
                        if self.rate is not None:
                            self.rate.message_done()
                            self.rate.begin(bool(self._raw))
                        if self._plain:
                            break
                        continue
                got = await self._read()
                if got and self.rate is not None:
                    self.rate.read(got)
                if not got:
                    if self._raw:
                        raise FrameError(f"direct lane: the connection closed mid-record ({len(self._raw)} bytes)")
                    return b""
        n = len(self._plain) if max_bytes is None else max_bytes
        out, self._plain = self._plain[:n], self._plain[n:]
        return out

    async def _read(self) -> int:
        """Append what the socket has (up to :data:`RECV_BYTES`) to the raw buffer; 0 at end of stream.

        Why into a reused buffer: ``receive_some(n)`` allocates ``n`` bytes per call before the
        kernel fills a few of them, and a fresh MiB cost ~20 us a call here (measured: a 2 KB
        message sent and received 23.9 us with a 1 MiB ask, 4.1 us with 64 KiB), twice per expert
        request. A stream without a socket (tests' memory streams) is read the plain way."""
        if self._recv_into is None:
            chunk = await self.stream.receive_some(RECV_BYTES)
            self._raw += chunk
            return len(chunk)
        if self._into is None:
            self._into = memoryview(bytearray(RECV_BYTES))
        into = self._into
        try:
            n = await self._recv_into(into)
        except OSError as exc:  # reported as SocketStream.receive_some reports it
            if exc.errno in (errno.EBADF, errno.ENOTSOCK):
                raise trio.ClosedResourceError("this socket was already closed") from None
            raise trio.BrokenResourceError(f"socket connection broken: {exc}") from exc
        self._raw += into[:n]
        return n

    async def send_eof(self) -> None:
        await self.stream.send_eof()

    async def aclose(self) -> None:
        await self.stream.aclose()


@dataclass
class _Ticket:
    key: bytes
    aead: str
    peer: str
    expires: float
    serve: Callable[[SealedStream], Awaitable[None]]  # the expert-protocol handler, as the libp2p stream had it


@dataclass
class DirectLane:
    """A worker's direct listener: tickets handed out over libp2p, redeemed on ``host:port``."""

    host: str
    port: int
    announce_host: str = ""  # "" : the backbone dials the address it reached us at
    announce_port: int | None = None
    max_frame: int = 0
    _tickets: dict[bytes, _Ticket] = field(default_factory=dict)
    redeemed: int = 0
    refused: int = 0
    _sock: socket.socket | None = None

    def offer(self, peer: str, serve, aead: str = CHACHA) -> dict:
        """The ``direct`` field of a hello reply to ``peer``; ``serve(stream)`` will serve it, sealed
        with ``aead`` (:func:`choose_aead`)."""
        now = time.monotonic()
        for t in [t for t, v in self._tickets.items() if v.expires < now]:
            del self._tickets[t]
        while len(self._tickets) >= MAX_TICKETS:
            del self._tickets[next(iter(self._tickets))]
        ticket, key = os.urandom(TICKET_BYTES), os.urandom(KEY_BYTES)
        self._tickets[ticket] = _Ticket(key, aead, peer, now + TICKET_TTL_S, serve)
        return {"host": self.announce_host, "port": self.announce_port or self.port, "ticket": ticket, "key": key,
                "aead": aead}

    def bind(self) -> None:
        """Take the port now (before joining a swarm): a taken one is a one-line error at start-up."""

        if self._sock is not None:
            return
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host or "0.0.0.0", self.port))
            sock.listen(128)
        except OSError as exc:
            sock.close()
            raise UserError(f"--direct {self.host}:{self.port}: cannot listen there: {exc.strerror or exc}") from None
        self._sock = sock
        self.port = sock.getsockname()[1]

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Listen until cancelled (``task_status.started((host, port))`` once bound)."""
        self.bind()
        assert self._sock is not None
        listener = trio.SocketListener(trio.socket.from_stdlib_socket(self._sock))
        bound = self._sock.getsockname()
        task_status.started((bound[0], bound[1]))
        try:
            await trio.serve_listeners(self._connection, [listener])
        finally:
            self._sock = None

    async def _connection(self, stream) -> None:
        who = _addr(stream)
        got = await _read_ticket(stream)
        t = self._tickets.pop(got, None) if len(got) == TICKET_BYTES else None
        if t is None or t.expires < time.monotonic():
            self.refused += 1
            log.warning("refused a direct connection from %s: %s", who,
                        "no ticket (closed, or silent for %.0f s)" % HANDSHAKE_TIMEOUT_S if len(got) < TICKET_BYTES
                        else "unknown, used or expired ticket")
            await trio.aclose_forcefully(stream)
            return
        self.redeemed += 1
        log.info("direct lane from %s opened for peer %s (%s)", who, t.peer, t.aead)
        try:
            await t.serve(SealedStream(stream, t.key, initiator=False, max_record=self.max_frame, peer_name=t.peer,
                                       aead=t.aead))
        except Exception as exc:  # one bad connection must not end the listener
            log.warning("direct lane from %s closed: %s", who, clip(exc))
            await trio.aclose_forcefully(stream)


async def _read_ticket(stream) -> bytes:
    """The connection's first TICKET_BYTES bytes; fewer when the peer closes or breaks the
    connection or is silent for HANDSHAKE_TIMEOUT_S (then it is refused like a wrong ticket)."""
    got = b""
    with trio.move_on_after(HANDSHAKE_TIMEOUT_S):
        try:
            while len(got) < TICKET_BYTES and (chunk := await stream.receive_some(TICKET_BYTES - len(got))):
                got += chunk
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return got
    return got


def _addr(stream) -> str:
    try:
        host, port = stream.socket.getpeername()[:2]
        return f"{host}:{port}"
    except Exception:  # only for a log line
        return "peer"


async def open_direct(host: str, port: int, ticket: bytes, key: bytes, *, max_frame: int,
                      timeout_s: float = HANDSHAKE_TIMEOUT_S, aead: str = CHACHA) -> SealedStream:
    """The backbone's side: connect, present the ticket, and seal what follows with ``aead``."""
    with trio.fail_after(timeout_s):
        stream = await trio.open_tcp_stream(host, port)
    try:
        await stream.send_all(ticket)
    except BaseException:
        await trio.aclose_forcefully(stream)
        raise
    return SealedStream(stream, key, initiator=True, max_record=max_frame, aead=aead)


__all__ = ["AES_GCM", "CHACHA", "DirectLane", "SealedStream", "choose_aead", "cpu_has_aes", "local_aeads", "open_direct"]
