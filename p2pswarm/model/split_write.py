"""Write a GGUF as a split model, the way llama.cpp's ``gguf-split --split-max-size`` does.

Parts are ``<prefix>-00001-of-0000N.gguf``. The first part holds every metadata key of the source,
then the split keys; every other part only the split keys. Tensors keep the source's order and are
packed into parts of at most ``max_bytes`` of (aligned) tensor data; a tensor larger than that gets
a part of its own. Each part also carries ``p2pswarm.split.fingerprint`` (the source's model
fingerprint), so a part of another model of the same shape is refused by name when read.

Reading the parts back (:mod:`p2pswarm.model.split_gguf`) gives the source file's header, offsets
and fingerprint exactly: the test suite holds both to that. Like the slicer, every part is written to
a temporary name and renamed only when all are complete; a failure leaves no part behind.
"""
from __future__ import annotations

import os
import struct
from collections.abc import Callable
from pathlib import Path

from gguf import GGUFValueType

from p2pswarm.errors import UserError
from p2pswarm.model.gguf_out import GGUFLayout, _str, kv_string, pad
from p2pswarm.model.layout import ModelLayout
from p2pswarm.model.manifest import model_fingerprint
from p2pswarm.model.slicer import _copy_range, _pwrite_all
from p2pswarm.model.split_gguf import (KEY_SPLIT_COUNT, KEY_SPLIT_FINGERPRINT, KEY_SPLIT_NO, KEY_SPLIT_TENSORS,
                                       SPLIT_KEYS, split_path)

_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """``"200M"``, ``"2G"``, ``"4096"`` (bytes; K/M/G/T are powers of 1024) -> bytes."""
    t = text.strip().upper().removesuffix("B")
    unit = t[-1:] if t[-1:] in _SIZE_UNITS and t[-1:] else ""
    try:
        n = float(t[: len(t) - len(unit)])
    except ValueError:
        raise UserError(f"bad size {text!r}: expected a number with an optional K, M, G or T (e.g. 200M)") from None
    size = int(n * _SIZE_UNITS[unit])
    if size <= 0:
        raise UserError(f"bad size {text!r}: must be positive")
    return size


def split_prefix_of(out: str | os.PathLike[str]) -> str:
    """The part-name prefix for an output named ``M.gguf``: ``M``."""
    s = str(out)
    return s[: -len(".gguf")] if s.endswith(".gguf") else s


def _kv_u16(key: str, v: int) -> bytes:
    return _str(key) + struct.pack("<IH", GGUFValueType.UINT16, v)


def _kv_i32(key: str, v: int) -> bytes:
    return _str(key) + struct.pack("<Ii", GGUFValueType.INT32, v)


def plan_parts(sizes: list[int], max_bytes: int, alignment: int) -> list[list[int]]:
    """Tensor indices per part: in order, at most ``max_bytes`` of padded data each (a bigger tensor
    alone), never an empty part."""
    parts: list[list[int]] = [[]]
    used = 0
    for i, n in enumerate(sizes):
        padded = pad(n, alignment)
        if parts[-1] and used + padded > max_bytes:
            parts.append([])
            used = 0
        parts[-1].append(i)
        used += padded
    return parts


PartProgress = Callable[[int, int, str], None]  # (bytes done, bytes total, which part: "part 2 of 5")

def write_split(source: str | os.PathLike[str], prefix: str, max_bytes: int, *,
                progress: PartProgress | None = None) -> list[Path]:
    """Write ``source`` (one GGUF) as parts ``<prefix>-0000i-of-0000N.gguf``; returns their paths,
    the first part first."""
    layout = ModelLayout.open(source, require_experts=False)
    if layout.split:
        raise UserError(f"{source}: is already a split model")
    reader = layout.reader
    alignment = int(reader.alignment)
    tensors = list(reader.tensors)
    plan = plan_parts([int(t.n_bytes) for t in tensors], max_bytes, alignment)
    count = len(plan)
    if count > 65535:
        raise UserError(f"--split-max-size {max_bytes} would make {count} parts (at most 65535)")
    fingerprint = model_fingerprint(layout)
    kvs = [layout.field_bytes(f) for k, f in reader.fields.items() if not k.startswith("GGUF.") and k not in SPLIT_KEYS]
    paths = [split_path(prefix, i, count) for i in range(count)]
    for p in paths:
        if p.exists() and p.resolve() == Path(source).resolve():
            raise UserError(f"{p}: refusing to overwrite the source model")
    tmps = [p.with_name(f".{p.name}.partial-{os.getpid()}") for p in paths]
    total = sum(int(t.n_bytes) for t in tensors)
    done = 0
    src = os.open(layout.path, os.O_RDONLY)
    try:
        for i, (idx, tmp) in enumerate(zip(plan, tmps)):
            g = GGUFLayout(alignment)
            for raw in (kvs if i == 0 else []):
                g.add_raw_kv(raw)
            g.add_raw_kv(_kv_u16(KEY_SPLIT_NO, i))
            g.add_raw_kv(_kv_u16(KEY_SPLIT_COUNT, count))
            g.add_raw_kv(_kv_i32(KEY_SPLIT_TENSORS, len(tensors)))
            g.add_raw_kv(kv_string(KEY_SPLIT_FINGERPRINT, fingerprint))
            for j in idx:
                t = tensors[j]
                g.add_tensor(t.name, t.tensor_type, tuple(int(d) for d in reversed(t.shape.tolist())), int(t.n_bytes))
            header = g.header()
            dst = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                _pwrite_all(dst, header, 0)
                for j, entry in zip(idx, g.tensors):
                    t = tensors[j]
                    dst_off = len(header) + entry.offset
                    for n in _copy_range(src, dst, int(t.data_offset), int(t.n_bytes), dst_off, layout.path):
                        dst_off += n
                        done += n
                        if progress:
                            progress(done, total, f"part {i + 1} of {count}")
                last = g.tensors[-1]
                end = len(header) + pad(last.offset + last.nbytes, alignment)  # padded, as one GGUF is
                os.ftruncate(dst, end)
                os.fsync(dst)
            finally:
                os.close(dst)
        for tmp, p in zip(tmps, paths):
            os.replace(tmp, p)
    except BaseException:
        for tmp in tmps:
            tmp.unlink(missing_ok=True)
        raise
    finally:
        os.close(src)
    return paths


__all__ = ["parse_size", "plan_parts", "split_prefix_of", "write_split"]
