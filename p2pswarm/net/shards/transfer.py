"""`/p2pswarm/shard/1.0.0`: a worker downloads only its slice of a model from peers that hold it.

Why this shape:

* **Token-gated.** Serving experts costs the server bandwidth, so every stream starts with a
  ``hello`` carrying a node token; the server checks it (:class:`p2pswarm.net.signed.tokens.TokenGate`)
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

Messages (msgpack maps in :mod:`p2pswarm.net.wire.framing` frames; see docs/protocol.md): ``hello``,
``manifest``, ``header``, ``chunk`` (one piece, at most ``chunk_max`` bytes, of one expert's slab
of one tensor). Hashing and file I/O run in threads (``trio.to_thread``), off the event loop.

The pieces: :mod:`~p2pswarm.net.shards.wire` (protocol id, limits, packing),
:mod:`~p2pswarm.net.shards.server` (:class:`ShardServer`, the source sidecar) and
:mod:`~p2pswarm.net.shards.fetch` (:func:`fetch_slice`, its journal); this module finds and
advertises sources through the DHT (callers import each name from the module that defines it).
"""
from __future__ import annotations

import hashlib
import logging
from collections.abc import Collection, Sequence
from pathlib import Path

import trio

from p2pswarm.model.manifest import ModelManifest
from p2pswarm.net.shards.fetch import FetchStats, _existing_shard_matches, fetch_slice
from p2pswarm.net.shards.server import ShardServer, load_source_sidecar, serve_shards
from p2pswarm.net.shards.wire import (
    PROTOCOL_SHARD, SOURCE_KEY_PREFIX, Progress,
    ShardTransferError,
)
from p2pswarm.net.signed.tokens import TokenGate

log = logging.getLogger("p2pswarm.shard")


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
        if found:  # none found: fetch_slice's error says what to start (an --auto worker says it once a minute)
            log.info("found %d shard source(s) for model %s through the DHT", len(found), model[:12])
        sources += found
    return await fetch_slice(net, sources=sources, model=model, layers=layers, experts=experts, out_path=out,
                             token=token, trusted_issuers=trusted_issuers, progress=progress, stats=stats,
                             keep_source=keep_source)


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
