"""A model split into several GGUF files (``model-00001-of-00003.gguf``, ...), read as one.

Large models are published in parts, written by llama.cpp's ``gguf-split``: the first part holds
every metadata key and the first tensors, each other part only the split keys and its tensors. All
parts carry ``split.no`` (u16, 0-based), ``split.count`` (u16) and ``split.tensors.count`` (i32,
tensors of the whole model); the parts are named ``<prefix>-%05d-of-%05d.gguf`` (1-based), so the
first part's name says where the others are, as llama.cpp's loader finds them.

Why a *merged view*: a split model is read as the one file ``gguf-split --merge`` would write,
without the split keys (the file ``make-model`` writes without ``--split-max-size``): the metadata
of the first part, every tensor in part order, offsets laid out as a single GGUF lays them out. So
the fingerprint, the manifest (offsets, header hash, size), the slicer's plan and a downloader's
plan are those of the unsplit file, and a slice of a split model is byte-identical to the same slice
of the unsplit one. Only byte access differs: a merged-file offset is mapped to the part holding it
(:meth:`PartMap.locate`); each tensor's ``.data`` is a view of its own part's memory map.
"""
from __future__ import annotations

import bisect
import os
import re
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFValueType
from gguf.gguf_reader import ReaderField, ReaderTensor

from p2pswarm.errors import ModelFormatError
from p2pswarm.model.gguf_out import GGUFLayout, pad

KEY_SPLIT_NO = "split.no"
KEY_SPLIT_COUNT = "split.count"
KEY_SPLIT_TENSORS = "split.tensors.count"
#: Our writer's addition to every part: the fingerprint of the whole (unsplit) model, so a part of
#: another model of the same shape is refused by name (llama.cpp ignores the key).
KEY_SPLIT_FINGERPRINT = "p2pswarm.split.fingerprint"
SPLIT_KEYS = (KEY_SPLIT_NO, KEY_SPLIT_COUNT, KEY_SPLIT_TENSORS, KEY_SPLIT_FINGERPRINT)


def split_path(prefix: str | Path, no: int, count: int) -> Path:
    """Part ``no`` (0-based) of ``count``: llama.cpp's ``llama_split_path``."""
    return Path(f"{prefix}-{no + 1:05d}-of-{count:05d}.gguf")


def split_prefix(path: str | os.PathLike, no: int, count: int) -> str | None:
    """The prefix of part ``no`` of ``count`` named ``path`` (llama.cpp's ``llama_split_prefix``),
    or None when the name does not end as that part's name must."""
    s = str(path)
    tail = f"-{no + 1:05d}-of-{count:05d}.gguf"
    return s[: -len(tail)] if len(s) > len(tail) and s.endswith(tail) else None


_PART_TAIL = re.compile(r"-\d{5}-of-\d{5}$")


def model_name(path: str | Path) -> str:
    """The name a model is known by (the OpenAI API's default model id): its file name without
    ``.gguf`` and, for a split model's first part, without ``-00001-of-0000N`` (``dssplit``, not
    ``dssplit-00001-of-00005``), so a model keeps its name whether it is published split or merged."""
    stem = Path(path).name
    stem = stem[:-len(".gguf")] if stem.endswith(".gguf") else Path(stem).stem
    return _PART_TAIL.sub("", stem) or stem


@dataclass
class GGUFPart:
    """One file of a model: its path, its uint8 memory map and its size."""

    path: Path
    data: np.ndarray
    file_size: int


class PartMap:
    """Maps a byte range of the (merged) model to the part file that holds it.

    A single file maps to itself. For a split model every tensor's range is listed with the part
    holding it and the shift from merged to part offsets; a range must lie inside one tensor."""

    def __init__(self, parts: list[GGUFPart], spans: list[tuple[int, int, int, int]] | None = None):
        self.parts = parts
        spans = sorted(spans or [])
        self._starts = [s[0] for s in spans]
        self._spans = spans  # (merged start, merged end, part index, part offset - merged offset)

    @property
    def split(self) -> bool:
        return len(self.parts) > 1 or bool(self._spans)

    def locate(self, offset: int, n: int) -> tuple[GGUFPart, int]:
        """(part, offset in that part) of the merged bytes ``[offset, offset + n)``."""
        if not self._spans:
            return self.parts[0], offset
        i = bisect.bisect_right(self._starts, offset) - 1
        if i < 0 or offset + n > self._spans[i][1]:
            raise ModelFormatError(f"{self.parts[0].path}: bytes {offset}..{offset + n} of the model are not "
                                   f"inside one tensor of one part")
        _s, _e, pi, shift = self._spans[i]
        return self.parts[pi], offset + shift

    def view(self, offset: int, n: int) -> np.ndarray:
        part, off = self.locate(offset, n)
        return part.data[off: off + n]


def _scalar_field(name: str, value: int, dtype, vtype: GGUFValueType) -> ReaderField:
    return ReaderField(0, name, [np.array([value], dtype=dtype)], [0], [vtype])


def _int_key(reader: GGUFReader, key: str, path: Path) -> int | None:
    f = reader.fields.get(key)
    if f is None:
        return None
    if len(f.types) != 1 or f.types[0] in (GGUFValueType.STRING, GGUFValueType.ARRAY):
        raise ModelFormatError(f"{path}: GGUF key {key} is not an integer")
    return int(f.parts[f.data[0]][0])


def _str_key(reader: GGUFReader, key: str) -> str | None:
    f = reader.fields.get(key)
    if f is None or f.types[:1] != [GGUFValueType.STRING]:
        return None
    return bytes(f.parts[f.data[0]]).decode("utf-8", "replace")


def is_split(reader: GGUFReader) -> bool:
    """Whether a GGUF is a part of a split model (it has ``split.count``)."""
    return KEY_SPLIT_COUNT in reader.fields


def check_first_part(path: str | os.PathLike, reader: GGUFReader) -> None:
    """A one-line :class:`ModelFormatError` when ``path`` is a split model's part other than the
    first (for readers of metadata only, which the first part holds: the tokenizer)."""
    no = _int_key(reader, KEY_SPLIT_NO, Path(path)) if is_split(reader) else None
    if no:
        count = _int_key(reader, KEY_SPLIT_COUNT, Path(path)) or 0
        first = f"{split_prefix(path, no, count) or '<name>'}-00001-of-{count:05d}.gguf"
        raise ModelFormatError(f"{path}: this is part {no + 1} of {count} of a split model: give its first part ({first})")


class SplitGGUFReader(GGUFReader):
    """The merged view of a split model, with the :class:`gguf.GGUFReader` attributes p2pswarm
    reads: ``fields`` (the first part's, without the split keys), ``tensors`` (all parts', offsets
    of the merged file, ``.data`` views of their own part), ``alignment``, ``data_offset``. Plus
    ``header`` (the merged file's bytes before the first tensor), ``file_size`` (the merged file's)
    and ``part_map``. There is no single ``data``: read bytes through the part map."""

    def __init__(self, first_path: str | Path, first: GGUFReader, open_part):  # see class
        path = Path(first_path)
        count = _int_key(first, KEY_SPLIT_COUNT, path)
        no = _int_key(first, KEY_SPLIT_NO, path)
        n_tensors = _int_key(first, KEY_SPLIT_TENSORS, path)
        fingerprint = _str_key(first, KEY_SPLIT_FINGERPRINT)
        if count is None or count < 0:
            raise ModelFormatError(f"{path}: split.count is {count}: not a usable split model")
        # gguf-split --merge leaves the split keys in its output with split.count 0: one part, as 1 is
        count = max(count, 1)
        check_first_part(path, first)
        if no is None:
            raise ModelFormatError(f"{path}: split.count is {count} but split.no is missing")
        prefix = split_prefix(path, 0, count)
        if count > 1 and prefix is None:
            raise ModelFormatError(f"{path}: the first of {count} parts must be named <name>-00001-of-{count:05d}.gguf "
                                   f"(the other parts are found by that name)")
        readers = [first]
        paths = [path]
        others = [] if prefix is None else [split_path(prefix, i, count) for i in range(1, count)]
        for i, p in enumerate(others, start=1):
            if not p.exists():
                raise ModelFormatError(f"{p}: part {i + 1} of {count} of {path.name} is missing")
            r = open_part(p)
            got_no, got_count = _int_key(r, KEY_SPLIT_NO, p), _int_key(r, KEY_SPLIT_COUNT, p)
            if got_no != i or got_count != count:
                raise ModelFormatError(f"{p}: says it is part {'?' if got_no is None else got_no + 1} of {got_count}, "
                                       f"expected part {i + 1} of {count}")
            got_tensors = _int_key(r, KEY_SPLIT_TENSORS, p)
            if n_tensors is not None and got_tensors is not None and got_tensors != n_tensors:
                raise ModelFormatError(f"{p}: split.tensors.count is {got_tensors}, the first part says {n_tensors}: "
                                       f"a part of another model")
            if fingerprint is not None and _str_key(r, KEY_SPLIT_FINGERPRINT) != fingerprint:
                raise ModelFormatError(f"{p}: a part of another model ({KEY_SPLIT_FINGERPRINT} differs from "
                                       f"the first part's)")
            readers.append(r)
            paths.append(p)
        self.alignment = first.alignment
        self.byte_order = first.byte_order
        self.endianess = first.endianess
        self._first_data = first.data
        self.parts = [GGUFPart(p, r.data, int(r.data.nbytes)) for p, r in zip(paths, readers)]

        # the merged file: the first part's keys but the split ones, then every tensor in part order
        kept = [f for k, f in first.fields.items() if not k.startswith("GGUF.") and k not in SPLIT_KEYS]
        layout = GGUFLayout(int(first.alignment))
        for f in kept:
            layout.add_raw_kv(first.data[f.offset: f.offset + sum(int(x.nbytes) for x in f.parts)].tobytes())
        seen: dict[str, Path] = {}
        located = []
        for pi, (p, r) in enumerate(zip(paths, readers)):
            for t in r.tensors:
                if t.name in seen:
                    raise ModelFormatError(f"{p}: tensor {t.name} is also in {seen[t.name].name}: a part of another model")
                seen[t.name] = p
                if t.data_offset + t.n_bytes > self.parts[pi].file_size:
                    raise ModelFormatError(f"{p}: truncated: tensor {t.name} ends at byte {t.data_offset + t.n_bytes} "
                                           f"but the file has {self.parts[pi].file_size}")
                shape = tuple(int(d) for d in reversed(t.shape.tolist()))
                layout.add_tensor(t.name, t.tensor_type, shape, int(t.n_bytes))
                located.append((pi, t))
        if n_tensors is not None and len(located) != n_tensors:
            raise ModelFormatError(f"{path}: split.tensors.count is {n_tensors} but the {count} parts hold "
                                   f"{len(located)} tensors")
        self.header = layout.header()
        self.data_offset = len(self.header)
        self.tensors, spans = [], []
        for entry, (pi, t) in zip(layout.tensors, located):
            start = self.data_offset + entry.offset
            self.tensors.append(ReaderTensor(name=t.name, tensor_type=t.tensor_type, shape=t.shape,
                                             n_elements=t.n_elements, n_bytes=t.n_bytes, data_offset=start,
                                             data=t.data, field=t.field))
            spans.append((start, start + int(t.n_bytes), pi, int(t.data_offset) - start))
        last = layout.tensors[-1] if layout.tensors else None
        self.file_size = self.data_offset + (pad(last.offset + last.nbytes, layout.alignment) if last else 0)
        self.part_map = PartMap(self.parts, spans)
        self.fields = OrderedDict({
            "GGUF.version": _scalar_field("GGUF.version", 3, np.uint32, GGUFValueType.UINT32),
            "GGUF.tensor_count": _scalar_field("GGUF.tensor_count", len(self.tensors), np.uint64, GGUFValueType.UINT64),
            "GGUF.kv_count": _scalar_field("GGUF.kv_count", len(kept), np.uint64, GGUFValueType.UINT64),
            **{f.name: f for f in kept},
        })

    @property
    def data(self) -> np.ndarray:  # type: ignore[override]  # on purpose: a split model has no one map to give
        raise AttributeError("a split model has no single memory map: read bytes with ModelLayout.view/locate")

    def field_bytes(self, f: ReaderField) -> bytes:
        """A kept metadata field's exact bytes (they lie in the first part)."""
        return self._first_data[f.offset: f.offset + sum(int(x.nbytes) for x in f.parts)].tobytes()


__all__ = [
    "GGUFPart", "KEY_SPLIT_COUNT", "KEY_SPLIT_FINGERPRINT", "KEY_SPLIT_NO", "KEY_SPLIT_TENSORS", "PartMap",
    "SPLIT_KEYS", "SplitGGUFReader", "check_first_part", "is_split", "split_path", "split_prefix",
]
