"""Messages of the expert RPC, one msgpack map per frame (see docs/protocol.md).

Shared by every transport (local sockets, libp2p streams, a direct lane). Arrays travel as raw
little-endian bytes with their dtype and shape beside them; a row that several experts of one owner
need is sent once (``rows`` holds the distinct rows, ``index`` says which rows each expert takes).
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import msgpack
import numpy as np

from p2pswarm import settings
from p2pswarm.engine.ggml.inputs import INPUT_FORMS
from p2pswarm.errors import FrameError, clip
from p2pswarm.net.wire import codec as wire_codec, precision as wire_precision

PROTOCOL_VERSION = 1
#: The libp2p protocol id of these messages (docs/protocol.md); plain strings, so the socket
#: transport needs no libp2p.
PROTOCOL_EXPERT = "/p2pswarm/expert/1.0.0"
ALLOWED_DTYPES = {"<f4": np.float32, "<i4": np.int32}
# Input rows may also travel in one of ggml's quantised forms (:data:`INPUT_FORMS`, defined with
# the kernel that makes them): a worker's hello lists those it takes ("input_forms"; an older worker
# none: it gets float32); a request's rows map then has that name as its "dtype", the shape in
# values (n, n_embd) and n * row bytes of data.
#: Wire-only forms of an input form (p2pswarm.net.wire.codec): name -> (the form it stands for, bytes
#: per block on the wire, pack, unpack). A worker lists such a name in its hello's "input_forms" when it
#: takes that form; the rows arrive as the full form after unpacking, the same bytes.
PACKED_FORMS = {wire_codec.Q8_K_PACKED: ("q8_K", 260, wire_codec.pack_q8_K, wire_codec.unpack_q8_K)}
#: input form -> its packed wire form
PACKED_OF = {form: name for name, (form, *_) in PACKED_FORMS.items()}
#: The longest kernel id a node record, a hello or a compute request's family may carry. A ggml id
#: names the library and every SIMD code path its CPU build selects ("ggml-0.25.3-0c1e570/x86_64+
#: sse3+...+amx_int8+llamafile"): 131 characters on a CPU with AVX-512 and AMX, 212 were every
#: feature ggml 0.25 reports set at once. The old limit, 128, refused the records of every worker
#: on such a CPU: a swarm of them found no owner at all.
MAX_KERNEL_ID_CHARS = 512
MAX_FAMILY_CHARS = MAX_KERNEL_ID_CHARS  # a family is a kernel id (or its portable-<version> prefix)


def hello_input_forms(forms: list[str]) -> list[str]:
    """What a worker's hello lists as "input_forms": its kernel's forms, and their packed wire
    forms unless ``P2PSWARM_WIRE_CODEC`` is off."""
    packed = [PACKED_OF[f] for f in forms if f in PACKED_OF] if settings.WIRE_CODEC.get() else []
    return list(forms) + packed


def wants_packed(form: str | None, worker_forms) -> bool:
    """Whether a backbone sends rows of ``form`` packed to a worker whose hello listed ``worker_forms``."""
    return form in PACKED_OF and PACKED_OF[form] in worker_forms and settings.WIRE_CODEC.get()


def reply_output_coding(reply: dict) -> str | None:
    """The output coding a backbone asks a worker for, from the worker's hello reply: None when
    either side cannot code (an older worker lists none) or ``P2PSWARM_WIRE_CODEC`` is off here."""
    codings = reply.get("output_codings")
    ok = isinstance(codings, list) and wire_codec.OUTPUT_CODING in codings and wire_codec.can_code()
    return wire_codec.OUTPUT_CODING if ok else None


def pack(msg: dict) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def unpack(payload: bytes) -> dict:
    """Decode one message; anything but a msgpack map with a string "op" is a FrameError."""
    try:
        msg = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise FrameError(f"malformed message: {type(exc).__name__}: {clip(exc, 200)}") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("op"), str):
        raise FrameError("malformed message: expected a map with an 'op' string")
    return msg


#: native dtypes that are already what the wire carries: their bytes go as they are (no dtype
#: conversion per array: ~2% of a 0.3-core backbone's samples went to that with 4 workers)
_AS_IS = {np.dtype(t): t for t in ALLOWED_DTYPES} if sys.byteorder == "little" else {}


def array_to_wire(a: np.ndarray) -> dict:
    a = np.ascontiguousarray(a)
    same = _AS_IS.get(a.dtype)
    if same is not None:
        return {"dtype": same, "shape": list(a.shape), "data": a.tobytes()}
    dtype = a.dtype.newbyteorder("<").str
    if dtype not in ALLOWED_DTYPES:
        raise FrameError(f"cannot send arrays of dtype {dtype}")
    return {"dtype": dtype, "shape": list(a.shape), "data": a.astype(dtype, copy=False).tobytes()}


def array_from_wire(d: object, what: str) -> np.ndarray:
    if not isinstance(d, dict):
        raise FrameError(f"malformed {what}: expected an array map")
    dtype, shape, data = d.get("dtype"), d.get("shape"), d.get("data")
    if not isinstance(dtype, str) or dtype not in ALLOWED_DTYPES or not isinstance(shape, list) \
            or not isinstance(data, bytes):
        raise FrameError(f"malformed {what}: bad dtype/shape/data")
    if not all(isinstance(s, int) and s >= 0 for s in shape):
        raise FrameError(f"malformed {what}: bad shape {shape}")
    np_dtype = np.dtype(ALLOWED_DTYPES[dtype])
    if math.prod(shape) * np_dtype.itemsize != len(data):  # (exact: Python ints; np.prod costs ~5 us a call)
        raise FrameError(f"malformed {what}: {len(data)} bytes do not make shape {shape} of {dtype}")
    # Copy: an owned, aligned array, so the math sees the same memory layout in every process.
    return np.frombuffer(data, dtype=np_dtype).reshape(shape).copy()


def rows_to_wire(rows: np.ndarray, form: str | None, packed: bool = False) -> dict:
    """Input rows: float32 (``form`` None), or (n, row bytes) uint8 already in ``form``; ``packed``:
    in that form's :data:`PACKED_FORMS` wire form where it has one."""
    if form is None:
        return array_to_wire(rows)
    _, block, block_bytes = INPUT_FORMS[form]
    name = PACKED_OF.get(form) if packed else None
    data = np.ascontiguousarray(rows) if name is None else PACKED_FORMS[name][2](rows)
    return {"dtype": name or form, "shape": [rows.shape[0], rows.shape[1] // block_bytes * block],
            "data": data.tobytes()}


def rows_from_wire(d: object) -> tuple[np.ndarray, str | None]:
    """(rows, form): float32 (n, n_embd) and None, or (n, row bytes) uint8 and the form's name
    (a packed wire form unpacked into its form)."""
    name = d.get("dtype") if isinstance(d, dict) else None
    if not isinstance(d, dict) or not isinstance(name, str) or (name not in INPUT_FORMS and name not in PACKED_FORMS):
        return array_from_wire(d, "rows"), None  # (a fuzzed dtype may be any msgpack value)
    form, unpack_rows = name, None
    if name in PACKED_FORMS:
        form, _, _, unpack_rows = PACKED_FORMS[name]
    _, block, block_bytes = INPUT_FORMS[form]
    wire_bytes = PACKED_FORMS[name][1] if unpack_rows else block_bytes
    shape, data = d.get("shape"), d.get("data")
    if not (isinstance(shape, list) and len(shape) == 2 and all(isinstance(s, int) and s >= 0 for s in shape)
            and isinstance(data, bytes)) or shape[1] % block:
        raise FrameError(f"malformed rows: bad shape/data for form {name}")
    row_bytes = shape[1] // block * wire_bytes
    if shape[0] * row_bytes != len(data):
        raise FrameError(f"malformed rows: {len(data)} bytes do not make {shape[0]} rows of {shape[1]} in {name}")
    rows = np.frombuffer(data, dtype=np.uint8).reshape(shape[0], row_bytes)
    return (rows.copy() if unpack_rows is None else unpack_rows(rows)), form


@dataclass
class ComputeRequest:
    """All the rows one owner must compute for one layer."""

    id: int
    layer: int
    rows: np.ndarray  # (n_distinct_rows, n_embd) float32
    groups: list[tuple[int, np.ndarray]]  # (global expert id, int32 indices into rows)
    #: The kernel family to answer in (one of the worker's hello "families", e.g. "portable-1");
    #: None: the connection's (the hello's "family", else the worker's own kernel).
    family: str | None = None
    #: None: ``rows`` are float32; else an :data:`INPUT_FORMS` name and ``rows`` (n, row bytes)
    #: uint8 in that form (the worker's layer must take exactly that form)
    form: str | None = None
    #: None: outputs as float32; "f16"/"bf16": rounded to that and sent in 16 bits
    #: (p2pswarm.net.wire.precision; an older worker ignores it and sends float32)
    out: str | None = None
    #: send ``rows`` in the form's packed wire form (the worker's hello listed it)
    packed: bool = False
    #: None: float32 outputs plain; :data:`wire_codec.OUTPUT_CODING`: coded losslessly, if the
    #: worker can (it may answer plain)
    coding: str | None = None

    def to_wire(self) -> bytes:
        counts = [int(len(idx)) for _, idx in self.groups]
        index = np.concatenate([idx for _, idx in self.groups]).astype(np.int32) if self.groups else np.zeros(0, np.int32)
        msg = {
            "op": "compute", "id": self.id, "layer": self.layer,
            "experts": [int(e) for e, _ in self.groups], "counts": counts,
            "index": array_to_wire(index), "rows": rows_to_wire(self.rows, self.form, self.packed),
        }
        if self.family is not None:
            msg["family"] = self.family
        if self.out is not None:
            msg["out"] = self.out
        if self.coding is not None:
            msg["coding"] = self.coding
        return pack(msg)

    @classmethod
    def from_msg(cls, msg: dict) -> "ComputeRequest":
        rid, layer, experts, counts = msg.get("id"), msg.get("layer"), msg.get("experts"), msg.get("counts")
        if not isinstance(rid, int) or not isinstance(layer, int):
            raise FrameError("malformed compute request: id and layer must be integers")
        if not isinstance(experts, list) or not isinstance(counts, list) or len(experts) != len(counts):
            raise FrameError("malformed compute request: experts and counts must be lists of one length")
        if not all(isinstance(x, int) and x >= 0 for x in experts + counts):
            raise FrameError("malformed compute request: experts and counts must be non-negative integers")
        rows, form = rows_from_wire(msg.get("rows"))
        index = array_from_wire(msg.get("index"), "index")
        if rows.ndim != 2 or (form is None and rows.dtype != np.float32) or index.ndim != 1 \
                or index.dtype != np.int32:
            raise FrameError("malformed compute request: rows must be 2-D float32 (or an input form), index 1-D int32")
        if sum(counts) != len(index):
            raise FrameError("malformed compute request: counts do not add up to the index length")
        if len(index) and (index.min() < 0 or index.max() >= len(rows)):
            raise FrameError("malformed compute request: index points outside the rows")
        family = msg.get("family")
        if family is not None and not (isinstance(family, str) and 0 < len(family) <= MAX_FAMILY_CHARS):
            raise FrameError(f"malformed compute request: family must be a string of 1-{MAX_FAMILY_CHARS} characters")
        out = msg.get("out")
        if out is not None and out not in wire_precision.PRECISIONS:
            raise FrameError(f"malformed compute request: out must be one of {', '.join(wire_precision.PRECISIONS)}")
        coding = msg.get("coding")
        if coding is not None and not (isinstance(coding, str) and len(coding) <= 64):
            raise FrameError("malformed compute request: coding must be a short string")
        groups, pos = [], 0
        for e, c in zip(experts, counts):
            groups.append((e, index[pos : pos + c]))
            pos += c
        return cls(rid, layer, rows, groups, family, form, out, coding=coding)


def result_to_wire(rid: int, outputs: list[np.ndarray], n_embd: int, precision: str | None = None,
                   coding: str | None = None) -> bytes:
    """A result frame: float32 outputs plain, coded (``coding`` is :data:`wire_codec.OUTPUT_CODING`
    and this node can code), or in 16 bits (``precision``; then uncoded)."""
    out = np.concatenate(outputs, axis=0) if outputs else np.zeros((0, n_embd), np.float32)
    out = out.astype(np.float32, copy=False)
    if precision is not None:
        arr = wire_precision.to_wire(out, precision)
    elif coding == wire_codec.OUTPUT_CODING and wire_codec.can_code():
        arr = wire_codec.encode_f32(out)
    else:
        arr = array_to_wire(out)
    return pack({"op": "result", "id": rid, "out": arr})


def result_coded(d: object) -> bool:
    """True when a result's ``out`` is losslessly coded (decoding it is worth a thread)."""
    return isinstance(d, dict) and "coding" in d


def result_from_wire(d: object) -> np.ndarray:
    """A result's ``out``: float32, coded float32, or 16-bit values (``--wire-precision``) widened
    to float32."""
    if isinstance(d, dict) and "coding" in d:
        return wire_codec.decode_f32(d, "result")
    if isinstance(d, dict) and d.get("dtype") in wire_precision.PRECISIONS:
        return wire_precision.from_wire(d, "result")
    return array_from_wire(d, "result")


def error_to_wire(rid: int | None, error: str) -> bytes:
    return pack({"op": "error", "id": rid, "error": error})
