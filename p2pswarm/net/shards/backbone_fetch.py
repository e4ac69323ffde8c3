"""A backbone downloads only its slice of a model - the dense part, no routed experts - by
fingerprint: ``node --role backbone --model FINGERPRINT --token T --trust-issuer ISSUER``.

Why: the dense part of DeepSeek-V3 is ~5 % of its 380 GB; a backbone that keeps its experts as a
bounded cache (``--expert-cache``) needs no more than that on disk. The download is the workers'
(:mod:`p2pswarm.net.shards.fetch`) with dense tensors for slabs: the same protocol
(``/p2pswarm/shard/1.0.0``, a ``chunk`` with ``expert`` None), the same token gate (a token that
grants every layer and expert: ``token issue --allow shard:FINGERPRINT``; only a full-model
source - ``serve-shards``, a ``--manifest`` backbone - serves it), the same checks (the signed
manifest of a ``--trust-issuer``; every tensor's sha256 before it is written, and all of them
again on disk before the rename) and the same resume (``OUT.part`` and its journal). The file is
planned by the slicer's own code from the source header (:func:`p2pswarm.model.slicer.plan_backbone`),
so it is byte for byte ``slice --backbone`` of the full model.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Collection, Sequence
from pathlib import Path

import trio

from p2pswarm.errors import SwarmError
from p2pswarm.model.layout import ModelLayout
from p2pswarm.model.manifest import ManifestError, ModelManifest
from p2pswarm.net.shards.fetch import NO_SOURCE, FetchStats, _connect_all, _manifest_and_header, _Slab, fetch_into
from p2pswarm.net.shards.wire import SHARD_PROTOCOL_VERSION, Progress, ShardTransferError

log = logging.getLogger("p2pswarm.shard")


def existing_backbone_matches(out: Path, model: str) -> bool:
    """Whether ``out`` already is the complete, self-consistent backbone file of ``model``."""
    from p2pswarm.model.gguf_read import field_value
    from p2pswarm.model.slicer import verify_shard

    try:
        lay = ModelLayout.open(out, require_experts=False)
        if lay.shard_kind != "backbone" or str(field_value(lay.reader.fields["p2pswarm.source.fingerprint"])) != model:
            return False
        verify_shard(out)
        return True
    except (SwarmError, KeyError):
        return False


def _plan(out: Path, manifest: ModelManifest, header_src: bytes):
    """The backbone file's layout, header, hash slots and one slab per dense tensor."""
    from p2pswarm.model.slicer import header_layout, plan_backbone, shard_header

    src_header = out.with_name(f".{out.name}.source-header.{os.getpid()}")
    try:
        src_header.write_bytes(header_src)
        lay = header_layout(src_header, manifest.file_size)
        g, ranges = plan_backbone(lay, manifest.fingerprint, header_src)
    finally:
        src_header.unlink(missing_ok=True)
    header, slots = shard_header(g)
    slabs = []
    for i, (t, ((off, nbytes),)) in enumerate(zip(g.tensors, ranges)):
        d = manifest.tensor(t.name)
        if (d.offset, d.nbytes) != (off, nbytes):
            raise ManifestError(f"manifest and header disagree on tensor {t.name}")
        slabs.append(_Slab(i, t.name, 0, len(header) + t.offset, nbytes, d.sha256, dense=True))
    return g, header, slots, slabs


async def fetch_backbone(net, *, sources: Sequence, model: str, out_path, token: str,
                         trusted_issuers: Collection[str], progress: Progress | None = None,
                         stats: FetchStats | None = None) -> Path:
    """Download the dense part of model ``model`` (fingerprint) from ``sources`` into ``out_path``
    (see the module doc). Returns at once when ``out_path`` already is that file (verified);
    refuses to overwrite any other file; resumes an interrupted run of the same download."""
    t0 = time.monotonic()
    stats = stats if stats is not None else FetchStats()
    model = model.lower()
    out = Path(out_path)
    if out.exists():
        if await trio.to_thread.run_sync(existing_backbone_matches, out, model):
            stats.already_complete = True
            log.info("%s already holds this model's backbone slice (verified): nothing to fetch", out)
            return out
        raise ShardTransferError(f"{out} exists and is not this model's backbone slice; refusing to overwrite it")
    if not out.parent.is_dir():
        raise ShardTransferError(f"{out.parent}: output directory does not exist")
    if not sources:
        raise ShardTransferError(NO_SOURCE.format(model=model))
    # The first hello asks for one layer and expert, only to read the geometry; the download itself
    # asks for all of them (the dense part is served only to a token that grants every one).
    probe = {"op": "hello", "v": SHARD_PROTOCOL_VERSION, "model": model, "layers": [0, 1], "experts": [0, 1],
             "token": token}
    sessions, per_source = await _connect_all(net, sources, probe, stats)
    try:
        manifest, header_src = await _manifest_and_header(sessions, trusted_issuers, model, stats)
    finally:
        for s in sessions:
            await s.stream.aclose()
    g, header, slots, slabs = await trio.to_thread.run_sync(_plan, out, manifest, header_src)
    n_layer, n_expert = _geometry(out, manifest, header_src)
    hello = {**probe, "layers": [0, n_layer], "experts": [0, n_expert]}
    sessions, per_source = await _connect_all(net, sources, hello, stats)
    try:
        await fetch_into(out, net, sessions, per_source, hello, g, header, slots, slabs,
                         {"v": 1, "kind": "backbone", "model": model}, stats, progress, 1, 3, "tensors")
    finally:
        for s in sessions:
            await s.stream.aclose()
    stats.seconds = time.monotonic() - t0
    return out


def _geometry(out: Path, manifest: ModelManifest, header_src: bytes) -> tuple[int, int]:
    """(layers, experts) of the source model, from its header."""
    from p2pswarm.model.slicer import header_layout

    src_header = out.with_name(f".{out.name}.source-geometry.{os.getpid()}")
    try:
        src_header.write_bytes(header_src)
        lay = header_layout(src_header, manifest.file_size)
        return lay.n_layer, lay.n_expert
    finally:
        src_header.unlink(missing_ok=True)
