"""A small streaming GGUF writer for byte-range copies.

`gguf.GGUFWriter` wants whole numpy tensors and re-packs metadata from Python values. The slicer
wants neither: it copies metadata fields byte for byte from the source file, streams tensor data in
chunks, and fills in the per-tensor sha256 once the bytes have gone by. So it writes the container
itself (the format is small: header, key/values, tensor infos, aligned data) and reserves
fixed-width slots for the hashes, patched in place at the end.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

from gguf import GGUF_MAGIC, GGMLQuantizationType, GGUFValueType

GGUF_VERSION = 3
DEFAULT_ALIGNMENT = 32


def _str(s: str | bytes) -> bytes:
    b = s.encode("utf-8") if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def kv_string(key: str, value: str) -> bytes:
    return _str(key) + struct.pack("<I", GGUFValueType.STRING) + _str(value)


def kv_uint32(key: str, value: int) -> bytes:
    return _str(key) + struct.pack("<II", GGUFValueType.UINT32, value)


def kv_string_array(key: str, values: list[str]) -> bytes:
    out = bytearray(_str(key) + struct.pack("<IIQ", GGUFValueType.ARRAY, GGUFValueType.STRING, len(values)))
    for v in values:
        out += _str(v)
    return bytes(out)


def pad(n: int, align: int) -> int:
    return (n + align - 1) // align * align


@dataclass
class TensorEntry:
    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]  # numpy order (outermost first)
    nbytes: int
    offset: int = 0  # relative to the start of the data section


class GGUFLayout:
    """Builds the bytes that precede the tensor data, and where each tensor's data goes."""

    def __init__(self, alignment: int = DEFAULT_ALIGNMENT):
        self.alignment = alignment
        self.kv: list[bytes] = []
        self.tensors: list[TensorEntry] = []

    def add_raw_kv(self, raw: bytes) -> None:
        self.kv.append(raw)

    def add_tensor(self, name: str, ggml_type: GGMLQuantizationType, shape: tuple[int, ...], nbytes: int) -> None:
        offset = 0
        if self.tensors:
            last = self.tensors[-1]
            offset = pad(last.offset + last.nbytes, self.alignment)
        self.tensors.append(TensorEntry(name, ggml_type, shape, nbytes, offset))

    def header(self) -> bytes:
        out = bytearray(struct.pack("<IIQQ", GGUF_MAGIC, GGUF_VERSION, len(self.tensors), len(self.kv)))
        for raw in self.kv:
            out += raw
        for t in self.tensors:
            out += _str(t.name)
            out += struct.pack("<I", len(t.shape))
            out += struct.pack(f"<{len(t.shape)}Q", *reversed(t.shape))  # ggml ne order: innermost first
            out += struct.pack("<IQ", int(t.ggml_type), t.offset)
        out += b"\0" * (pad(len(out), self.alignment) - len(out))
        return bytes(out)
