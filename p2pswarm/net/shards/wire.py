"""The wire of ``/p2pswarm/shard/1.0.0`` shared by its server and client: the protocol id,
limits, msgpack packing and the field checks. Split from ``transfer.py``; the
protocol is described there and in docs/protocol.md."""
from __future__ import annotations

from collections.abc import Callable

import msgpack
import trio

from p2pswarm.errors import FrameError, UserError

PROTOCOL_SHARD = "/p2pswarm/shard/1.0.0"
SHARD_PROTOCOL_VERSION = 1
CHUNK_MAX = 4 << 20  # bytes of tensor data per chunk frame
SOURCE_KEY_PREFIX = "/p2pswarm/source/"
STREAMS_PER_SOURCE = 4  # requests in flight per source (one per stream: the protocol is request/response)
MAX_ATTEMPTS = 4  # per slab: a slab that fails verification this often aborts the download
JOURNAL_EVERY_S = 0.5  # how often finished slabs are made durable and journaled
REQUEST_TIMEOUT_S = 60.0
MAX_CONTROL_FRAME = 64 << 10

Progress = Callable[[int, int], None]


class ShardTransferError(UserError):
    """A download that cannot proceed (no source would serve, a slab that never verifies, ...)."""



# ---- wire helpers --------------------------------------------------------------------------------
def _pack(msg: dict) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def _unpack(data: bytes | None, what: str) -> dict:
    if data is None:
        raise trio.BrokenResourceError(f"{what}: stream closed")
    try:
        msg = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception:  # any decoding failure of peer input means "not msgpack"
        raise FrameError(f"{what}: not msgpack") from None
    if not isinstance(msg, dict):
        raise FrameError(f"{what}: not a map")
    return msg


def _range_of(x: object, what: str, limit: int) -> tuple[int, int]:
    if (not isinstance(x, list) or len(x) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in x)
            or not 0 <= x[0] < x[1] <= limit):
        raise ValueError(f"bad {what} range {str(x)[:40]} (need [begin, end) within 0..{limit})")
    return x[0], x[1]


