"""The one GGUF reader: gguf-py's :class:`gguf.GGUFReader`, sped up, and the typed views of its
metadata the rest of p2pswarm needs.

Why one: the project used to parse GGUF headers three ways (gguf-py's reader in ``layout``, a
header-only subclass in ``slicer``, and a hand-written ``struct`` parser in ``synth``, written
because gguf-py took ~2.5 s to open a 150k-token vocabulary). Every reader here is gguf-py's; the
speed-up (:class:`FastGGUFReader`) keeps the reader's data model (``fields``, ``parts``,
``data`` indices, ``tensors``) exactly, so code written against gguf-py keeps working, and
``tests/test_synth.py`` compares its fields with the stock reader's, part by part.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.gguf_reader import ReaderTensor

from p2pswarm.errors import ModelFormatError, UserError, clip

__all__ = [
    "KV", "FastGGUFReader", "HeaderOnlyReader", "MemmapViewReader", "TensorInfo", "array_field", "field_value", "get_str",
    "open_gguf", "read_gguf_header", "read_gguf_kv", "scalar",
]

_U64 = np.dtype("<u8")


class MemmapViewReader(GGUFReader):
    """A :class:`gguf.GGUFReader` holding its mapping as a plain ndarray view of the memmap.

    Why: every slice of an ``np.memmap`` runs ``memmap.__array_finalize__``, and the reader slices
    once per metadata item (a 150k-token vocabulary has ~450k). The view is the same memory: still
    mapped, still read-only.
    """

    @property  # type: ignore[override]  # a plain ndarray view of gguf's memmap, same memory
    def data(self) -> np.ndarray:
        return self._plain_data

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._plain_data = value.view(np.ndarray) if isinstance(value, np.memmap) else value


class FastGGUFReader(MemmapViewReader):
    """A :class:`gguf.GGUFReader` that opens a large vocabulary in a fraction of the time.

    Beyond the plain view (:class:`MemmapViewReader`), arrays of strings and of numbers are parsed
    in one pass instead of one generic recursive call per element, producing the same ``parts``
    (same dtypes, same bytes) and ``data`` indices as the stock parser.
    """

    def _get_field_parts(self, orig_offs: int, raw_type: int):
        if raw_type != GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        n = int(alen[0])
        itype = GGUFValueType(int(raw_itype[0]))
        offs = orig_offs + 12
        parts: list[np.ndarray] = [raw_itype, alen]
        data = self.data
        if itype == GGUFValueType.STRING:
            buf = data.data  # a memoryview; int.from_bytes on a memoryview slice: no ndarray per length
            end = len(data)
            for _ in range(n):
                if offs + 8 > end:
                    raise ValueError("truncated string array")
                slen = int.from_bytes(buf[offs:offs + 8], "little")
                if offs + 8 + slen > end:
                    raise ValueError("truncated string array")
                parts.append(data[offs:offs + 8].view(_U64))
                parts.append(data[offs + 8:offs + 8 + slen])
                offs += 8 + slen
            return offs - orig_offs, parts, list(range(3, 2 + 2 * n, 2)), [GGUFValueType.ARRAY, itype]
        nptype = self.gguf_scalar_to_np.get(itype)
        if nptype is None:  # nested arrays: the generic parser
            return super()._get_field_parts(orig_offs, raw_type)
        values = self._get(offs, nptype, n)
        if len(values) != n:
            raise ValueError("truncated array")
        parts += list(values.reshape(n, 1))  # one 1-element view per item, as the stock reader
        offs += int(values.nbytes)
        return offs - orig_offs, parts, list(range(2, 2 + n)), [GGUFValueType.ARRAY, itype]


class HeaderOnlyReader(FastGGUFReader):
    """A reader over a file that holds only a model's header (everything before the first tensor's
    data): fields and the tensor table are parsed as usual, tensor data is not mapped (it is not
    there). Used for a model known from its downloaded header, and for :func:`read_gguf_header`."""

    def _build_tensors(self, start_offs: int, fields) -> None:
        tensors = []
        for f in fields:
            _name_len, name_data, _n_dims, dims, raw_dtype, offset_tensor = f.parts
            ggml_type = GGMLQuantizationType(raw_dtype[0])
            n_elems = int(np.prod(dims))
            block_size, type_size = GGML_QUANT_SIZES[ggml_type]
            tensors.append(ReaderTensor(name=str(bytes(name_data), encoding="utf-8"), tensor_type=ggml_type,
                                        shape=dims, n_elements=n_elems, n_bytes=n_elems * type_size // block_size,
                                        data_offset=int(start_offs + offset_tensor[0]),
                                        data=np.empty(0, np.uint8), field=f))
        self.tensors = tensors


def open_gguf(path: str | os.PathLike[str]) -> GGUFReader:
    """Open a GGUF memory-mapped, turning every way a file can be broken into one clear line."""
    path = Path(path)
    if not path.exists():
        raise ModelFormatError(f"{path}: no such file")
    if not path.is_file():
        raise ModelFormatError(f"{path}: not a regular file")
    if path.stat().st_size < 24:
        raise ModelFormatError(f"{path}: not a valid GGUF file (too short: {path.stat().st_size} bytes)")
    try:
        return FastGGUFReader(path, "r")
    except PermissionError as exc:
        raise ModelFormatError(f"{path}: cannot read ({exc.strerror or exc})") from None
    except Exception as exc:  # the reader raises ValueError, struct/numpy/index errors on bad input
        msg = clip(exc, 300) or type(exc).__name__
        if "magic" in msg.lower():
            raise ModelFormatError(f"{path}: not a valid GGUF file (bad magic)") from None
        truncated = _truncation(path)
        if truncated:
            raise ModelFormatError(f"{path}: {truncated}") from None
        raise ModelFormatError(f"{path}: not a valid GGUF file (corrupt or truncated: {msg})") from None


def _truncation(path: Path) -> str | None:
    """Why a GGUF failed to open, said plainly when it is a cut-off file (an interrupted copy or
    download): its header names the size the tensors need, larger than the file. None when the
    header itself cannot be read or the size adds up (then the file is corrupt some other way)."""
    actual = path.stat().st_size
    try:
        r = HeaderOnlyReader(path, "r")
    except Exception:  # the header itself is cut or broken: reported by the caller as it is
        return None
    expected = max((t.data_offset + int(t.n_bytes) for t in r.tensors), default=r.data_offset)
    if actual >= expected:
        return None
    return (f"GGUF file is truncated: its tensors need {expected:,} bytes, the file has {actual:,} "
            "(an interrupted copy or download? copy or download it again)")


def field_value(f) -> Any:
    """A metadata field as a plain Python value (str, int, float, bool or list of them)."""
    t = f.types[0]
    if t == GGUFValueType.STRING:
        return bytes(f.parts[f.data[0]]).decode("utf-8")
    if t == GGUFValueType.ARRAY:
        sub = f.types[-1]
        if sub == GGUFValueType.STRING:
            return [bytes(f.parts[i]).decode("utf-8", errors="replace") for i in f.data]
        return [f.parts[i].tolist()[0] for i in f.data]
    v = f.parts[f.data[0]].tolist()
    return v[0] if isinstance(v, list) else v


def get_str(reader: GGUFReader, key: str) -> str | None:
    f = reader.fields.get(key)
    return None if f is None else str(field_value(f))


def scalar(reader: GGUFReader, key: str, kinds: tuple[type, ...]):
    """A scalar key's value, checked to be one of ``kinds`` (None when absent); a wrong type is a
    one-line :class:`ModelFormatError`."""
    f = reader.fields.get(key)
    if f is None:
        return None
    if not f.types or f.types[0] == GGUFValueType.ARRAY:
        raise ModelFormatError(f"GGUF key {key} has the wrong type (array)")
    if f.types[0] == GGUFValueType.STRING:
        value = bytes(f.parts[f.data[0]]).decode("utf-8", errors="replace")
    else:
        value = f.parts[f.data[0]][0].item()
    if not isinstance(value, kinds) or (bool not in kinds and isinstance(value, bool)):
        raise ModelFormatError(f"GGUF key {key} has the wrong type ({type(value).__name__})")
    return value


def array_field(reader: GGUFReader, key: str, elem: GGUFValueType):
    """An array key's field, checked to hold ``elem`` items (None when absent)."""
    f = reader.fields.get(key)
    if f is None:
        return None
    if len(f.types) != 2 or f.types[0] != GGUFValueType.ARRAY or f.types[1] != elem:
        raise ModelFormatError(f"GGUF key {key} is not an array of {elem.name}")
    return f


# ---- typed metadata, for copying keys exactly into a new file ----------------------------------


@dataclasses.dataclass
class KV:
    """One metadata key with its exact GGUF type (and element type for arrays)."""

    key: str
    value: Any
    vtype: Any  # gguf.GGUFValueType
    sub_type: Any = None


@dataclasses.dataclass
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order: outermost first
    gtype: int  # GGML type id
    offset: int  # from the start of the data section


def _kv(f) -> KV:
    t = f.types[0]
    if t == GGUFValueType.STRING:
        return KV(f.name, bytes(f.parts[f.data[0]]), t)
    if t == GGUFValueType.ARRAY:
        sub = f.types[-1] if len(f.types) > 1 else GGUFValueType.UINT8  # an empty array
        if sub == GGUFValueType.STRING:
            items: list[Any] = [bytes(f.parts[i]) for i in f.data]
        elif f.data:
            items = np.concatenate([f.parts[i] for i in f.data]).tolist()
        else:
            items = []
        if sub == GGUFValueType.BOOL:
            items = [bool(x) for x in items]
        return KV(f.name, items, t, sub)
    v = f.parts[f.data[0]].tolist()[0]
    return KV(f.name, bool(v) if t == GGUFValueType.BOOL else v, t)


def read_gguf_header(path: str | os.PathLike[str]) -> tuple[list[KV], list[TensorInfo]]:
    """Every metadata key (types preserved) and tensor info of a GGUF file.

    Reads only the header of a large model; strings (also inside arrays) come back as ``bytes``
    so they can be copied exactly. Raises :class:`UserError` for a missing, unreadable or
    malformed file.
    """
    path = Path(path)
    try:
        with open(path, "rb") as fh:
            if os.fstat(fh.fileno()).st_size == 0:
                raise UserError(f"bad GGUF file {path}: it is empty")
        r = HeaderOnlyReader(path, "r")
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror or exc}") from None
    except (ValueError, IndexError, KeyError, UnicodeDecodeError) as exc:
        msg = clip(exc, 300) or type(exc).__name__
        if "magic" in msg.lower():
            msg = "not a GGUF file (bad magic)"
        raise UserError(f"bad GGUF file {path}: {msg}") from None
    kvs = [_kv(f) for name, f in r.fields.items() if not name.startswith("GGUF.")]
    tis = [TensorInfo(t.name, tuple(int(d) for d in reversed(t.shape.tolist())), int(t.tensor_type),
                      t.data_offset - r.data_offset) for t in r.tensors]
    return kvs, tis


def read_gguf_kv(path: str | os.PathLike[str]) -> list[KV]:
    """Every metadata key of a GGUF file (see :func:`read_gguf_header`)."""
    return read_gguf_header(path)[0]
