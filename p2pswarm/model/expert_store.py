"""Every routed expert of a model as one sparse expert-shard file that holds only the bytes put in it.

Why: a backbone started from the backbone file (`p2pswarm slice --backbone`) holds none of the
routed experts, yet must compute the ones it keeps in its cache with the very bytes and the very
kernel a worker uses (the split run is bit-identical only that way). So the store is the expert
shard of *all* layers and *all* experts that :func:`~p2pswarm.model.slicer.plan_expert_shard` lays
out from the source's header (recorded in the backbone file, or checked against the manifest),
created as a sparse file of the full size: a hole costs neither disk nor memory. A unit put in it
is written at its offsets (:meth:`ExpertStore.put`, after the caller checked every slab against the
manifest); one dropped from the cache is punched out again (:meth:`ExpertStore.drop`,
``fallocate(PUNCH_HOLE)``), so disk and page cache follow the cache's size. The expert banks map the
file as they map any shard; the dispatcher only ever asks the bank for units put here.
"""
from __future__ import annotations

import base64
import ctypes
import ctypes.util
import errno
import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from p2pswarm.errors import ModelFormatError, UserError
from p2pswarm.model.gguf_read import field_value
from p2pswarm.model.layout import KEY_SOURCE_FILE_SIZE, KEY_SOURCE_HEADER, ExpertTensor, ModelLayout
from p2pswarm.model.manifest import source_fingerprint

log = logging.getLogger("p2pswarm.model")

_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02


@dataclass(frozen=True)
class Slab:
    """One tensor's bytes of one expert: where it is in the source model and in the store."""

    tensor: str
    source_offset: int
    store_offset: int
    length: int


def source_header(layout: ModelLayout) -> tuple[bytes, int]:
    """(header bytes, file size) of the model a backbone file was cut from (slice_backbone records
    them); a one-line error for a backbone file cut before they were recorded."""
    f, n = layout.reader.fields.get(KEY_SOURCE_HEADER), layout.reader.fields.get(KEY_SOURCE_FILE_SIZE)
    if f is None or n is None:
        raise UserError(f"{layout.path} is a backbone file without the source's header (cut by an older "
                        "p2pswarm): cut it again with `p2pswarm slice --backbone`")
    try:
        return base64.b64decode(str(field_value(f)), validate=True), int(str(field_value(n)))
    except ValueError:
        raise ModelFormatError(f"{layout.path}: the recorded source header is not valid base64") from None


class ExpertStore:
    """The sparse all-experts shard of one model (module doc). ``layout`` maps it like any shard."""

    def __init__(self, path: Path, layout: ModelLayout, slabs: dict[tuple[int, int], list[Slab]]):
        self.path = path
        self.layout = layout
        self.slabs = slabs
        self._fd = os.open(path, os.O_RDWR)
        self.punch = True  # fallocate(PUNCH_HOLE) works here (cleared on the first EOPNOTSUPP)

    @classmethod
    def create(cls, path: str | os.PathLike[str], header_src: bytes, file_size: int, fingerprint: str) -> "ExpertStore":
        """Lay out the store at ``path`` (replacing what is there: it is a cache) from the source's
        header bytes; no expert bytes are written."""
        from p2pswarm.model.slicer import header_layout, plan_expert_shard, shard_header

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.source-header.{os.getpid()}")
        try:
            tmp.write_bytes(header_src)
            src = header_layout(tmp, file_size)
            plan = plan_expert_shard(src, None, (0, src.n_expert), fingerprint)
        finally:
            tmp.unlink(missing_ok=True)
        header, _slots = shard_header(plan.gguf)
        size = len(header) + max(t.offset + t.nbytes for t in plan.gguf.tensors)
        path.unlink(missing_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, size)
            os.pwrite(fd, header, 0)
        finally:
            os.close(fd)
        layout = ModelLayout.open(path)
        slabs: dict[tuple[int, int], list[Slab]] = {}
        for g_t, src_t in zip(plan.gguf.tensors, plan.sources):
            st: ExpertTensor = layout.expert_tensors[src_t.layer][src_t.kind]
            for e in range(src.n_expert):
                s_off, n = src_t.slab(e)
                slabs.setdefault((src_t.layer, e), []).append(Slab(src_t.name, s_off, st.slab(e)[0], n))
        return cls(path, layout, slabs)

    @classmethod
    def for_backbone_file(cls, backbone: ModelLayout, path: str | os.PathLike[str]) -> "ExpertStore":
        header, size = source_header(backbone)
        return cls.create(path, header, size, source_fingerprint(backbone))

    def unit_bytes(self, layer: int) -> int:
        return self.layout.expert_bytes(layer)

    def put(self, layer: int, expert: int, data: dict[str, bytes]) -> None:
        """Write one unit's slabs (tensor name -> bytes, already checked by the caller)."""
        for s in self.slabs[(layer, expert)]:
            b = data[s.tensor]
            if len(b) != s.length:
                raise ValueError(f"{s.tensor}[{expert}]: {len(b)} bytes, expected {s.length}")
            view = memoryview(b)
            done = 0
            while done < len(b):
                done += os.pwrite(self._fd, view[done:], s.store_offset + done)

    def copy_from(self, source: ModelLayout, layer: int, expert: int) -> None:
        """Put a unit from a full model's file (what a backbone holding the whole model caches)."""
        self.put(layer, expert, {s.tensor: source.view(s.source_offset, s.length).tobytes()
                                 for s in self.slabs[(layer, expert)]})

    def sha256(self, layer: int, expert: int) -> dict[str, str]:
        """What is in the store for a unit, per tensor (tests and checks)."""
        return {s.tensor: hashlib.sha256(os.pread(self._fd, s.length, s.store_offset)).hexdigest()
                for s in self.slabs[(layer, expert)]}

    def drop(self, layer: int, expert: int) -> None:
        """Give a unit's disk blocks and page-cache pages back (a hole reads as zeros; the bank is
        never asked for a unit not put again)."""
        if not self.punch:
            return
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        for s in self.slabs[(layer, expert)]:
            r = libc.fallocate(self._fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE,
                               ctypes.c_long(s.store_offset), ctypes.c_long(s.length))
            if r != 0:
                err = ctypes.get_errno()
                if err in (errno.EOPNOTSUPP, errno.ENOSYS):
                    self.punch = False
                    log.info("%s: this file system cannot punch holes: dropped experts keep their disk "
                             "blocks until the store is recreated", self.path)
                    return

    def disk_bytes(self) -> int:
        """Bytes the store takes on disk (allocated blocks, not its apparent size)."""
        return os.fstat(self._fd).st_blocks * 512

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
