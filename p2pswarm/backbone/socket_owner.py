"""A worker process reached over a local TCP socket: framed msgpack, handshake, timeouts.

One persistent connection per worker, (re)opened lazily; requests on it are serialised by a lock
and matched to replies by id. Every failure (refused handshake, dead process, closed connection,
timeout, error reply, malformed reply) becomes a :class:`WorkerError`, which the dispatcher turns
into a fallback to the local replica.
"""
from __future__ import annotations

import itertools
import logging

import numpy as np
import trio

from p2pswarm.backbone.dispatch import Groups, Owner, pack_rows
from p2pswarm.errors import FrameError, WorkerError, clip
from p2pswarm.net import expert_protocol as proto
from p2pswarm.net.framing import DEFAULT_MAX_FRAME, FrameReader, send_frame

log = logging.getLogger("p2pswarm.backbone")


class SocketOwner(Owner):
    def __init__(self, name: str, host: str, port: int, *, model_fingerprint: str, kernel: str,
                 layers: tuple[int, int], experts: tuple[int, int], timeout_s: float = 30.0,
                 max_frame: int = DEFAULT_MAX_FRAME):
        self.name = name
        self.host, self.port = host, port
        self.model_fingerprint = model_fingerprint
        self.kernel = kernel
        self.layers = layers
        self.experts = experts
        self.timeout_s = timeout_s
        self.max_frame = max_frame
        self._stream = None
        self._reader: FrameReader | None = None
        self._lock = trio.Lock()
        self._ids = itertools.count(1)

    def holds(self, layer: int, expert: int) -> bool:
        return self.layers[0] <= layer < self.layers[1] and self.experts[0] <= expert < self.experts[1]

    async def _connect(self) -> None:
        stream = await trio.open_tcp_stream(self.host, self.port)
        reader = FrameReader(stream, self.max_frame)
        hello = {"op": "hello", "protocol": proto.PROTOCOL_VERSION, "model": self.model_fingerprint,
                 "kernel": self.kernel}
        await send_frame(stream, proto.pack(hello), self.max_frame)
        payload = await reader.read_frame()
        if payload is None:
            raise WorkerError(f"{self.name} closed the connection during the handshake")
        reply = proto.unpack(payload)
        if reply.get("op") == "error" or not reply.get("ok"):
            await trio.aclose_forcefully(stream)
            raise WorkerError(f"{self.name} refused the handshake: {reply.get('error', 'no reason given')}")
        # The worker says what it holds; trust only the intersection with what we were told.
        if reply.get("model") != self.model_fingerprint:
            await trio.aclose_forcefully(stream)
            raise WorkerError(f"{self.name} serves another model ({clip(reply.get('model'), 80)}), not {self.model_fingerprint}")
        self._stream, self._reader = stream, reader

    async def _drop(self) -> None:
        if self._stream is not None:
            await trio.aclose_forcefully(self._stream)
        self._stream, self._reader = None, None

    async def request(self, msg_bytes: bytes, rid: int) -> dict:
        """Send one framed request and wait for its reply (connecting first if needed)."""
        async with self._lock:
            try:
                with trio.fail_after(self.timeout_s):
                    if self._stream is None:
                        await self._connect()
                    await send_frame(self._stream, msg_bytes, self.max_frame)
                    payload = await self._reader.read_frame()
                if payload is None:
                    raise WorkerError(f"{self.name} closed the connection")
                reply = proto.unpack(payload)
                if reply["op"] == "error" and reply.get("id") in (rid, None):  # None: about the connection
                    raise WorkerError(f"{self.name} refused: {reply.get('error')}")
                if reply.get("id") != rid:
                    raise WorkerError(f"{self.name} answered request {reply.get('id')} to our {rid}")
                return reply
            except trio.TooSlowError:
                await self._drop()
                raise WorkerError(f"{self.name} timed out after {self.timeout_s:.0f} s") from None
            except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                await self._drop()
                raise WorkerError(f"{self.name} unreachable: {exc or type(exc).__name__}") from None
            except (FrameError, WorkerError):
                await self._drop()
                raise

    async def compute(self, layer: int, cur: np.ndarray, groups: Groups) -> list[np.ndarray]:
        rows, local_groups = pack_rows(cur, groups)
        rid = next(self._ids)
        req = proto.ComputeRequest(rid, layer, rows, local_groups)
        try:
            reply = await self.request(req.to_wire(), rid)
            out = proto.array_from_wire(reply.get("out"), "result")
        except FrameError as exc:
            raise WorkerError(f"{self.name}: {exc}") from None
        counts = [len(idx) for _, idx in groups]
        if out.ndim != 2 or out.shape != (sum(counts), cur.shape[1]) or out.dtype != np.float32:
            raise WorkerError(f"{self.name} returned an array of shape {out.shape}, expected ({sum(counts)}, {cur.shape[1]})")
        return np.split(out, np.cumsum(counts)[:-1]) if counts else []

    async def echo(self, payload: bytes) -> bytes:
        rid = next(self._ids)
        try:
            reply = await self.request(proto.pack({"op": "echo", "id": rid, "payload": payload}), rid)
        except FrameError as exc:
            raise WorkerError(f"{self.name}: {exc}") from None
        return reply.get("payload")

    async def aclose(self) -> None:
        await self._drop()
