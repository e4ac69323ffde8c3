"""``--wire-precision f16|bf16``: expert outputs rounded to 16 bits, on the wire and everywhere else.

Why: the routed experts' float32 output rows are most of the bytes of the expert RPC (8 rows of
n_embd x 4 bytes per token and layer), and no lossless coding halves them
(bench/bench_wire_codec.py). Rounding them to 16 bits halves them, but would make a split run
differ from a monolithic one. So the rounding is a property of the *backbone*, not of the wire:
with a precision set, every expert output the backbone combines is rounded the same way, whoever
computed it - a worker (which sends the 16-bit values), the backbone's own replica (monolithic,
fallback, verification) - and split == monolithic stays bit for bit. What it costs is a distance
to llama.cpp's logits, measured in docs/benchmarks.md. Off by default.

Rounding: f16 by numpy's float32 -> float16 cast (round to nearest even), after clipping to
+-65504 (the largest f16: a value beyond it saturates instead of becoming inf); bf16 by round to
nearest even on the top 16 bits of the float32 (NaN stays NaN). Both are exact integer/IEEE
operations, the same bits on every machine.
"""
from __future__ import annotations

import numpy as np

from p2pswarm.errors import FrameError

PRECISIONS = ("f16", "bf16")
F16_MAX = 65504.0


def _bf16_bits(a: np.ndarray) -> np.ndarray:
    u = np.ascontiguousarray(a, np.float32).view(np.uint32)
    rounded = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(a)
    if nan.any():
        rounded[nan] = ((u[nan] >> np.uint32(16)) | np.uint32(0x40)).astype(np.uint16)  # a quiet NaN
    return rounded


def encode(a: np.ndarray, precision: str) -> np.ndarray:
    """float32 -> the 16-bit values sent (float16, or bf16 as uint16 bits)."""
    if precision == "f16":
        return np.clip(a, -F16_MAX, F16_MAX).astype(np.float16)
    return _bf16_bits(a)


def decode(a: np.ndarray, precision: str) -> np.ndarray:
    """The 16-bit values -> float32 (exact: every 16-bit value is a float32)."""
    if precision == "f16":
        return a.astype(np.float32)
    return (a.astype(np.uint32) << np.uint32(16)).view(np.float32)


def round_to(a: np.ndarray, precision: str | None) -> np.ndarray:
    """``a`` as float32 holding the values a worker at ``precision`` would send (None: ``a``)."""
    return a if precision is None else decode(encode(a, precision), precision)


def to_wire(a: np.ndarray, precision: str) -> dict:
    e = np.ascontiguousarray(encode(a, precision))
    return {"dtype": precision, "shape": list(a.shape), "data": e.tobytes()}


def from_wire(d: dict, what: str) -> np.ndarray:
    """A ``{dtype: "f16"|"bf16", shape, data}`` array map -> float32."""
    precision, shape, data = d.get("dtype"), d.get("shape"), d.get("data")
    if precision not in PRECISIONS or not isinstance(shape, list) or not isinstance(data, bytes) \
            or not all(isinstance(s, int) and s >= 0 for s in shape):
        raise FrameError(f"malformed {what}: bad dtype/shape/data")
    n = 1
    for s in shape:
        n *= s
    if 2 * n != len(data):
        raise FrameError(f"malformed {what}: {len(data)} bytes do not make shape {shape} of {precision}")
    raw = np.frombuffer(data, dtype=np.float16 if precision == "f16" else np.uint16).reshape(shape)
    return decode(raw, precision)
