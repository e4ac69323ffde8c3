"""Cut a MoE GGUF into shards by byte-range copy.

* :func:`slice_experts` writes a mini-GGUF holding only routed experts ``[expert_begin,
  expert_end)`` of layers ``[layer_begin, layer_end)``: for each expert tensor, one contiguous range
  of source bytes (the expert index is the outermost dimension). No dequantisation, no re-packing:
  quantisation types are kept and the shard's bytes equal the source's.
* :func:`slice_backbone` writes everything else: the dense path, router, norms and tokenizer.

Both copy the source's metadata fields byte for byte and add our own: the source model's
fingerprint, the coordinates, and a sha256 per tensor (reserved as fixed-width slots in the header
and patched once the bytes have streamed by). Data moves in bounded chunks, so peak memory is one
chunk and time grows with the slice, not with the model. The output is written to a temporary name
and renamed at the end: a failed or interrupted slice leaves no file behind.
"""
from __future__ import annotations

import base64
import hashlib
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path


from p2pswarm.errors import ModelFormatError, UserError, clip
from p2pswarm.model.gguf_out import (
    DEFAULT_ALIGNMENT,
    GGUFLayout,
    kv_string,
    kv_string_array,
    kv_uint32,
)
from p2pswarm.model.gguf_read import field_value
from p2pswarm.model.layout import EXPERT_TENSOR_RE, KEY_EXPERT_BEGIN, KEY_EXPERT_END, KEY_LAYER_BEGIN, KEY_LAYER_END, KEY_SHARD_KIND, KEY_SOURCE_FILE_SIZE, KEY_SOURCE_FINGERPRINT, KEY_SOURCE_HEADER, KEY_TENSOR_NAMES, KEY_TENSOR_SHA256, SHARD_KIND_NAMES, ExpertTensor, ModelLayout
from p2pswarm.model.gguf_read import HeaderOnlyReader
from p2pswarm.model.manifest import model_fingerprint

CHUNK_BYTES = 8 << 20
HASH_THREADS = 2  # tensors hashed in parallel (each tensor's hash is sequential)
COPY_CHUNK_BYTES = 64 << 20
Progress = Callable[[int, int], None]  # (bytes done, bytes total)


@dataclass
class SliceResult:
    path: Path
    tensors: dict[str, str]  # name -> sha256 hex
    nbytes: int  # tensor bytes copied
    source_fingerprint: str


def parse_range(text: str, what: str) -> tuple[int, int]:
    """"A-B" (inclusive) or "A" -> half-open (A, B+1)."""
    try:
        if "-" in text:
            a, b = text.split("-", 1)
            lo, hi = int(a), int(b)
        else:
            lo = hi = int(text)
    except ValueError:
        raise UserError(f"bad {what} range {text!r}: expected A-B or A (inclusive, e.g. 0-47)") from None
    if lo < 0 or hi < lo:
        raise UserError(f"bad {what} range {text!r}: need 0 <= A <= B")
    return lo, hi + 1


def split_ranges(n: int, parts: int) -> list[tuple[int, int]]:
    """Split ``range(n)`` into ``parts`` contiguous half-open ranges, sizes differing by at most one."""
    if parts < 1 or parts > n:
        raise UserError(f"cannot split {n} experts among {parts} workers (need 1..{n})")
    base, extra = divmod(n, parts)
    out, lo = [], 0
    for i in range(parts):
        hi = lo + base + (1 if i < extra else 0)
        out.append((lo, hi))
        lo = hi
    return out


def _copied_fields(layout: ModelLayout, keep: Callable[[str], bool]) -> list[bytes]:
    """Raw bytes of the source's metadata fields we keep, copied verbatim."""
    out = []
    for key, f in layout.reader.fields.items():
        if key.startswith("GGUF.") or key.startswith("p2pswarm.") or not keep(key):
            continue
        out.append(layout.field_bytes(f))
    return out


def _alignment(layout: ModelLayout) -> int:
    return int(getattr(layout.reader, "alignment", DEFAULT_ALIGNMENT))


def shard_header(g: GGUFLayout) -> tuple[bytes, list[int]]:
    """Finish ``g`` with the tensor-name and sha256 arrays and return (header bytes, hash slots):
    the header has a 64-character placeholder per tensor at each slot offset, patched by
    :func:`patch_header` once the tensor bytes (and so their hashes) are known."""
    names = [t.name for t in g.tensors]
    placeholder = "0" * 64
    g.add_raw_kv(kv_string_array(KEY_TENSOR_NAMES, names))
    sha_kv_index = len(g.kv)
    g.add_raw_kv(kv_string_array(KEY_TENSOR_SHA256, [placeholder] * len(names)))
    header = g.header()
    # Where the hash slots lie: after the fixed header, the kv entries before ours, our key, the
    # array's type and count, then each string's 8-byte length.
    slot0 = 24 + sum(len(kv) for kv in g.kv[:sha_kv_index]) + 8 + len(KEY_TENSOR_SHA256) + 4 + 4 + 8
    return header, [slot0 + i * (8 + 64) + 8 for i in range(len(names))]


def patch_header(header: bytes, slots: list[int], hashes: list[str]) -> bytes:
    """``header`` with the hex sha256 of tensor i written into slot i."""
    out = bytearray(header)
    for slot, h in zip(slots, hashes, strict=True):
        out[slot: slot + 64] = h.encode()
    return bytes(out)


def _write(
    out_path: Path,
    layout: ModelLayout,
    g: GGUFLayout,
    ranges: list[list[tuple[int, int]]],
    progress: Progress | None,
    fsync: bool = True,
) -> dict[str, str]:
    """Write header + data of ``g`` to ``out_path`` atomically; ``ranges[i]`` are the source byte
    ranges (offset, length) that make up tensor i, in order. Returns name -> sha256."""
    names = [t.name for t in g.tensors]
    header, slots = shard_header(g)

    total = sum(t.nbytes for t in g.tensors)
    tmp = out_path.with_name(f".{out_path.name}.partial-{os.getpid()}")
    srcs: dict[Path, int] = {}
    dst = -1
    pool = ThreadPoolExecutor(max_workers=HASH_THREADS, thread_name_prefix="sha256")
    try:
        for part in layout.parts:  # one file, or each part of a split model
            srcs[part.path] = os.open(part.path, os.O_RDONLY)
        # (fd, offset in its file, length, file) of each range: a split model's are in its parts
        located = [[(srcs[p.path], o, length, p.path) for off, length in parts
                    for p, o in [layout.locate(off, length)]] for parts in ranges]
        dst = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        _pwrite_all(dst, header, 0)
        # Hash every tensor (in threads, from the page cache) while the kernel copies the bytes:
        # sha256 and the copy both run without the GIL, so on 2 cores they overlap.
        futures = [pool.submit(_hash_ranges, parts) for parts in located]
        done = 0
        for t, parts in zip(g.tensors, located):
            dst_off = len(header) + t.offset
            for src, off, length, path in parts:
                for n in _copy_range(src, dst, off, length, dst_off, path):
                    dst_off += n
                    done += n
                    if progress:
                        progress(done, 2 * total)
        hashes: dict[str, str] = {}
        for t, fut in zip(g.tensors, futures):
            hashes[t.name] = fut.result()
            done += t.nbytes
            if progress:
                progress(done, 2 * total)
        for name, slot in zip(names, slots):
            _pwrite_all(dst, hashes[name].encode(), slot)
        if fsync:  # durable before the rename makes it visible
            os.fsync(dst)
        os.close(dst)
        dst = -1
        os.replace(tmp, out_path)
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)
        if dst >= 0:
            os.close(dst)
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    finally:
        pool.shutdown(wait=True)
        for src in srcs.values():
            os.close(src)
    return hashes


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _copy_range(src: int, dst: int, off: int, length: int, dst_off: int, path: Path):
    """Copy [off, off+length) of src to dst at dst_off, in the kernel where it can (like cp does);
    yields the bytes done after each step."""
    while length > 0:
        n = min(length, COPY_CHUNK_BYTES)
        try:
            got = os.copy_file_range(src, dst, n, off, dst_off)
        except OSError:  # no in-kernel copy here (old kernel, other filesystems): read + write
            data = os.pread(src, n, off)
            got = len(data)
            if got:
                _pwrite_all(dst, data, dst_off)
        if got == 0:
            raise UserError(f"{path}: short read at byte {off}: file truncated?")
        off, dst_off, length = off + got, dst_off + got, length - got
        yield got


def _hash_ranges(parts: list[tuple[int, int, int, Path]]) -> str:
    """sha256 of the concatenated source ranges (fd, offset, length, path), read in bounded chunks."""
    h = hashlib.sha256()
    buf = bytearray(CHUNK_BYTES)
    for src, off, length, path in parts:
        while length > 0:
            n = min(length, CHUNK_BYTES)
            view = memoryview(buf)[:n]
            got = os.preadv(src, [view], off)
            if got != n:
                raise UserError(f"{path}: short read at byte {off}: file truncated?")
            h.update(view)
            off, length = off + n, length - n
    return h.hexdigest()


def _check_output(out_path: Path, layout: ModelLayout) -> Path:
    out_path = Path(out_path)
    if out_path.exists() and any(out_path.resolve() == p.path.resolve() for p in layout.parts):
        raise UserError(f"{out_path}: refusing to overwrite the source model")
    if not out_path.parent.exists():
        raise UserError(f"{out_path.parent}: output directory does not exist")
    return out_path


def slice_experts(
    model_path: str | os.PathLike[str],
    out_path: str | os.PathLike[str],
    layers: tuple[int, int] | None,
    experts: tuple[int, int],
    *,
    progress: Progress | None = None,
    layout: ModelLayout | None = None,
    fingerprint: str | None = None,
    fsync: bool = True,
) -> SliceResult:
    """Write the experts ``[experts[0], experts[1])`` of layers ``[layers[0], layers[1])``."""
    layout = layout or ModelLayout.open(model_path)
    plan = plan_expert_shard(layout, layers, experts, fingerprint)
    out_path = _check_output(Path(out_path), layout)
    hashes = _write(out_path, layout, plan.gguf, [[r] for r in plan.ranges], progress, fsync)
    return SliceResult(out_path, hashes, sum(t.nbytes for t in plan.gguf.tensors), plan.fingerprint)


@dataclass
class ShardPlan:
    """What an expert shard holds: its GGUF layout (header not yet finished: see
    :func:`shard_header`) and, for each of its tensors in order, the source tensor and the source
    byte range (offset, length) its data is."""

    gguf: GGUFLayout
    sources: list[ExpertTensor]
    ranges: list[tuple[int, int]]
    layers: tuple[int, int]
    experts: tuple[int, int]
    fingerprint: str


def plan_expert_shard(layout: ModelLayout, layers: tuple[int, int] | None, experts: tuple[int, int],
                      fingerprint: str | None = None) -> ShardPlan:
    """Check a range against a full model's map and lay out the shard :func:`slice_experts` writes.
    Reads only metadata, so ``layout`` may come from :func:`header_layout` (a downloader that has
    the source's header bytes but none of its tensors)."""
    if layout.shard_kind is not None:
        raise UserError(f"{layout.path}: is already {SHARD_KIND_NAMES.get(layout.shard_kind, layout.shard_kind)}; slice the full model")
    moe_layers = layout.expert_layers
    l0, l1 = layers if layers is not None else (moe_layers[0], moe_layers[-1] + 1)
    e0, e1 = experts
    if l1 > layout.n_layer:
        raise UserError(f"layers {l0}-{l1 - 1} out of range: the model has layers 0-{layout.n_layer - 1}")
    if e1 > layout.n_expert:
        raise UserError(f"experts {e0}-{e1 - 1} out of range: the model has experts 0-{layout.n_expert - 1}")
    wanted = [il for il in range(l0, l1) if il in layout.expert_tensors]
    if not wanted:
        raise UserError(f"layers {l0}-{l1 - 1} hold no routed experts")
    fingerprint = fingerprint or model_fingerprint(layout)
    g = GGUFLayout(_alignment(layout))
    keep_prefix = (layout.arch + ".", "general.")
    for raw in _copied_fields(layout, lambda k: k.startswith(keep_prefix)):
        g.add_raw_kv(raw)
    g.add_raw_kv(kv_string(KEY_SHARD_KIND, "experts"))
    g.add_raw_kv(kv_string(KEY_SOURCE_FINGERPRINT, fingerprint))
    g.add_raw_kv(kv_uint32(KEY_LAYER_BEGIN, l0))
    g.add_raw_kv(kv_uint32(KEY_LAYER_END, l1))
    g.add_raw_kv(kv_uint32(KEY_EXPERT_BEGIN, e0))
    g.add_raw_kv(kv_uint32(KEY_EXPERT_END, e1))
    ranges, sources = [], []
    for il in wanted:
        for kind in sorted(layout.expert_tensors[il]):
            t = layout.expert_tensors[il][kind]
            off, length = t.slabs(e0, e1)
            g.add_tensor(t.name, t.ggml_type, (e1 - e0, *t.shape[1:]), length)
            ranges.append((off, length))
            sources.append(t)
    return ShardPlan(g, sources, ranges, (l0, l1), (e0, e1), fingerprint)


def header_layout(header_path: str | os.PathLike[str], file_size: int) -> ModelLayout:
    """The map of a full model of ``file_size`` bytes, from a file holding only its header bytes
    (everything before the first tensor's data). Enough for :func:`plan_expert_shard`."""
    path = Path(header_path)
    try:
        reader = HeaderOnlyReader(path, "r")
    except Exception as exc:  # the reader raises ValueError, struct/numpy/index errors on bad input
        raise ModelFormatError(f"{path}: not a valid GGUF header ({clip(exc, 300)})") from None
    return ModelLayout.open(path, reader=reader, file_size=file_size)


def slice_backbone(
    model_path: str | os.PathLike[str],
    out_path: str | os.PathLike[str],
    *,
    progress: Progress | None = None,
) -> SliceResult:
    """Write every tensor but the routed experts, and all metadata (tokenizer included)."""
    layout = ModelLayout.open(model_path)
    if layout.shard_kind is not None:
        raise UserError(f"{layout.path}: is already {SHARD_KIND_NAMES.get(layout.shard_kind, layout.shard_kind)}; slice the full model")
    out_path = _check_output(Path(out_path), layout)
    fingerprint = model_fingerprint(layout)
    g, ranges = plan_backbone(layout, fingerprint, layout.header_bytes())
    hashes = _write(out_path, layout, g, ranges, progress)
    return SliceResult(out_path, hashes, sum(t.nbytes for t in g.tensors), fingerprint)


def plan_backbone(layout: ModelLayout, fingerprint: str, source_header: bytes
                  ) -> tuple[GGUFLayout, list[list[tuple[int, int]]]]:
    """The backbone file's layout (every tensor but the routed experts, all metadata) and, per
    tensor, its source byte ranges. Shared by :func:`slice_backbone` and the backbone's download
    of its slice (``p2pswarm/net/shards/backbone_fetch.py``), which plans from the source header alone,
    so both write the same bytes."""
    g = GGUFLayout(_alignment(layout))
    for raw in _copied_fields(layout, lambda k: True):
        g.add_raw_kv(raw)
    g.add_raw_kv(kv_string(KEY_SHARD_KIND, "backbone"))
    g.add_raw_kv(kv_string(KEY_SOURCE_FINGERPRINT, fingerprint))
    # The source's header (its experts' names, types, shapes and offsets): a backbone started from
    # this file lays out the experts it lacks from it and fetches their slabs (expert_store.py).
    g.add_raw_kv(kv_string(KEY_SOURCE_HEADER, base64.b64encode(source_header).decode()))
    g.add_raw_kv(kv_string(KEY_SOURCE_FILE_SIZE, str(layout.file_size)))
    ranges = []
    for t in layout.reader.tensors:
        if EXPERT_TENSOR_RE.match(t.name):
            continue
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        g.add_tensor(t.name, t.tensor_type, shape, int(t.n_bytes))
        ranges.append([(int(t.data_offset), int(t.n_bytes))])
    return g, ranges


def verify_shard(path: str | os.PathLike[str]) -> dict[str, str]:
    """Re-hash every tensor of a shard and compare with the sha256 recorded in it; raise on a
    mismatch. Returns name -> sha256."""
    layout = ModelLayout.open(path, require_experts=False)

    f_names = layout.reader.fields.get(KEY_TENSOR_NAMES)
    f_sha = layout.reader.fields.get(KEY_TENSOR_SHA256)
    if f_names is None or f_sha is None:
        raise UserError(f"{path}: not a p2pswarm shard (no per-tensor sha256)")
    recorded = dict(zip(field_value(f_names), field_value(f_sha)))
    for t in layout.reader.tensors:
        got = hashlib.sha256(layout.view(int(t.data_offset), int(t.n_bytes))).hexdigest()
        if recorded.get(t.name) != got:
            raise UserError(f"{path}: tensor {t.name} does not match its recorded sha256")
    return recorded


__all__ = [
    "ShardPlan",
    "SliceResult",
    "header_layout",
    "parse_range",
    "patch_header",
    "plan_expert_shard",
    "shard_header",
    "slice_backbone",
    "slice_experts",
    "split_ranges",
    "verify_shard",
]
