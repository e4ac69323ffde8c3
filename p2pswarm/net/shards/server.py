"""The serving side of ``/p2pswarm/shard/1.0.0``: :class:`ShardServer` answers token holders
from a full model or from a worker's own slice, and the ``OUT.source`` sidecar that lets a worker
serve its slice onwards. Split from ``transfer.py``."""
from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import msgpack
import trio

from p2pswarm.errors import FrameError, UserError, clip
from p2pswarm.model.layout import EXPERT_TENSOR_RE, ModelLayout
from p2pswarm.model.manifest import ManifestError, ModelManifest, model_fingerprint, source_fingerprint
from p2pswarm.net.wire.framing import FrameReader, send_frame
from p2pswarm.net.shards.wire import (
    CHUNK_MAX, MAX_CONTROL_FRAME, PROTOCOL_SHARD, SHARD_PROTOCOL_VERSION, _pack, _range_of, _unpack,
)
from p2pswarm.net.signed.tokens import TokenError, TokenGate, shard_scope

log = logging.getLogger("p2pswarm.shard")


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
        # name -> (absolute offset, nbytes): the dense part's tensors, served by a full model only,
        # to a token that grants every layer and expert (a backbone downloading its slice)
        self._dense: dict[str, tuple[int, int]] = {}
        lay = self.layout
        if lay.shard_kind is None:
            fp = model_fingerprint(lay)
            self.held = ((0, lay.n_layer), (0, lay.n_expert))
            for t in manifest.tensors:
                m = EXPERT_TENSOR_RE.match(t.name)
                if m and t.expert_nbytes:
                    self._experts[t.name] = (int(m.group(1)), t.offset, t.expert_nbytes, 0)
                elif not m:
                    self._dense[t.name] = (t.offset, t.nbytes)
            self._header = lay.header_bytes()  # a split model's: its merged file's (split_gguf)
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
                for et in kinds.values():
                    d = manifest.tensor(et.name)
                    if d.expert_nbytes != et.expert_nbytes:
                        raise ManifestError(f"{lay.path}: {et.name} does not match the manifest")
                    self._experts[et.name] = (il, et.data_offset, et.expert_nbytes, lay.expert_begin)
        else:
            raise UserError(f"{lay.path}: a {lay.shard_kind} file holds no experts to serve")
        if fp != manifest.fingerprint:
            raise ManifestError(f"manifest is for model {manifest.fingerprint}, but {lay.path} is {fp}")
        if hashlib.sha256(self._header).hexdigest() != manifest.header_sha256:
            raise ManifestError(f"{lay.path}: source header does not match the manifest's sha256")
        self._fds = {str(p.path): os.open(p.path, os.O_RDONLY) for p in lay.parts}  # one, or a split model's

    def close(self) -> None:
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)

    async def handle(self, stream, reader: FrameReader | None = None, hello: dict | None = None) -> None:
        """One client stream: hello (token check), then requests until the client closes.
        ``reader``/``hello``: the stream's reader and its hello, already read (:class:`ShardFiles`)."""
        self.stats.streams += 1
        peer = stream.peer_id.to_base58() if stream.peer_id is not None else "?"
        reader = reader or FrameReader(stream, MAX_CONTROL_FRAME)
        tally = [0, 0]  # chunks, bytes served on this stream
        try:
            await self._serve(stream, reader, peer, tally, hello)
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

    async def _serve(self, stream, reader: FrameReader, peer: str, tally: list[int], hello: dict | None = None) -> None:
        """Hello (token check), then requests until the client closes; FrameError on bad input."""
        if hello is None:
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
                part, part_off = self.layout.locate(off, length)
                chunk = await trio.to_thread.run_sync(os.pread, self._fds[str(part.path)], length, part_off)
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
        """(absolute offset, length) of a chunk request: a piece of one expert's slab of a routed
        tensor, or (``expert`` None) a piece of one dense tensor; ValueError says why not."""
        name, expert, off, length = req.get("tensor"), req.get("expert"), req.get("offset"), req.get("length")
        if expert is None and isinstance(name, str) and name in self._dense:  # the dense part (a backbone's slice)
            if tuple(layers) != self.held[0] or tuple(experts) != self.held[1]:
                raise ValueError("the dense part is served only to a token granting every layer and expert")
            base, nbytes = self._dense[name]
            if not (isinstance(off, int) and isinstance(length, int) and 0 <= off and 0 < length <= self.chunk_max
                    and off + length <= nbytes):
                raise ValueError(f"bad chunk range {off}+{length} (tensor of {nbytes} bytes, "
                                 f"at most {self.chunk_max} a chunk)")
            return base + off, length
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
    """Serve ``/p2pswarm/shard/1.0.0`` on ``net`` (a :class:`p2pswarm.net.libp2p.host.NetHost`) from a full
    model file, or from an expert shard with ``source_header=`` (see :func:`load_source_sidecar`).
    Returns the server (its ``stats``, ``held`` range, and ``gate.refused``/``gate.accepted``)."""
    server = ShardServer(model_path, manifest, gate, **kw)
    net.set_handler(PROTOCOL_SHARD, server.handle)
    log.info("serving %s for model %s (%d expert tensors)", PROTOCOL_SHARD, manifest.fingerprint[:12],
             len(server._experts))
    return server


class ShardFiles:
    """Several shard files of one worker served on one ``/p2pswarm/shard/1.0.0`` handler (an
    ``--auto`` worker holds one slice per unit it enrolled in, and changes them as it re-enrols):
    each stream goes to the :class:`ShardServer` whose held layers and experts cover its hello.
    Why: a backbone's expert cache fetches a unit from any worker whose shard holds it, so every
    worker that holds slabs should serve them, not only one that downloaded a single slice."""

    def __init__(self, net, gate: TokenGate):
        self.net, self.gate = net, gate
        self.servers: dict[str, ShardServer] = {}
        self._installed = False

    def add(self, shard_path, manifest: ModelManifest, header: bytes) -> ShardServer:
        server = ShardServer(shard_path, manifest, self.gate, source_header=header)
        old = self.servers.pop(str(shard_path), None)
        if old is not None:
            old.close()
        self.servers[str(shard_path)] = server
        if not self._installed:
            self.net.set_handler(PROTOCOL_SHARD, self.handle)
            self._installed = True
        return server

    def remove(self, shard_path) -> None:
        server = self.servers.pop(str(shard_path), None)
        if server is not None:
            server.close()

    async def handle(self, stream) -> None:
        reader = FrameReader(stream, MAX_CONTROL_FRAME)
        try:
            hello = _unpack(await reader.read_frame(), "hello")
        except (FrameError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            log.warning("closing shard stream: %s", exc)
            return
        layers, experts = hello.get("layers"), hello.get("experts")
        for server in list(self.servers.values()):
            (hl0, hl1), (he0, he1) = server.held
            if (isinstance(layers, list) and isinstance(experts, list) and len(layers) == 2 and len(experts) == 2
                    and all(isinstance(v, int) for v in (*layers, *experts))
                    and hl0 <= layers[0] and layers[1] <= hl1 and he0 <= experts[0] and experts[1] <= he1):
                await server.handle(stream, reader, hello)
                return
        held = "; ".join(f"layers {s.held[0][0]}-{s.held[0][1] - 1}, experts {s.held[1][0]}-{s.held[1][1] - 1}"
                         for s in self.servers.values()) or "nothing now"
        with trio.move_on_after(2):
            try:
                await send_frame(stream, _pack({"ok": False, "error": f"this source holds {held} only"}))
            except (trio.BrokenResourceError, trio.ClosedResourceError, FrameError):
                pass  # the asker already left: the refusal was only a courtesy


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
    except Exception:  # any decoding failure: not our sidecar
        raise ManifestError(f"{side}: not a shard source sidecar") from None
    if not isinstance(header, bytes) or hashlib.sha256(header).hexdigest() != manifest.header_sha256:
        raise ManifestError(f"{side}: header does not match its manifest")
    return manifest, header


