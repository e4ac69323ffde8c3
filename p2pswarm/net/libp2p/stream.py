"""A libp2p stream seen as a trio byte stream (:class:`StreamAdapter`).

py-libp2p 0.8.1's ``stream.read(n)`` returns at most one yamux frame (65,524 bytes) whatever ``n``
is and raises ``StreamEOF`` instead of returning ``b""``; and yamux resets a writer whose reader has
not read for 5 s with its receive window full. The adapter gives :mod:`p2pswarm.net.wire.framing` the
``receive_some``/``send_all`` interface it expects and reads ahead in a bounded background task, so
a busy consumer never makes its peer's write fail (catalogued in :mod:`p2pswarm.net.libp2p.patches`)."""
from __future__ import annotations

import trio
from libp2p.network.stream.exceptions import StreamEOF, StreamError
from libp2p.peer.id import ID

DEFAULT_READ_AHEAD = 24 << 20  # > the 8-16 MB yamux window, so a stalled consumer never stalls the peer
YAMUX_MAX_READ = 65524  # what one read() returns at most (one yamux frame payload)


def _map_stream_error(exc: BaseException, what: str) -> trio.BrokenResourceError:
    return trio.BrokenResourceError(f"{what}: {type(exc).__name__}{': ' + str(exc) if str(exc) else ''}")


class StreamAdapter:
    """A libp2p stream seen as a trio byte stream: ``receive_some``, ``send_all``, ``send_eof``,
    ``aclose``. Errors become :class:`trio.BrokenResourceError` (peer reset, connection lost) or
    :class:`trio.ClosedResourceError` (we closed it), the same as a TCP socket's, so the framing and
    the expert-protocol handlers treat both transports alike.

    With :meth:`start_reading` a background task reads ahead into a buffer of at most
    ``read_ahead`` bytes (see the module doc for why)."""

    supports_at_least = True  # receive_some(..., at_least=n): see there

    @property
    def cancel_safe_reads(self) -> bool:
        """Whether a cancelled :meth:`receive_some` loses no bytes (so a late reply can still be
        read): with read-ahead, yes (bytes wait in our buffer); py-libp2p's own read, unknown."""
        return self._pumping

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
        assert self._pump_scope is not None, "start_reading makes the scope first"
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

    async def receive_some(self, max_bytes: int | None = None, *, at_least: int = 1) -> bytes:
        """Up to ``max_bytes`` bytes; ``b""`` at EOF. With read-ahead running, wait until
        ``at_least`` bytes are buffered (or EOF): a reader that knows how much it needs (the rest
        of a frame, :class:`~p2pswarm.net.wire.framing.FrameReader`) is woken once for a frame that
        arrives in several yamux frames, not once per yamux frame."""
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
        want = max(1, min(at_least, n, self.read_ahead))
        while len(self._buf) < want:
            if self._eof:
                if self._error is not None and not self._buf:
                    raise self._error
                if not self._buf:
                    return b""
                break
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

