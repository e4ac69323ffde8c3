"""py-libp2p 0.8.1 workarounds on a connection's byte path, process-wide: yamux frame writes
shielded from cancellation, window updates batched, a stream write's frames coalesced into full
Noise messages, TCP reads buffered; and no identify observed address on a relayed connection.

Each replaces a private method of the library's classes for the whole process (idempotent), is
applied by :func:`p2pswarm.net.libp2p.patches.apply`, and has its trap, reason and regression test
in the table there; the private names each relies on are in that module's checked list.
"""
from __future__ import annotations

import logging
import struct
from typing import cast

import trio

from p2pswarm.net.libp2p.addrs import is_circuit_addr

log = logging.getLogger("p2pswarm.net")

WRITE_STALL_S = 30.0  # a shielded frame write that takes longer than this: the connection is dead


def _install(owner: object, **attrs: object) -> None:
    """Set ``attrs`` on a library class or function: the one place a patch writes into
    py-libp2p's objects (names a type checker cannot follow, on purpose)."""
    for name, value in attrs.items():
        setattr(owner, name, value)


def install_write_shield() -> None:
    """Make every yamux frame write atomic with respect to cancellation (process-wide, idempotent).

    A yamux frame goes out as one Noise message: encrypt (which advances the nonce), then send. A
    task cancelled between the two - a timeout, or a look-up cancelling its now useless queries -
    leaves the nonce advanced and the message unsent; the peer fails to decrypt every later message
    ("Failed authentication of message") and the connection, with every stream on it, dies. We
    shield the write; a write stuck for WRITE_STALL_S closes the connection instead of hanging."""
    from libp2p.stream_muxer.yamux.yamux import Yamux

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

    _install(Yamux, _write_frame=_write_frame, _p2pswarm_shielded=True)


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
    from libp2p.stream_muxer.yamux.yamux import YamuxStream

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

    _install(YamuxStream, _p2pswarm_library_credit=YamuxStream._auto_tune_and_send_window_update,  # for the test
             _auto_tune_and_send_window_update=_auto_tune_and_send_window_update, _p2pswarm_batched_credit=True)


def install_relayed_identify_fix() -> None:
    """Send no identify observed address on a relayed connection (process-wide, idempotent).

    py-libp2p 0.8.1 reports, as the observed address of a peer reached through a relay, the circuit
    address its STOP side made up: ``/p2p/<OUR OWN id>/p2p-circuit/p2p/<peer>`` -- our id where the
    relay's belongs, and no transport part. js-libp2p rejects that address and with it the whole
    identify message, so a js peer never learns a relayed worker's protocols. go-libp2p and
    js-libp2p do not report observed addresses on relayed connections either; we send none there.
    Direct connections keep reporting the socket's remote address."""
    from libp2p.identity.identify import identify as ident

    if getattr(ident._prefer_circuit_addr, "_p2pswarm", False):
        return
    library = ident._prefer_circuit_addr

    def observed_addr(host, peer_id, fallback):
        addr = library(host, peer_id, fallback)
        return None if addr is not None and is_circuit_addr(addr) else addr

    _install(observed_addr, _p2pswarm=True, library=library)  # library: for the regression test's control
    _install(ident, _prefer_circuit_addr=observed_addr)


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
    from libp2p.io.trio import TrioTCPStream

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

    _install(TrioTCPStream, _p2pswarm_library_read=library,  # for the regression test's control
             read=read, _p2pswarm_buffered=True)


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
    from libp2p.security.noise.io import MAX_PLAINTEXT_LENGTH, BaseNoiseMsgReadWriter
    from libp2p.stream_muxer.exceptions import MuxedStreamError
    from libp2p.stream_muxer.yamux import yamux as ymod

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
                            parts: list[bytes | memoryview] = []
                            pos, end = sent, sent + n
                            while pos < end:
                                k = min(frame_payload, end - pos)
                                parts.append(header.pack(0, ymod.TYPE_DATA, 0, self.stream_id, k))
                                parts.append(view[pos : pos + k])
                                pos += k
                            out = cast(bytes, parts[0]) + parts[1] if len(parts) == 2 else b"".join(parts)
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

    _install(ymod.YamuxStream, _p2pswarm_library_write=ymod.YamuxStream.write,  # for the regression test's control
             write=write, _p2pswarm_coalesced=True)
    _install(BaseNoiseMsgReadWriter, _p2pswarm_library_write_msg=library_noise_write, write_msg=write_msg)
