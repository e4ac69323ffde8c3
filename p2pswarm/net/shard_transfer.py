"""`/p2pswarm/shard/1.0.0`: a worker downloads only its slice of a model from peers that hold it.

Why this shape:

* **Token-gated.** Serving experts costs the server bandwidth, so every stream starts with a
  ``hello`` carrying a node token; the server checks it (:class:`p2pswarm.net.tokens.TokenGate`)
  against the peer id Noise authenticated for the connection and the exact range asked for
  (:func:`shard_scope`). Nothing - not even the manifest - is served before that.
* **Trust the manifest, not the server.** The client checks the model's signed manifest (a trusted
  issuer, the requested fingerprint) and every expert slab against the sha256 the manifest lists
  *before* writing it; a bad chunk is fetched again (from another source when there is one), never
  written. A lying server can waste time, not plant weights.
* **Resumable.** Data goes to ``OUT.part`` at its final offset; a sidecar journal ``OUT.part.journal``
  lists the slabs that are on disk (appended only after the data is fsynced). A killed download
  re-run with the same arguments fetches only what the journal does not list. Before the rename,
  every slab is re-read from disk and checked against the manifest again.
* **Byte-identical to the slicer.** The shard's header is built by the slicer's own code
  (:func:`p2pswarm.model.slicer.plan_expert_shard`) from the source header bytes (checked against
  the manifest), so a downloaded shard equals ``slice_experts`` on the full model.

Messages (msgpack maps in :mod:`p2pswarm.net.framing` frames; see docs/protocol.md): ``hello``,
``manifest``, ``header``, ``chunk`` (one piece, at most ``chunk_max`` bytes, of one expert's slab
of one tensor). Hashing and file I/O run in threads (``trio.to_thread``), off the event loop.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
import trio

from p2pswarm.errors import FrameError, UserError, clip
from p2pswarm.model.layout import EXPERT_TENSOR_RE, ModelLayout, field_value
from p2pswarm.model.manifest import (
    ManifestError,
    ModelManifest,
    model_fingerprint,
    source_fingerprint,
)
from p2pswarm.net.framing import DEFAULT_MAX_FRAME, FrameReader, send_frame
from p2pswarm.net.tokens import TokenError, TokenGate, shard_scope

log = logging.getLogger("p2pswarm.shard")

PROTOCOL_SHARD = "/p2pswarm/shard/1.0.0"
SHARD_PROTOCOL_VERSION = 1
CHUNK_MAX = 4 << 20  # bytes of tensor data per chunk frame
SOURCE_KEY_PREFIX = "/p2pswarm/source/"
STREAMS_PER_SOURCE = 4  # requests in flight per source (one per stream: the protocol is request/response)
MAX_ATTEMPTS = 4  # per slab: a slab that fails verification this often aborts the download
JOURNAL_EVERY_S = 0.5  # how often finished slabs are made durable and journaled
REQUEST_TIMEOUT_S = 60.0
MAX_CONTROL_FRAME = 64 << 10

Progress = Callable[[int, int], None]


class ShardTransferError(UserError):
    """A download that cannot proceed (no source would serve, a slab that never verifies, ...)."""


# ---- DHT discovery -----------------------------------------------------------------------------
def source_key(model: str) -> bytes:
    """DHT provider key of "I serve every expert of model M": a sha2-256 multihash of
    ``/p2pswarm/source/<fingerprint>`` (Kademlia keys must be multihashes; see dht.py)."""
    return b"\x12\x20" + hashlib.sha256((SOURCE_KEY_PREFIX + model.lower()).encode()).digest()


async def advertise_source(dht, model: str, *, interval_s: float = 3600.0,
                           task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Provide :func:`source_key` now and every ``interval_s`` (provider records expire), until
    cancelled. Run by a backbone (it holds every expert) beside :func:`serve_shards`."""
    n = await dht.provide(source_key(model))
    log.info("providing shard source for model %s (%d peers took it)", model[:12], n)
    task_status.started()
    while True:
        await trio.sleep(interval_s)
        await dht.provide(source_key(model))


async def find_sources(dht, model: str, *, timeout_s: float = 20.0) -> list:
    """Peers (PeerInfo) that provide the source key of ``model``, ourselves excluded."""
    found = await dht.find_providers(source_key(model), timeout_s=timeout_s)
    return [p for p in found if p.peer_id != dht.peer_id]


async def run_shard_source(net, dht, model_path, manifest: ModelManifest, gate: TokenGate, *,
                           task_status=trio.TASK_STATUS_IGNORED, **kw) -> None:
    """The backbone side in one call: serve ``/p2pswarm/shard/1.0.0`` from the full model and keep
    the source key provided (``dht`` may be None: serve only, for peers given our address).
    ``task_status.started(server)`` once serving; runs until cancelled."""
    server = serve_shards(net, model_path, manifest, gate, **kw)
    try:
        if dht is not None:
            async with trio.open_nursery() as nursery:
                await nursery.start(advertise_source, dht, manifest.fingerprint)
                task_status.started(server)
                await trio.sleep_forever()
        else:
            task_status.started(server)
            await trio.sleep_forever()
    finally:
        net.remove_handler(PROTOCOL_SHARD)
        server.close()


async def fetch_slice_from_swarm(net, dht, *, model: str, layers: tuple[int, int], experts: tuple[int, int],
                                 out_path, token: str, trusted_issuers: Collection[str], extra_sources: Sequence = (),
                                 progress: Progress | None = None, stats: FetchStats | None = None,
                                 find_timeout_s: float = 20.0, keep_source: bool = False) -> Path:
    """The worker side in one call: find the model's sources through the DHT (plus
    ``extra_sources``) and :func:`fetch_slice` from them. Returns at once, without a look-up, when
    ``out_path`` already is the requested shard."""
    out = Path(out_path)
    if out.exists() and await trio.to_thread.run_sync(_existing_shard_matches, out, model.lower(), layers, experts):
        if stats is not None:
            stats.already_complete = True
        return out
    sources = list(extra_sources)
    if dht is not None:
        found = await find_sources(dht, model, timeout_s=find_timeout_s)
        log.info("found %d shard source(s) for model %s through the DHT", len(found), model[:12])
        sources += found
    return await fetch_slice(net, sources=sources, model=model, layers=layers, experts=experts, out_path=out,
                             token=token, trusted_issuers=trusted_issuers, progress=progress, stats=stats,
                             keep_source=keep_source)


# ---- wire helpers --------------------------------------------------------------------------------
def _pack(msg: dict) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def _unpack(data: bytes | None, what: str) -> dict:
    if data is None:
        raise trio.BrokenResourceError(f"{what}: stream closed")
    try:
        msg = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception:  # noqa: BLE001 - any decoding failure of peer input means "not msgpack"
        raise FrameError(f"{what}: not msgpack") from None
    if not isinstance(msg, dict):
        raise FrameError(f"{what}: not a map")
    return msg


def _range_of(x: object, what: str, limit: int) -> tuple[int, int]:
    if (not isinstance(x, list) or len(x) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in x)
            or not 0 <= x[0] < x[1] <= limit):
        raise ValueError(f"bad {what} range {str(x)[:40]} (need [begin, end) within 0..{limit})")
    return x[0], x[1]


# ---- server --------------------------------------------------------------------------------------
@dataclass
class ShardServerStats:
    streams: int = 0
    refused: int = 0
    chunks: int = 0
    bytes: int = 0
    corrupted: int = 0  # fault injection (tests) only
    malformed: int = 0  # streams closed over a malformed or oversized frame


class ShardServer:
    """Serves expert slabs to token holders, from a full model file (a backbone: every expert) or
    from an expert shard (a worker: its own slice; needs the source model's header bytes, which
    :func:`fetch_slice` keeps with ``keep_source=True``). Made by :func:`serve_shards`.

    ``delay_s`` and ``corrupt_chunks`` are fault injection for the tests (a throttle that widens the
    window for a kill, and a byte flipped in the Nth chunk served); no command sets them
    (``tests/helpers/faulty_serve_shards.py`` runs ``serve-shards`` with them)."""

    def __init__(self, model_path, manifest: ModelManifest, gate: TokenGate, *, source_header: bytes | None = None,
                 chunk_max: int = CHUNK_MAX, delay_s: float = 0.0, corrupt_chunks: Collection[int] = ()):
        self.layout = ModelLayout.open(model_path)
        self.manifest = manifest
        self.gate = gate
        self.chunk_max = chunk_max
        self.delay_s = delay_s
        self.corrupt_chunks = set(corrupt_chunks)
        self.stats = ShardServerStats()
        self._manifest_bytes = manifest.encode()
        # name -> (layer, absolute offset of expert `first` in our file, expert_nbytes, first)
        self._experts: dict[str, tuple[int, int, int, int]] = {}
        lay = self.layout
        if lay.shard_kind is None:
            fp = model_fingerprint(lay)
            self.held = ((0, lay.n_layer), (0, lay.n_expert))
            for t in manifest.tensors:
                m = EXPERT_TENSOR_RE.match(t.name)
                if m and t.expert_nbytes:
                    self._experts[t.name] = (int(m.group(1)), t.offset, t.expert_nbytes, 0)
            with open(lay.path, "rb") as f:
                self._header = f.read(manifest.header_len)
        elif lay.shard_kind == "experts":
            fp = source_fingerprint(lay)
            if source_header is None:
                raise UserError(f"{lay.path}: serving a shard needs its source model's header "
                                f"(fetch with keep_source=True)")
            self._header = source_header
            layers = lay.expert_layers
            self.held = ((layers[0], layers[-1] + 1), (lay.expert_begin, lay.expert_end))
            if layers != list(range(layers[0], layers[-1] + 1)):
                raise UserError(f"{lay.path}: its layers are not contiguous")
            for il, kinds in lay.expert_tensors.items():
                for t in kinds.values():
                    d = manifest.tensor(t.name)
                    if d.expert_nbytes != t.expert_nbytes:
                        raise ManifestError(f"{lay.path}: {t.name} does not match the manifest")
                    self._experts[t.name] = (il, t.data_offset, t.expert_nbytes, lay.expert_begin)
        else:
            raise UserError(f"{lay.path}: a {lay.shard_kind} file holds no experts to serve")
        if fp != manifest.fingerprint:
            raise ManifestError(f"manifest is for model {manifest.fingerprint}, but {lay.path} is {fp}")
        if hashlib.sha256(self._header).hexdigest() != manifest.header_sha256:
            raise ManifestError(f"{lay.path}: source header does not match the manifest's sha256")
        self._fd = os.open(lay.path, os.O_RDONLY)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    async def handle(self, stream) -> None:
        """One client stream: hello (token check), then requests until the client closes."""
        self.stats.streams += 1
        peer = stream.peer_id.to_base58() if stream.peer_id is not None else "?"
        reader = FrameReader(stream, MAX_CONTROL_FRAME)
        tally = [0, 0]  # chunks, bytes served on this stream
        try:
            await self._serve(stream, reader, peer, tally)
        except FrameError as exc:  # a malformed or oversized frame: refuse it, close this stream only
            self.stats.malformed += 1
            log.warning("closing shard stream from %s: %s", peer, exc)
            with trio.move_on_after(2):
                try:
                    await send_frame(stream, _pack({"ok": False, "error": str(exc)}))
                except (trio.BrokenResourceError, trio.ClosedResourceError, FrameError):
                    pass
        finally:
            if tally[0]:
                log.info("shard server: served %d chunks (%.1f MB) to %s", tally[0], tally[1] / 1e6, peer)

    async def _serve(self, stream, reader: FrameReader, peer: str, tally: list[int]) -> None:
        """Hello (token check), then requests until the client closes; FrameError on bad input."""
        hello = _unpack(await reader.read_frame(), "hello")
        granted = self._check_hello(hello, peer)
        if isinstance(granted, str):
            self.stats.refused += 1
            await send_frame(stream, _pack({"ok": False, "error": granted}))
            return
        (l0, l1), (e0, e1) = granted
        await send_frame(stream, _pack({"ok": True, "v": SHARD_PROTOCOL_VERSION, "chunk_max": self.chunk_max}))
        while True:
            data = await reader.read_frame()
            if data is None:
                return
            req = _unpack(data, "request")
            op = req.get("op")
            if op == "manifest":
                await send_frame(stream, _pack({"ok": True, "manifest": self._manifest_bytes}))
            elif op == "header":
                await send_frame(stream, _pack({"ok": True, "header": self._header}))
            elif op == "chunk":
                try:
                    off, length = self._chunk_range(req, (l0, l1), (e0, e1))
                except ValueError as exc:
                    await send_frame(stream, _pack({"ok": False, "error": str(exc)}))
                    continue
                if self.delay_s:
                    await trio.sleep(self.delay_s)
                chunk = await trio.to_thread.run_sync(os.pread, self._fd, length, off)
                if len(chunk) != length:
                    await send_frame(stream, _pack({"ok": False, "error": "short read on the server"}))
                    return
                self.stats.chunks += 1
                if self.stats.chunks in self.corrupt_chunks:
                    chunk = bytes([chunk[0] ^ 0xFF]) + chunk[1:]
                    self.stats.corrupted += 1
                    log.warning("fault injection: corrupted chunk %d (%s expert %s)", self.stats.chunks,
                                req.get("tensor"), req.get("expert"))
                self.stats.bytes += length
                tally[0] += 1
                tally[1] += length
                await send_frame(stream, _pack({"ok": True, "data": chunk}))
            else:
                await send_frame(stream, _pack({"ok": False, "error": f"unknown op {str(op)[:20]!r}"}))

    def _check_hello(self, hello: dict, peer: str) -> tuple[tuple[int, int], tuple[int, int]] | str:
        """The granted (layers, experts), or the refusal reason (already logged and counted)."""
        if hello.get("op") != "hello" or hello.get("v") != SHARD_PROTOCOL_VERSION:
            return f"expected hello of protocol version {SHARD_PROTOCOL_VERSION}"
        model = hello.get("model")
        if model != self.manifest.fingerprint:
            return f"this server serves model {self.manifest.fingerprint}, not {clip(model, 80)}"
        try:
            layers = _range_of(hello.get("layers"), "layer", self.layout.n_layer)
            experts = _range_of(hello.get("experts"), "expert", self.layout.n_expert)
        except ValueError as exc:
            return str(exc)
        (hl0, hl1), (he0, he1) = self.held
        if not (hl0 <= layers[0] and layers[1] <= hl1 and he0 <= experts[0] and experts[1] <= he1):
            return f"this source holds layers {hl0}-{hl1 - 1}, experts {he0}-{he1 - 1} only"
        token = hello.get("token")
        try:
            self.gate.check(token if isinstance(token, str) else None, peer=peer,
                            scope=shard_scope(model, layers, experts))
        except TokenError as exc:
            return f"refused: {exc}"
        return layers, experts

    def _chunk_range(self, req: dict, layers: tuple[int, int], experts: tuple[int, int]) -> tuple[int, int]:
        name, expert, off, length = req.get("tensor"), req.get("expert"), req.get("offset"), req.get("length")
        t = self._experts.get(name) if isinstance(name, str) else None
        if t is None:
            raise ValueError(f"{str(name)[:60]!r} is not a routed-expert tensor of this model")
        layer, base, enb, first = t
        if not layers[0] <= layer < layers[1]:
            raise ValueError(f"layer {layer} is outside the granted layers {layers[0]}-{layers[1] - 1}")
        if not (isinstance(expert, int) and experts[0] <= expert < experts[1]):
            raise ValueError(f"expert {str(expert)[:10]} is outside the granted experts {experts[0]}-{experts[1] - 1}")
        if not (isinstance(off, int) and isinstance(length, int) and 0 <= off and 0 < length <= self.chunk_max
                and off + length <= enb):
            raise ValueError(f"bad chunk range {off}+{length} (slab of {enb} bytes, at most {self.chunk_max} a chunk)")
        return base + (expert - first) * enb + off, length


def serve_shards(net, model_path, manifest: ModelManifest, gate: TokenGate, **kw) -> ShardServer:
    """Serve ``/p2pswarm/shard/1.0.0`` on ``net`` (a :class:`p2pswarm.net.host.NetHost`) from a full
    model file, or from an expert shard with ``source_header=`` (see :func:`load_source_sidecar`).
    Returns the server (its ``stats``, ``held`` range, and ``gate.refused``/``gate.accepted``)."""
    server = ShardServer(model_path, manifest, gate, **kw)
    net.set_handler(PROTOCOL_SHARD, server.handle)
    log.info("serving %s for model %s (%d expert tensors)", PROTOCOL_SHARD, manifest.fingerprint[:12],
             len(server._experts))
    return server


SIDECAR_SUFFIX = ".source"


def _write_source_sidecar(out: Path, manifest: ModelManifest, header: bytes) -> Path:
    """``OUT.source``: the signed manifest and the source header bytes, what a worker needs to
    serve its own slice onwards (:class:`ShardServer` with ``source_header``)."""
    side = out.with_name(out.name + SIDECAR_SUFFIX)
    tmp = side.with_name(f".{side.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(_pack({"v": 1, "manifest": manifest.encode(), "header": header}))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, side)
    return side


def load_source_sidecar(shard_path) -> tuple[ModelManifest, bytes]:
    """(manifest, source header) kept beside a downloaded shard; ManifestError if missing/bad.
    The manifest is parsed, not verified: check it with ``.verify(trusted_issuers=...)``."""
    side = Path(str(shard_path) + SIDECAR_SUFFIX)
    try:
        d = msgpack.unpackb(side.read_bytes(), raw=False)
        manifest, header = ModelManifest.decode(d["manifest"]), d["header"]
    except FileNotFoundError:
        raise ManifestError(f"{side}: missing (fetch the shard with keep_source=True)") from None
    except ManifestError:
        raise
    except Exception:  # noqa: BLE001 - any decoding failure: not our sidecar
        raise ManifestError(f"{side}: not a shard source sidecar") from None
    if not isinstance(header, bytes) or hashlib.sha256(header).hexdigest() != manifest.header_sha256:
        raise ManifestError(f"{side}: header does not match its manifest")
    return manifest, header


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
    except (UserError, KeyError):
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
    from p2pswarm.model.slicer import (
        header_layout,
        patch_header,
        plan_expert_shard,
        shard_header,
    )

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
        raise ShardTransferError(f"no source for model {model} (none found or given)")
    shard_scope(model, layers, experts)  # validates the ranges
    hello = {"op": "hello", "v": SHARD_PROTOCOL_VERSION, "model": model, "layers": list(layers),
             "experts": list(experts), "token": token}

    sessions: list[_Session] = []
    per_source: dict[str, object] = {}

    async def connect(src) -> None:
        try:
            first = await _open_session(net, src, hello)
        except (UserError, trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError, OSError) as exc:
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
    try:
        # Manifest and header from the first source that gives valid ones.
        manifest, header_src = None, None
        for s in list(sessions):
            try:
                m = ModelManifest.decode((await s.call({"op": "manifest"}))["manifest"])
                m.verify(trusted_issuers=trusted_issuers, fingerprint=model)
                hdr = (await s.call({"op": "header"}))["header"]
                if not isinstance(hdr, bytes) or len(hdr) != m.header_len or \
                        hashlib.sha256(hdr).hexdigest() != m.header_sha256:
                    raise ManifestError("header bytes do not match the manifest")
                manifest, header_src = m, hdr
                break
            except (UserError, KeyError, trio.BrokenResourceError, trio.TooSlowError) as exc:
                log.warning("source %s: %s", s.source, exc)
                stats.refusals.append(f"{s.source}: {exc}")
                sessions.remove(s)
                await s.stream.aclose()
        if manifest is None:
            raise ShardTransferError("no source gave a valid manifest: " + clip("; ".join(stats.refusals[-3:]), 600))

        part = out.with_name(out.name + ".part")
        src_header = out.with_name(f".{out.name}.source-header.{os.getpid()}")
        try:
            src_header.write_bytes(header_src)
            lay = header_layout(src_header, manifest.file_size)
            plan = plan_expert_shard(lay, layers, experts, manifest.fingerprint)
        finally:
            src_header.unlink(missing_ok=True)
        header, slots = shard_header(plan.gguf)
        data_end = max(t.offset + t.nbytes for t in plan.gguf.tensors)
        total_size = len(header) + data_end
        slabs: list[_Slab] = []
        for i, (g_t, src_t) in enumerate(zip(plan.gguf.tensors, plan.sources)):
            d = manifest.tensor(src_t.name)
            if (d.offset, d.nbytes, d.expert_nbytes) != (src_t.data_offset, src_t.nbytes, src_t.expert_nbytes):
                raise ManifestError(f"manifest and header disagree on tensor {src_t.name}")
            for e in range(experts[0], experts[1]):
                slabs.append(_Slab(i, src_t.name, e, len(header) + g_t.offset + (e - experts[0]) * d.expert_nbytes,
                                   d.expert_nbytes, d.slab_sha256(e)))
        stats.slabs_total = len(slabs)
        journal = _Journal(out.with_name(out.name + ".part.journal"), {"v": 1, "model": model, "layers": list(layers), "experts": list(experts),
                                          "header_sha256": hashlib.sha256(header).hexdigest(), "size": total_size})
        done = journal.load() if part.exists() else None
        if done is None:
            done = set()
            fd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            journal.start()
        else:
            fd = os.open(part, os.O_RDWR)
            log.info("resuming %s: %d of %d slabs already on disk", part, len(done), len(slabs))
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
                hashes, bad = await trio.to_thread.run_sync(_verify_part, fd, plan.gguf, slabs, len(header))
                if not bad:
                    break
                log.warning("%d slabs on disk do not match the manifest: fetching them again", len(bad))
                stats.bad_chunks += len(bad)
                todo = bad
            else:
                raise ShardTransferError(f"{len(bad)} slabs still do not verify after a second round")
            final_header = patch_header(header, slots, hashes)
            await trio.to_thread.run_sync(_finish_part, fd, final_header)
        finally:
            os.close(fd)
        if out.exists():
            raise ShardTransferError(f"{out} appeared while downloading; left the result in {part}")
        if keep_source:
            await trio.to_thread.run_sync(_write_source_sidecar, out, manifest, header_src)
        os.replace(part, out)
        _fsync_dir(out.parent)
        journal.path.unlink(missing_ok=True)
    finally:
        for s in sessions:
            await s.stream.aclose()
    stats.seconds = time.monotonic() - t0
    return out


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
                bad.append(_Slab(s.index, s.name, s.expert, s.dst, s.length, s.sha256))
        hashes.append(h.hexdigest())
    return hashes, bad


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for e in exc.exceptions for leaf in _leaves(e)]
    return [exc]


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
            resp = await sess.call({"op": "chunk", "tensor": slab.name, "expert": slab.expert, "offset": off,
                                    "length": n})
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
                    except (UserError, trio.BrokenResourceError, trio.TooSlowError) as exc:
                        log.debug("extra stream to %s: %s", sess.source, exc)
                        break
                    start(nursery, extra, True)
    except BaseExceptionGroup as group:  # callers want our one-line error, not trio's wrapping
        # Several streams can give up at the same moment (a source that corrupts everything):
        # one error of ours says it; the others are the same failure on other slabs.
        leaves = _leaves(group)
        ours = [e for e in leaves if isinstance(e, UserError)]
        if ours and len(ours) == len(leaves):
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


__all__ = [
    "PROTOCOL_SHARD",
    "FetchStats",
    "ShardServer",
    "ShardTransferError",
    "advertise_source",
    "fetch_slice",
    "fetch_slice_from_swarm",
    "find_sources",
    "load_source_sidecar",
    "run_shard_source",
    "serve_shards",
    "source_key",
]
