"""Model fingerprints and per-tensor hashes.

The *model fingerprint* names a model in every handshake and DHT key: two nodes that disagree on it
must refuse each other. Hashing all 77 GB of a real model would make every start and every slice
take minutes, so the fingerprint hashes what distinguishes models cheaply and surely:

* the whole header (every metadata key and the tensor table: names, types, shapes, offsets), and
* a sample of every tensor's bytes: its first and last 4 KiB.

Two fine-tunes of one architecture differ in their weights everywhere, so the samples separate
them; a re-quantisation changes the tensor table. The full per-tensor sha256 (what a downloader
checks every byte against) lives in the shard files the slicer writes and in the signed manifest
(:class:`ModelManifest`, below), which also hashes each expert's slab so any range can be checked.
"""
from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import msgpack

from p2pswarm.errors import UserError
from p2pswarm.model.gguf_read import field_value
from p2pswarm.model.layout import EXPERT_TENSOR_RE, KEY_SOURCE_FINGERPRINT, ModelLayout
from p2pswarm.signatures import verify_peer_signature

SAMPLE_BYTES = 4096
FINGERPRINT_VERSION = b"p2pswarm-fingerprint-v1"


def model_fingerprint(layout: ModelLayout) -> str:
    """Hex sha256 fingerprint of a full model file (see module doc). Cheap: O(number of tensors)."""
    h = hashlib.sha256(FINGERPRINT_VERSION)
    h.update(layout.header_bytes())  # a split model's: the merged file's, so both name one model
    for t in layout.reader.tensors:
        n = int(t.n_bytes)
        start = int(t.data_offset)
        head = layout.view(start, min(n, SAMPLE_BYTES))
        tail = layout.view(start + max(0, n - SAMPLE_BYTES), min(n, SAMPLE_BYTES))
        h.update(t.name.encode())
        h.update(head.tobytes())
        h.update(tail.tobytes())
    return h.hexdigest()


def source_fingerprint(layout: ModelLayout) -> str:
    """The fingerprint of the model a file belongs to: its own for a full model, the recorded
    source's for a shard or backbone file the slicer wrote."""
    f = layout.reader.fields.get(KEY_SOURCE_FINGERPRINT)
    if f is not None:
        return str(field_value(f))
    return model_fingerprint(layout)


# ---- the signed model manifest -----------------------------------------------------------------
# What a downloader checks every byte against. Why a separate signed file and not the shards' own
# recorded hashes: a shard's hashes cover that shard's range only, and anyone can write a shard. The
# manifest covers every tensor of the full model (and each expert's slab of each expert tensor,
# so any expert range can be checked without trusting the server's cut) and is signed by an issuer
# the downloader already trusts (the same issuer keys that sign node tokens).
#
# Wire form (msgpack): {"body": bin, "sig": bin}; sig is Ed25519 over
# b"p2pswarm-manifest-v1\0" + body by the key the issuer's peer id embeds. body is a msgpack map:
#   v: 1, issuer: str (peer id), issued_at: int, fingerprint: str (hex), arch: str,
#   file_size: int, header_len: int (bytes before the first tensor's data),
#   header_sha256: str (hex, of bytes [0, header_len)), alignment: int,
#   tensors: [[name: str, ggml_type: int, shape: [int] (numpy order), offset: int (absolute),
#              nbytes: int, sha256: bin(32), expert_nbytes: int (0 if not a routed-expert tensor),
#              slabs: bin (32 bytes per expert, concatenated; empty if not an expert tensor)], ...]

MANIFEST_VERSION = 1
MANIFEST_DOMAIN = b"p2pswarm-manifest-v1\x00"
MAX_MANIFEST_BYTES = 256 << 20  # 36,864 slabs of a 122B model take ~1.2 MB; headroom for huge models
MANIFEST_HASH_THREADS = 2
_READ_BYTES = 8 << 20


class ManifestError(UserError):
    """A manifest that is malformed, forged, from an untrusted issuer or for another model."""


@dataclass(frozen=True)
class TensorDigest:
    """One tensor of the full model: where it lies, its sha256, and each expert slab's sha256."""

    name: str
    ggml_type: int
    shape: tuple[int, ...]  # numpy order (outermost first)
    offset: int  # absolute byte offset in the model file
    nbytes: int
    sha256: bytes  # 32 bytes
    expert_nbytes: int = 0  # 0: not a routed-expert tensor
    slabs: bytes = b""  # 32 bytes per expert

    @property
    def n_expert(self) -> int:
        return len(self.slabs) // 32

    def slab_sha256(self, expert: int) -> bytes:
        if not 0 <= expert < self.n_expert:
            raise ManifestError(f"{self.name}: no expert {expert} in the manifest")
        return self.slabs[32 * expert: 32 * expert + 32]

    def to_wire(self) -> list:
        return [self.name, self.ggml_type, list(self.shape), self.offset, self.nbytes, self.sha256,
                self.expert_nbytes, self.slabs]


@dataclass(frozen=True)
class ModelManifest:
    issuer: str
    issued_at: int
    fingerprint: str
    arch: str
    file_size: int
    header_len: int
    header_sha256: str
    alignment: int
    tensors: tuple[TensorDigest, ...]
    signature: bytes = b""
    body: bytes = b""  # the signed bytes, as made or received

    def tensor(self, name: str) -> TensorDigest:
        for t in self.tensors:
            if t.name == name:
                return t
        raise ManifestError(f"tensor {name!r} is not in the manifest")

    def _body(self) -> bytes:
        return msgpack.packb({"v": MANIFEST_VERSION, "issuer": self.issuer, "issued_at": self.issued_at,
                              "fingerprint": self.fingerprint, "arch": self.arch, "file_size": self.file_size,
                              "header_len": self.header_len, "header_sha256": self.header_sha256,
                              "alignment": self.alignment, "tensors": [t.to_wire() for t in self.tensors]},
                             use_bin_type=True)

    def sign(self, issuer) -> ModelManifest:
        """Signed by ``issuer`` (a :class:`p2pswarm.net.signed.identity.Identity`)."""
        unsigned = ModelManifest(**{**self.__dict__, "issuer": issuer.peer_id_str, "signature": b"", "body": b""})
        body = unsigned._body()
        return ModelManifest(**{**unsigned.__dict__, "signature": issuer.sign(MANIFEST_DOMAIN + body), "body": body})

    def encode(self) -> bytes:
        return msgpack.packb({"body": self.body, "sig": self.signature}, use_bin_type=True)

    @classmethod
    def decode(cls, data: bytes) -> ModelManifest:
        """Parse (not verify) a manifest; ManifestError for anything malformed."""
        if not isinstance(data, (bytes, bytearray)) or len(data) > MAX_MANIFEST_BYTES:
            raise ManifestError("malformed manifest: not bytes, or too large")
        try:
            outer = msgpack.unpackb(data, raw=False, strict_map_key=True, max_bin_len=MAX_MANIFEST_BYTES)
            body, sig = outer["body"], outer["sig"]
            b = msgpack.unpackb(body, raw=False, strict_map_key=True, max_bin_len=MAX_MANIFEST_BYTES)
            if b.get("v") != MANIFEST_VERSION:
                raise ManifestError(f"manifest version {b.get('v')!r} is not {MANIFEST_VERSION}")
            tensors = []
            for w in b["tensors"]:
                name, gt, shape, off, nb, sha, enb, slabs = w
                if not (isinstance(name, str) and isinstance(sha, bytes) and len(sha) == 32
                        and isinstance(slabs, bytes) and len(slabs) % 32 == 0):
                    raise ValueError("tensor entry")
                tensors.append(TensorDigest(name, int(gt), tuple(int(d) for d in shape), int(off), int(nb), sha,
                                            int(enb), slabs))
            m = cls(str(b["issuer"]), int(b["issued_at"]), str(b["fingerprint"]), str(b["arch"]),
                    int(b["file_size"]), int(b["header_len"]), str(b["header_sha256"]), int(b["alignment"]),
                    tuple(tensors), bytes(sig), bytes(body))
        except ManifestError:
            raise
        except Exception as exc:  # msgpack, key, type and unpacking errors: all mean malformed
            raise ManifestError(f"malformed manifest ({type(exc).__name__})") from None
        return m

    def verify(self, *, trusted_issuers, fingerprint: str | None = None) -> ModelManifest:
        """The manifest, if a trusted issuer signed it and it is for ``fingerprint``."""
        if not verify_peer_signature(self.issuer, MANIFEST_DOMAIN + self.body, self.signature):
            raise ManifestError(f"manifest signature does not verify (claims issuer {self.issuer})")
        if self.issuer not in set(trusted_issuers):
            raise ManifestError(f"manifest issuer {self.issuer} is not trusted")
        if fingerprint is not None and self.fingerprint != fingerprint.lower():
            raise ManifestError(f"manifest is for model {self.fingerprint}, not the requested "
                                f"{fingerprint}")
        return self


def _digest_tensor(fd: int, path: Path, off: int, nbytes: int, expert_nbytes: int,
                   progress: Callable[[int], None] | None) -> tuple[bytes, bytes]:
    """sha256 of a tensor and (for an expert tensor) of each expert slab, in one read pass."""
    whole = hashlib.sha256()
    slabs = bytearray()
    step = expert_nbytes if expert_nbytes else nbytes
    pos, end = off, off + nbytes
    buf = bytearray(min(_READ_BYTES, max(step, 1)))
    while pos < end:
        slab_end = min(pos + step, end)
        part = hashlib.sha256() if expert_nbytes else None
        while pos < slab_end:
            n = min(len(buf), slab_end - pos)
            view = memoryview(buf)[:n]
            got = os.preadv(fd, [view], pos)
            if got != n:
                raise UserError(f"{path}: short read at byte {pos}: file truncated?")
            whole.update(view)
            if part is not None:
                part.update(view)
            pos += n
            if progress:
                progress(n)
        if part is not None:
            slabs += part.digest()
    return whole.digest(), bytes(slabs)


def build_manifest(model_path, issuer, *, progress: Callable[[int, int], None] | None = None,
                   threads: int = MANIFEST_HASH_THREADS, now: float | None = None) -> ModelManifest:
    """Hash every byte of a full model (tensors in parallel threads: sha256 releases the GIL) and
    sign the result with ``issuer``."""
    layout = ModelLayout.open(model_path)
    if layout.shard_kind is not None:
        raise UserError(f"{layout.path}: is a {layout.shard_kind} file, not a full model: a manifest "
                        f"describes the full model")
    reader = layout.reader
    header = layout.header_bytes()  # a split model is described as its merged file (split_gguf)
    header_len = len(header)
    total = sum(int(t.n_bytes) for t in reader.tensors)
    done = [0]
    lock = threading.Lock()

    def tick(n: int) -> None:
        with lock:
            done[0] += n
            if progress:
                progress(done[0], total)

    jobs = []
    for t in reader.tensors:
        m = EXPERT_TENSOR_RE.match(t.name)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        expert_nbytes = int(t.n_bytes) // shape[0] if m else 0
        jobs.append((t.name, int(t.tensor_type), shape, int(t.data_offset), int(t.n_bytes), expert_nbytes))
    fds = {}
    try:
        for part in layout.parts:
            fds[part.path] = os.open(part.path, os.O_RDONLY)
        with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="manifest-sha256") as pool:
            futs = []
            for (_n, _g, _s, off, nb, enb) in jobs:
                part, part_off = layout.locate(off, nb)
                futs.append(pool.submit(_digest_tensor, fds[part.path], part.path, part_off, nb, enb, tick))
            digests = [f.result() for f in futs]
    finally:
        for fd in fds.values():
            os.close(fd)
    tensors = tuple(TensorDigest(n, g, s, off, nb, whole, enb, slabs)
                    for (n, g, s, off, nb, enb), (whole, slabs) in zip(jobs, digests))
    unsigned = ModelManifest(issuer="", issued_at=int(time.time() if now is None else now),
                             fingerprint=model_fingerprint(layout), arch=layout.arch, file_size=layout.file_size,
                             header_len=header_len, header_sha256=hashlib.sha256(header).hexdigest(),
                             alignment=int(getattr(reader, "alignment", 32)), tensors=tensors)
    return unsigned.sign(issuer)


def write_manifest(manifest: ModelManifest, out_path) -> Path:
    """Write atomically (temporary name, fsync, rename)."""
    out = Path(out_path)
    if not out.parent.exists():
        raise UserError(f"{out.parent}: output directory does not exist")
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(manifest.encode())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return out


def read_manifest(path) -> ModelManifest:
    path = Path(path)
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise ManifestError(f"manifest {path}: {exc.strerror or exc}") from None
    if size > MAX_MANIFEST_BYTES:
        raise ManifestError(f"manifest {path}: {size} bytes is too large to be a manifest")
    try:
        return ModelManifest.decode(path.read_bytes())
    except ManifestError as exc:
        raise ManifestError(f"manifest {path}: {exc}") from None
