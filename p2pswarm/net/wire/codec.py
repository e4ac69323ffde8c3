"""Lossless coding of the expert RPC's bulk arrays: float32 output rows, Q8_K input rows.

Why: with the input rows already in the worker's quantised form, the routed experts' float32
output rows are most of the bytes on the wire (docs/benchmarks.md), and a capped link, not RTT, is
this design's ceiling. Their mantissa bytes are nearly noise, but the sign/exponent byte holds ~2.7
bits of information in 8, and the lowest mantissa byte is not uniform either. Regrouping each
float32's four bytes into four planes and compressing each plane on its own with zstd (level 1)
takes ~17% off them, bit for bit, for ~2 ms of CPU per MiB to code and ~1 ms to decode
(bench/bench_wire_codec.py): it pays on links slower than several hundred Mbit/s, which a phone's
upload and a home line are. A plane that does not get smaller travels raw (the middle mantissa
byte usually). A byte-plane split in one zstd stream saves only ~8%: the planes' statistics differ,
and one stream's entropy tables average them.

Negotiated: a worker's hello lists :data:`OUTPUT_CODING` under ``output_codings`` when it codes
(``P2PSWARM_WIRE_CODEC`` not off); a backbone asks for it per
request (``"coding"``) when its own switch is on too and the worker's link is not measured fast
(:mod:`p2pswarm.net.wire.link_rate`: on loopback or a LAN the coding's CPU buys nothing). An older
peer on either side: plain float32.

Q8_K input rows (ggml's ``block_q8_K``: a float32 scale, 256 int8 quants, 16 int16 ``bsums``)
carry 32 bytes a block that are derivable: each ``bsums[j]`` is the sum of quants 16j..16j+15, as
ggml's quantiser writes them (an exact integer sum). :func:`pack_q8_K` drops them (260 bytes a
block instead of 292) and :func:`unpack_q8_K` recomputes them on the worker, the same bytes
(tests/test_wire_codec.py checks it against libggml's own quantiser). Its wire form's name,
:data:`Q8_K_PACKED`, is listed in a worker's ``input_forms``.
"""
from __future__ import annotations

import numpy as np
import zstandard as _zstd

from p2pswarm import settings
from p2pswarm.errors import FrameError

OUTPUT_CODING = "planes-zstd"
Q8_K_PACKED = "q8_K-packed"
_Q8K_BLOCK = 292  # float d, int8 qs[256], int16 bsums[16]
_Q8K_PACKED_BLOCK = 260


def can_code() -> bool:
    """True when this process codes outputs (``P2PSWARM_WIRE_CODEC`` is not off)."""
    return settings.WIRE_CODEC.get()


def encode_f32(a: np.ndarray) -> dict:
    """A float32 array -> a coded array map (``coding``: :data:`OUTPUT_CODING`)."""
    a = np.ascontiguousarray(a, dtype="<f4")
    planes = a.view(np.uint8).reshape(-1, 4).T  # plane k: byte k of every value
    comp = _zstd.ZstdCompressor(level=1)
    data, coded = [], []
    for k in range(4):
        raw = planes[k].tobytes()
        z = comp.compress(raw)
        coded.append(len(z) < len(raw))
        data.append(z if coded[-1] else raw)
    return {"dtype": "<f4", "shape": list(a.shape), "coding": OUTPUT_CODING, "planes": data, "zstd": coded}


def decode_f32(d: dict, what: str) -> np.ndarray:
    """A coded array map -> float32; anything malformed (or a plane that inflates past its size)
    is a FrameError."""
    shape, data, coded = d.get("shape"), d.get("planes"), d.get("zstd")
    if d.get("coding") != OUTPUT_CODING or d.get("dtype") != "<f4" or not isinstance(shape, list) \
            or not all(isinstance(s, int) and s >= 0 for s in shape) or not isinstance(data, list) \
            or not isinstance(coded, list) or len(data) != 4 or len(coded) != 4 \
            or not all(isinstance(p, bytes) for p in data) or not all(isinstance(c, bool) for c in coded):
        raise FrameError(f"malformed {what}: bad coded array map")
    n = 1
    for s in shape:
        n *= s
    out = np.empty((n, 4), np.uint8)
    dec = _zstd.ZstdDecompressor()
    for k in range(4):
        try:  # max_output_size: a plane may not inflate past n bytes, whatever its frame claims
            raw = dec.decompress(data[k], max_output_size=n) if coded[k] else data[k]
        except _zstd.ZstdError as exc:
            raise FrameError(f"malformed {what}: plane {k}: {exc}") from None
        if len(raw) != n:
            raise FrameError(f"malformed {what}: plane {k} has {len(raw)} bytes, expected {n}")
        out[:, k] = np.frombuffer(raw, np.uint8)
    return out.view("<f4").reshape(shape).astype(np.float32, copy=False)


def pack_q8_K(rows: np.ndarray) -> np.ndarray:
    """(n, blocks x 292) uint8 Q8_K rows -> (n, blocks x 260): each block without its bsums."""
    n, width = rows.shape
    blocks = np.ascontiguousarray(rows).reshape(n, width // _Q8K_BLOCK, _Q8K_BLOCK)
    return blocks[:, :, :_Q8K_PACKED_BLOCK].reshape(n, -1)


def unpack_q8_K(packed: np.ndarray) -> np.ndarray:
    """(n, blocks x 260) -> (n, blocks x 292): the bsums recomputed (sums of 16 quants, int16)."""
    n, width = packed.shape
    b = width // _Q8K_PACKED_BLOCK
    blocks = packed.reshape(n, b, _Q8K_PACKED_BLOCK)
    out = np.empty((n, b, _Q8K_BLOCK), np.uint8)
    out[:, :, :_Q8K_PACKED_BLOCK] = blocks
    qs = blocks[:, :, 4:].view(np.int8).reshape(n, b, 16, 16)
    sums = qs.sum(axis=3, dtype=np.int32).astype("<i2")  # |sum| <= 16 x 128: fits int16
    out[:, :, _Q8K_PACKED_BLOCK:] = sums.view(np.uint8).reshape(n, b, 32)
    return out.reshape(n, b * _Q8K_BLOCK)
