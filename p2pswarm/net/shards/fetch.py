"""The downloading side of ``/p2pswarm/shard/1.0.0``: :func:`fetch_slice` and what it needs
(sessions, the resume journal, verification on disk). Split from ``transfer.py``;
the module doc there says why the download is shaped as it is."""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import trio

from p2pswarm.errors import FrameError, SwarmError, clip, leaves
from p2pswarm.model.gguf_read import field_value
from p2pswarm.model.layout import ModelLayout
from p2pswarm.model.manifest import ManifestError, ModelManifest
from p2pswarm.net.wire.framing import DEFAULT_MAX_FRAME, FrameReader, send_frame
from p2pswarm.net.shards.server import _write_source_sidecar
from p2pswarm.net.shards.wire import (
    JOURNAL_EVERY_S, MAX_ATTEMPTS, MAX_CONTROL_FRAME, PROTOCOL_SHARD, REQUEST_TIMEOUT_S, SHARD_PROTOCOL_VERSION,
    STREAMS_PER_SOURCE, Progress, ShardTransferError, _pack, _unpack,
)
from p2pswarm.net.signed.tokens import shard_scope

log = logging.getLogger("p2pswarm.shard")


# ---- client --------------------------------------------------------------------------------------
@dataclass
class FetchStats:
    slabs_total: int = 0
    slabs_reused: int = 0  # on disk from an earlier, interrupted run (journal)
    slabs_fetched: int = 0
    bytes_fetched: int = 0
    bad_chunks: int = 0  # failed verification, fetched again
    seconds: float = 0.0
    already_complete: bool = False
    refusals: list[str] = field(default_factory=list)


# What a user must start when no shard source is found: said in full, since a worker waiting on one
# otherwise only ever reports that none exists.
NO_SOURCE = ("no shard source for model {model} in the swarm: slices are downloaded from a backbone started "
             "with --manifest M.manifest (`p2pswarm manifest --model M.gguf --key ISSUER.key --out M.manifest`) "
             "or from `p2pswarm serve-shards --model M.gguf --manifest M.manifest --trust-issuer ISSUER_ID "
             "--bootstrap ADDR`; start one of them on the same bootstrap")


class _Session:
    """One stream to one source, past a successful hello."""

    def __init__(self, source_name: str, stream, chunk_max: int):
        self.source = source_name
        self.stream = stream
        self.reader = FrameReader(stream, max(chunk_max, DEFAULT_MAX_FRAME))
        self.chunk_max = chunk_max

    async def call(self, msg: dict) -> dict:
        await send_frame(self.stream, _pack(msg))
        with trio.fail_after(REQUEST_TIMEOUT_S):
            resp = _unpack(await self.reader.read_frame(), f"reply from {self.source}")
        if not resp.get("ok"):
            raise ShardTransferError(f"source {self.source}: {clip(resp.get('error'), 300)}")
        return resp


async def _open_session(net, source, hello: dict) -> _Session:
    name = _source_name(source)
    stream = await net.open_stream(source, PROTOCOL_SHARD)
    try:
        reader = FrameReader(stream, MAX_CONTROL_FRAME)
        await send_frame(stream, _pack(hello))
        with trio.fail_after(REQUEST_TIMEOUT_S):
            resp = _unpack(await reader.read_frame(), f"hello reply from {name}")
        if not resp.get("ok"):
            raise ShardTransferError(f"source {name}: {clip(resp.get('error'), 300)}")
        chunk_max = resp.get("chunk_max")
        if not isinstance(chunk_max, int) or not 0 < chunk_max <= DEFAULT_MAX_FRAME:
            raise ShardTransferError(f"source {name}: bad chunk_max {str(chunk_max)[:20]}")
        s = _Session(name, stream, chunk_max)
        s.reader = reader
        reader.max_frame = max(chunk_max + (64 << 10), DEFAULT_MAX_FRAME)
        return s
    except BaseException:
        await stream.aclose()
        raise


def _source_name(source) -> str:
    if isinstance(source, str):
        return source.rsplit("/", 1)[-1]
    pid = getattr(source, "peer_id", None)
    return pid.to_base58() if pid is not None else clip(source, 200)


@dataclass
class _Slab:
    index: int  # shard tensor index
    name: str
    expert: int  # global expert id
    dst: int  # absolute offset in OUT.part
    length: int
    sha256: bytes
    attempts: int = 0
    bad_sources: set = field(default_factory=set)
    dense: bool = False  # a whole dense tensor (a backbone's slice, backbone_fetch.py): asked with expert None


def _existing_shard_matches(out: Path, model: str, layers, experts) -> bool:
    """Whether ``out`` already is the complete, self-consistent shard asked for."""
    from p2pswarm.model.slicer import verify_shard

    try:
        lay = ModelLayout.open(out, require_experts=False)
        f = lay.reader.fields
        same = (lay.shard_kind == "experts"
                and str(field_value(f["p2pswarm.source.fingerprint"])) == model
                and (int(field_value(f["p2pswarm.shard.layer_begin"])), int(field_value(f["p2pswarm.shard.layer_end"])))
                == tuple(layers)
                and (lay.expert_begin, lay.expert_end) == tuple(experts))
        if not same:
            return False
        verify_shard(out)
        return True
    except (SwarmError, KeyError):
        return False


class _Journal:
    """``OUT.part.journal``: line 1 a JSON description of the download, then one line per slab on
    disk (``<tensor index> <expert>``). Appended only after the data file is fsynced."""

    def __init__(self, path: Path, ident: dict):
        self.path = path
        self.ident = json.dumps(ident, sort_keys=True)

    def load(self) -> set[tuple[int, int]] | None:
        """Finished slabs of an earlier run of this same download, or None (no usable journal)."""
        try:
            lines = self.path.read_text().splitlines()
        except (OSError, UnicodeDecodeError):
            return None
        if not lines or lines[0] != self.ident:
            return None
        done = set()
        for ln in lines[1:]:
            parts = ln.split()
            if len(parts) == 2 and all(p.isdigit() for p in parts):  # a torn last line is ignored
                done.add((int(parts[0]), int(parts[1])))
        return done

    def start(self) -> None:
        with open(self.path, "w") as f:
            f.write(self.ident + "\n")
            f.flush()
            os.fsync(f.fileno())

    def append(self, slabs: list[tuple[int, int]]) -> None:
        with open(self.path, "a") as f:
            f.write("".join(f"{i} {e}\n" for i, e in slabs))
            f.flush()
            os.fsync(f.fileno())


async def fetch_slice(net, *, sources: Sequence, model: str, layers: tuple[int, int], experts: tuple[int, int],
                      out_path, token: str, trusted_issuers: Collection[str], progress: Progress | None = None,
                      stats: FetchStats | None = None, streams_per_source: int = STREAMS_PER_SOURCE,
                      max_attempts: int = MAX_ATTEMPTS, keep_source: bool = False) -> Path:
    """Download experts ``[experts)`` of layers ``[layers)`` (half-open) of model ``model``
    (fingerprint) from ``sources`` (multiaddr strings with /p2p/, or PeerInfo) into ``out_path``:
    the same bytes :func:`p2pswarm.model.slicer.slice_experts` writes. See the module doc for the
    checks; resumes an interrupted run of the same download. Returns the final path.

    ``out_path`` existing already: returned as is if it is that very shard (verified), refused
    otherwise - never overwritten. ``keep_source``: also write ``OUT.source`` (manifest + source
    header), so this node can serve its slice onwards (:func:`load_source_sidecar`)."""
    t0 = time.monotonic()
    stats = stats if stats is not None else FetchStats()
    model = model.lower()
    out = Path(out_path)
    layers, experts = (int(layers[0]), int(layers[1])), (int(experts[0]), int(experts[1]))
    if out.exists():
        if await trio.to_thread.run_sync(_existing_shard_matches, out, model, layers, experts):
            stats.already_complete = True
            log.info("%s already holds this shard (verified): nothing to fetch", out)
            return out
        raise ShardTransferError(f"{out} exists and is not this shard; refusing to overwrite it")
    if not out.parent.is_dir():
        raise ShardTransferError(f"{out.parent}: output directory does not exist")
    if not sources:
        raise ShardTransferError(NO_SOURCE.format(model=model))
    shard_scope(model, layers, experts)  # validates the ranges
    hello = {"op": "hello", "v": SHARD_PROTOCOL_VERSION, "model": model, "layers": list(layers),
             "experts": list(experts), "token": token}

    sessions, per_source = await _connect_all(net, sources, hello, stats)
    try:
        manifest, header_src = await _manifest_and_header(sessions, trusted_issuers, model, stats)
        plan, header, slots, slabs = _plan_slabs(out, manifest, header_src, layers, experts)
        meta = {"v": 1, "model": model, "layers": list(layers), "experts": list(experts)}

        async def sidecar() -> None:
            if keep_source:
                await trio.to_thread.run_sync(_write_source_sidecar, out, manifest, header_src)

        await fetch_into(out, net, sessions, per_source, hello, plan.gguf, header, slots, slabs, meta, stats,
                         progress, streams_per_source, max_attempts, "slabs", sidecar)
    finally:
        for s in sessions:
            await s.stream.aclose()
    stats.seconds = time.monotonic() - t0
    return out


async def fetch_into(out: Path, net, sessions: list, per_source: dict, hello: dict, gguf, header: bytes, slots,
                     slabs: list, meta: dict, stats: FetchStats, progress: Progress | None,
                     streams_per_source: int, max_attempts: int, what: str, before_replace=None) -> None:
    """Fetch ``slabs`` from ``sessions`` into ``OUT.part`` behind ``header``, resumable by the
    journal (``meta`` names what the part holds: a journal of anything else starts over), re-read
    and verified against the manifest from disk (one more round for what fails), then renamed to
    ``out``. Shared by a worker's slice (:func:`fetch_shard`) and a backbone's dense part
    (:mod:`p2pswarm.net.shards.backbone_fetch`). ``before_replace``: an async callable run just before the
    rename (a slice's ``.source`` sidecar)."""
    from p2pswarm.model.slicer import patch_header

    part = out.with_name(out.name + ".part")
    total_size = len(header) + max(t.offset + t.nbytes for t in gguf.tensors)
    stats.slabs_total = len(slabs)
    journal = _Journal(out.with_name(out.name + ".part.journal"),
                       {**meta, "header_sha256": hashlib.sha256(header).hexdigest(), "size": total_size})
    done = journal.load() if part.exists() else None
    if done is None:
        done = set()
        fd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        journal.start()
    else:
        fd = os.open(part, os.O_RDWR)
        log.info("resuming %s: %d of %d %s already on disk", part, len(done), len(slabs), what)
    try:
        await trio.to_thread.run_sync(_prepare_part, fd, header, total_size)
        todo = [s for s in slabs if (s.index, s.expert) not in done]
        stats.slabs_reused = len(slabs) - len(todo)
        total_bytes = sum(s.length for s in slabs)
        progress_state = {"done": sum(s.length for s in slabs if (s.index, s.expert) in done)}
        if progress:
            progress(progress_state["done"], total_bytes)
        for _round in range(2):
            if todo:
                await _download(net, sessions, per_source, hello, todo, fd, journal, stats, progress,
                                progress_state, total_bytes, streams_per_source, max_attempts)
            # Re-read everything from disk: the journal or the disk may lie after a crash.
            hashes, bad = await trio.to_thread.run_sync(_verify_part, fd, gguf, slabs, len(header))
            if not bad:
                break
            log.warning("%d %s on disk do not match the manifest: fetching them again", len(bad), what)
            stats.bad_chunks += len(bad)
            todo = bad
        else:
            raise ShardTransferError(f"{len(bad)} {what} still do not verify after a second round")
        await trio.to_thread.run_sync(_finish_part, fd, patch_header(header, slots, hashes))
    finally:
        os.close(fd)
    if out.exists():
        raise ShardTransferError(f"{out} appeared while downloading; left the result in {part}")
    if before_replace is not None:
        await before_replace()
    os.replace(part, out)
    _fsync_dir(out.parent)
    journal.path.unlink(missing_ok=True)


async def _connect_all(net, sources: Sequence, hello: dict, stats: FetchStats) -> tuple[list[_Session], dict]:
    """A session (past a successful hello) with every source that accepts us, opened at once;
    refusals are logged and kept in ``stats``. Raises when no source accepts."""
    sessions: list[_Session] = []
    per_source: dict[str, object] = {}

    async def connect(src) -> None:
        try:
            first = await _open_session(net, src, hello)
        except (SwarmError, trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError, OSError) as exc:
            msg = str(exc) or type(exc).__name__
            stats.refusals.append(msg)
            log.warning("%s", msg)
            return
        sessions.append(first)
        per_source[first.source] = src

    async with trio.open_nursery() as nursery:
        for src in sources:
            nursery.start_soon(connect, src)
    if not sessions:
        raise ShardTransferError("no source would serve this range: " + clip("; ".join(stats.refusals), 600))
    return sessions, per_source


async def _manifest_and_header(sessions: list[_Session], trusted_issuers: Collection[str], model: str,
                               stats: FetchStats) -> tuple[ModelManifest, bytes]:
    """The signed manifest and the source header from the first source that gives valid ones
    (a trusted issuer, the requested fingerprint, header bytes matching the manifest); sources
    that do not are closed and dropped from ``sessions``."""
    for s in list(sessions):
        try:
            m = ModelManifest.decode((await s.call({"op": "manifest"}))["manifest"])
            m.verify(trusted_issuers=trusted_issuers, fingerprint=model)
            hdr = (await s.call({"op": "header"}))["header"]
            if not isinstance(hdr, bytes) or len(hdr) != m.header_len or \
                    hashlib.sha256(hdr).hexdigest() != m.header_sha256:
                raise ManifestError("header bytes do not match the manifest")
            return m, hdr
        except (SwarmError, KeyError, trio.BrokenResourceError, trio.TooSlowError) as exc:
            log.warning("source %s: %s", s.source, exc)
            stats.refusals.append(f"{s.source}: {exc}")
            sessions.remove(s)
            await s.stream.aclose()
    raise ShardTransferError("no source gave a valid manifest: " + clip("; ".join(stats.refusals[-3:]), 600))


def _plan_slabs(out: Path, manifest: ModelManifest, header_src: bytes, layers, experts):
    """The shard's header (built by the slicer's own code, so the result equals ``slice_experts``)
    and its slabs: where each expert's bytes of each tensor go and the sha256 they must have."""
    from p2pswarm.model.slicer import header_layout, plan_expert_shard, shard_header

    src_header = out.with_name(f".{out.name}.source-header.{os.getpid()}")
    try:
        src_header.write_bytes(header_src)
        lay = header_layout(src_header, manifest.file_size)
        plan = plan_expert_shard(lay, layers, experts, manifest.fingerprint)
    finally:
        src_header.unlink(missing_ok=True)
    header, slots = shard_header(plan.gguf)
    slabs: list[_Slab] = []
    for i, (g_t, src_t) in enumerate(zip(plan.gguf.tensors, plan.sources)):
        d = manifest.tensor(src_t.name)
        if (d.offset, d.nbytes, d.expert_nbytes) != (src_t.data_offset, src_t.nbytes, src_t.expert_nbytes):
            raise ManifestError(f"manifest and header disagree on tensor {src_t.name}")
        for e in range(experts[0], experts[1]):
            slabs.append(_Slab(i, src_t.name, e, len(header) + g_t.offset + (e - experts[0]) * d.expert_nbytes,
                               d.expert_nbytes, d.slab_sha256(e)))
    return plan, header, slots, slabs


def _prepare_part(fd: int, header: bytes, total_size: int) -> None:
    if os.fstat(fd).st_size != total_size:
        os.ftruncate(fd, total_size)
    _pwrite_all(fd, header, 0)


def _finish_part(fd: int, header: bytes) -> None:
    _pwrite_all(fd, header, 0)
    os.fsync(fd)


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _fsync_dir(path: Path) -> None:
    try:
        dfd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)


def _verify_part(fd: int, g, slabs: list[_Slab], header_len: int) -> tuple[list[str], list[_Slab]]:
    """sha256 of every shard tensor as on disk (for the header) and the slabs that do not match the
    manifest. One read pass: each slab is read once and fed to both hashes."""
    by_tensor: dict[int, list[_Slab]] = {}
    for s in slabs:
        by_tensor.setdefault(s.index, []).append(s)
    hashes, bad = [], []
    for i, _t in enumerate(g.tensors):
        h = hashlib.sha256()
        for s in sorted(by_tensor[i], key=lambda s: s.dst):
            data = os.pread(fd, s.length, s.dst)
            h.update(data)
            if len(data) != s.length or hashlib.sha256(data).digest() != s.sha256:
                bad.append(_Slab(s.index, s.name, s.expert, s.dst, s.length, s.sha256, dense=s.dense))
        hashes.append(h.hexdigest())
    return hashes, bad


async def _download(net, sessions: list[_Session], per_source: dict, hello: dict, todo: list[_Slab], fd: int,
                    journal: _Journal, stats: FetchStats, progress: Progress | None, progress_state: dict,
                    total_bytes: int, streams_per_source: int, max_attempts: int) -> None:
    """Fetch ``todo`` with ``streams_per_source`` streams per live source; each slab is verified
    against the manifest before it is written, re-queued (preferring another source) if not."""
    send, recv = trio.open_memory_channel[_Slab](math.inf)
    remaining = len(todo)
    for s in todo:
        send.send_nowait(s)
    finished: list[tuple[int, int]] = []
    last_flush = [time.monotonic()]
    flush_lock = trio.Lock()
    failures: list[str] = []
    live_sources = {s.source for s in sessions}
    workers_of: dict[str, int] = {}

    async def flush(force: bool = False) -> None:
        async with flush_lock:
            if not finished or (not force and time.monotonic() - last_flush[0] < JOURNAL_EVERY_S):
                return
            batch = list(finished)
            finished.clear()
            await trio.to_thread.run_sync(os.fsync, fd)  # the data first, then the journal that names it
            await trio.to_thread.run_sync(journal.append, batch)
            last_flush[0] = time.monotonic()

    async def fetch_one(sess: _Session, slab: _Slab) -> bytes:
        parts = []
        for off in range(0, slab.length, sess.chunk_max):
            n = min(sess.chunk_max, slab.length - off)
            resp = await sess.call({"op": "chunk", "tensor": slab.name, "expert": None if slab.dense else slab.expert,
                                    "offset": off, "length": n})
            data = resp.get("data")
            if not isinstance(data, bytes) or len(data) != n:
                raise ShardTransferError(f"source {sess.source}: chunk of the wrong size")
            parts.append(data)
        return b"".join(parts) if len(parts) != 1 else parts[0]

    async def worker(sess: _Session, own: bool) -> None:
        nonlocal remaining
        try:
            async for slab in recv:
                if sess.source in slab.bad_sources and live_sources - slab.bad_sources:
                    send.send_nowait(slab)  # let another source's worker take it
                    await trio.sleep(0.01)
                    continue
                try:
                    data = await fetch_one(sess, slab)
                except (ShardTransferError, trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError,
                        FrameError) as exc:
                    slab.attempts += 1
                    failures.append(f"{sess.source}: {exc}")
                    send.send_nowait(slab)
                    log.warning("source %s failed (%s); its stream is dropped", sess.source, exc)
                    return
                ok = await trio.to_thread.run_sync(lambda d=data, want=slab.sha256: hashlib.sha256(d).digest() == want)
                if not ok:
                    stats.bad_chunks += 1
                    slab.attempts += 1
                    slab.bad_sources.add(sess.source)
                    log.warning("%s expert %d from %s does not match the manifest's sha256 (attempt %d): "
                                "fetching it again", slab.name, slab.expert, sess.source, slab.attempts)
                    if slab.attempts >= max_attempts:
                        failures.append(f"{slab.name} expert {slab.expert} failed verification "
                                        f"{slab.attempts} times")
                        raise ShardTransferError(failures[-1])
                    send.send_nowait(slab)
                    continue
                await trio.to_thread.run_sync(_pwrite_all, fd, data, slab.dst)
                stats.slabs_fetched += 1
                stats.bytes_fetched += len(data)
                finished.append((slab.index, slab.expert))
                progress_state["done"] += len(data)
                if progress:
                    progress(progress_state["done"], total_bytes)
                remaining -= 1
                if remaining == 0:
                    send.close()
                    return
                await flush()
        finally:
            workers_of[sess.source] -= 1
            if not workers_of[sess.source]:
                live_sources.discard(sess.source)  # its slabs must not wait for it any more
            if own:
                await sess.stream.aclose()

    def start(nursery, sess: _Session, own: bool) -> None:
        workers_of[sess.source] = workers_of.get(sess.source, 0) + 1
        nursery.start_soon(worker, sess, own)

    try:
        async with trio.open_nursery() as nursery:
            for sess in list(sessions):
                start(nursery, sess, False)
                for _ in range(max(0, streams_per_source - 1)):
                    try:
                        extra = await _open_session(net, per_source[sess.source], hello)
                    except (SwarmError, trio.BrokenResourceError, trio.TooSlowError) as exc:
                        log.debug("extra stream to %s: %s", sess.source, exc)
                        break
                    start(nursery, extra, True)
    except BaseExceptionGroup as group:  # callers want our one-line error, not trio's wrapping
        # Several streams can give up at the same moment (a source that corrupts everything):
        # one error of ours says it; the others are the same failure on other slabs.
        found = leaves(group)
        ours = [e for e in found if isinstance(e, SwarmError)]
        if ours and len(ours) == len(found):
            if len(ours) > 1 and isinstance(ours[0], ShardTransferError):
                raise ShardTransferError(f"{ours[0]} (and {len(ours) - 1} more failures like it)") from None
            raise ours[0] from None
        raise
    finally:
        with trio.CancelScope(shield=True):
            await flush(force=True)  # what is on disk stays usable for a resume
    if remaining:
        raise ShardTransferError(f"{remaining} slabs could not be fetched: every source failed "
                                 f"({clip('; '.join(failures[-3:]), 600)})")


