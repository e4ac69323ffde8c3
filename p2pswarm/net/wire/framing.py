"""Length-prefixed frames over any trio byte stream (TCP socket, libp2p stream, relay bridge).

A frame is an 8-byte big-endian unsigned length followed by that many bytes. The length is 64-bit
clean end to end: Python ints and ``struct`` "!Q" never truncate, which rules out the seed's bug
(a 32-bit shift that silently corrupted every frame >= 64 KiB). Each side enforces a maximum frame
size and refuses a larger one *before* reading or allocating its body.

Transports may hand back fewer bytes than asked (libp2p's ``read(n)`` returns <= 65,524), so the
reader accumulates until a frame is whole.
"""
from __future__ import annotations

import struct

from p2pswarm.errors import FrameError

HEADER = struct.Struct("!Q")
DEFAULT_MAX_FRAME = 128 << 20  # 128 MiB
ONE_WRITE_MAX = 1 << 20  # frames up to this size go out as one write (header + payload)


class FrameReader:
    """Reads whole frames from a stream exposing ``receive_some(max_bytes)`` (trio style)."""

    def __init__(self, stream, max_frame: int = DEFAULT_MAX_FRAME, admit=None, rate=None):
        self.stream = stream
        #: a :class:`~p2pswarm.net.wire.link_rate.LinkRate` timing how each frame's bytes arrive
        #: (a backbone's reply reader on a plain socket), or None
        self.rate = rate
        self.max_frame = max_frame
        # admit(n): called with a frame's length before its body is read; may raise FrameError
        # (a worker's per-peer budget of bytes in flight: p2pswarm.worker.peer_limits)
        self.admit = admit
        self._buf = bytearray()
        # a libp2p StreamAdapter can wait for a whole frame; a trio socket stream cannot
        self._at_least = getattr(stream, "supports_at_least", False)
        # a direct lane hands out whole decrypted records, and a frame of up to ONE_WRITE_MAX is
        # one record (send_frame: one write): read a record at a time (read_frame's fast path)
        self._whole = getattr(stream, "whole_records", False)

    async def _fill(self, n: int) -> bool:
        """Make at least n bytes buffered; False on EOF before any byte of a new frame."""
        while len(self._buf) < n:
            need = n - len(self._buf)
            ask = max(65536, min(need, 1 << 20))
            if self._at_least:  # one wake-up for the rest of the frame (up to a MiB), not one per chunk
                chunk = await self.stream.receive_some(ask, at_least=min(need, ask))
            elif self._whole:  # a record's plaintext at once: no copy of its tail kept back
                chunk = await self.stream.receive_some()
            else:
                chunk = await self.stream.receive_some(ask)
            if not chunk:
                if not self._buf:
                    return False
                raise FrameError(f"connection closed mid-frame ({len(self._buf)} of {n} bytes)")
            self._buf += chunk
            if self.rate is not None:
                self.rate.read(len(chunk))
        return True

    async def read_frame(self) -> bytes | None:
        """The next frame's payload, or None at a clean end of stream."""
        if self.rate is not None:
            self.rate.begin(bool(self._buf))
        if self._whole and not self._buf:
            # One record that is one whole frame (the usual case on a direct lane): its payload is
            # one copy of it. Through the buffer it was three (append, slice, bytes) plus a copy of
            # the record's tail after a 64 KiB header read, each of ~0.8 MB a reply, fresh pages.
            chunk = await self.stream.receive_some()
            if not chunk:
                return None
            if self.rate is not None:
                self.rate.read(len(chunk))
            if len(chunk) >= HEADER.size:
                (n,) = HEADER.unpack_from(chunk, 0)
                if n <= self.max_frame and len(chunk) == HEADER.size + n:
                    if self.admit is not None:
                        self.admit(n)
                    if self.rate is not None:
                        self.rate.message_done()
                    return chunk[HEADER.size:]
            self._buf += chunk  # (part of a frame, or more than one: the buffered way)
        if not await self._fill(HEADER.size):
            return None
        (n,) = HEADER.unpack_from(self._buf, 0)
        if n > self.max_frame:
            raise FrameError(f"frame of {n} bytes exceeds the maximum of {self.max_frame}")
        if self.admit is not None:
            self.admit(n)
        if self._whole and len(self._buf) == HEADER.size and n:
            # A frame over ONE_WRITE_MAX (a reply of more than ~85 pairs at the 122B's width) is
            # two records, header then payload: the payload's record is the payload, no copy.
            # (Cancelled while waiting: the header stays buffered, the read resumes as before.)
            chunk = await self.stream.receive_some()
            if not chunk:
                raise FrameError("connection closed mid-frame")
            if self.rate is not None:
                self.rate.read(len(chunk))
            if len(chunk) == n:
                del self._buf[:]
                if self.rate is not None:
                    self.rate.message_done()
                return chunk
            self._buf += chunk
        if not await self._fill(HEADER.size + n):
            raise FrameError("connection closed mid-frame")
        with memoryview(self._buf) as buf:  # one copy (a bytearray slice, then bytes(): two)
            payload = bytes(buf[HEADER.size : HEADER.size + n])
        del self._buf[: HEADER.size + n]
        if self.rate is not None:
            self.rate.message_done()
        return payload


async def send_frame(stream, payload: bytes, max_frame: int = DEFAULT_MAX_FRAME) -> None:
    """Send one frame on a stream exposing ``send_all(bytes)``; refuse oversize payloads locally."""
    n = len(payload)
    if n > max_frame:
        raise FrameError(f"refusing to send a frame of {n} bytes: the maximum is {max_frame}")
    if n <= ONE_WRITE_MAX:
        # One write per frame: over libp2p each send_all is a yamux frame and a Noise message of
        # its own (Python work in both peers, a wake-up for the reader); copying the payload behind
        # the 8-byte header costs less than that below a MiB.
        await stream.send_all(HEADER.pack(n) + payload)
    else:  # a shard slice: no extra copy of many MiB
        await stream.send_all(HEADER.pack(n))
        await stream.send_all(payload)
