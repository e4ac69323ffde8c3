"""What `node` downloads before it serves, split from ``node.py``: a worker's slice (and serving
it onwards), a backbone's slice (the dense part) by fingerprint. Each on the node's identity, with
its ``--token`` and ``--trust-issuer``; every byte checked against the signed manifest."""
from __future__ import annotations

import logging
from pathlib import Path

from p2pswarm import settings
from p2pswarm.errors import UserError

log = logging.getLogger("p2pswarm.node")


def _serve_own_shard(net, shard: Path, args, files=None, *, fingerprint: str | None = None):
    """A worker serves the slabs of its shard onwards on `/p2pswarm/shard/1.0.0` to holders of
    tokens by its ``--trust-issuer``s: other workers' downloads, and a backbone's expert cache (a
    backbone file's cache fetches units from any worker whose shard holds them, for its cache, for
    a unit no live owner holds, and for checking a worker's answers). The manifest and the source
    header come from the ``.source`` sidecar beside the shard: a download keeps one, ``slice
    --manifest`` writes one; a shard without one, or a worker without ``--trust-issuer``, is not
    served (said once). ``files``: the worker's :class:`~p2pswarm.net.shards.server.ShardFiles`
    (made here when None); returns it, or None when the shard is not served."""
    from p2pswarm.net.shards.server import ShardFiles, load_source_sidecar
    from p2pswarm.net.signed.tokens import TokenGate

    if not args.trust_issuer:
        log.info("not serving my shard's slabs to peers: no --trust-issuer (whose tokens to accept)")
        return None
    try:
        manifest, header = load_source_sidecar(shard)
        manifest.verify(trusted_issuers=args.trust_issuer, fingerprint=fingerprint or args.model)
        files = files if files is not None else ShardFiles(net, TokenGate(args.trust_issuer, what="shard server"))
        files.add(shard, manifest, header)
    except UserError as exc:  # a bad or missing sidecar: the worker still computes its experts
        log.warning("not serving my shard's slabs to peers: %s%s", exc,
                    "" if args.model else " (write one with `p2pswarm slice ... --manifest MANIFEST`)")
        return None
    log.info("serving my shard's expert slabs (%s) to holders of tokens issued by %s", Path(shard).name,
             ", ".join(args.trust_issuer))
    return files


def _default_slice_path(model: str, layers, experts) -> Path:
    """Where a downloaded slice lives by default: stable, so a restart resumes or reuses it."""
    return settings.home_dir() / "shards" / f"{model[:16]}-L{layers[0]}-{layers[1] - 1}-E{experts[0]}-{experts[1] - 1}.gguf"


async def _fetch_shard(args, net, dht, identity) -> Path:
    """Download this worker's slice from the swarm's shard sources (resumes an interrupted run;
    returns at once when the file is already complete)."""
    from p2pswarm.net.shards.fetch import FetchStats
    from p2pswarm.net.shards.transfer import fetch_slice_from_swarm
    from p2pswarm.net.signed.tokens import NodeToken
    from p2pswarm.progress import ProgressBar

    holder = NodeToken.decode(args.node_token).holder
    if holder != identity.peer_id_str:
        raise UserError(f"the token is for peer {holder}, but this node is {identity.peer_id_str} "
                        f"(pass the holder's key with --identity)")
    out = Path(args.shard) if args.shard else _default_slice_path(args.model, args.layer_range, args.expert_range)
    out.parent.mkdir(parents=True, exist_ok=True)
    stats = FetchStats()
    bar = ProgressBar("fetch", unit="B")
    try:
        shard = await fetch_slice_from_swarm(net, dht, model=args.model, layers=args.layer_range,
                                             experts=args.expert_range, out_path=out, token=args.node_token,
                                             trusted_issuers=args.trust_issuer, progress=bar.update, stats=stats,
                                             keep_source=True)
    finally:
        bar.close()
    if stats.already_complete:
        log.info("slice %s already complete and verified", shard)
    else:
        log.info("downloaded slice %s: %d slabs, %.1f MB, %d reused, %d bad chunks fetched again", shard,
                 stats.slabs_total, stats.bytes_fetched / 1e6, stats.slabs_reused, stats.bad_chunks)
    return shard


async def _fetch_backbone(args, identity) -> Path:
    """Download the backbone slice (the dense part) of model ``args.model`` (a fingerprint) from the
    swarm's shard sources into ``--shard`` or a stable path under P2PSWARM_HOME (a restart resumes
    or reuses it), on a host of its own that is closed before the backbone joins."""
    from p2pswarm.market.swarm_dht import open_dht
    from p2pswarm.net.shards.backbone_fetch import fetch_backbone
    from p2pswarm.net.libp2p.host import open_host
    from p2pswarm.net.shards.fetch import FetchStats
    from p2pswarm.net.shards.transfer import find_sources
    from p2pswarm.progress import ProgressBar

    fp = args.model.lower()
    out = Path(args.shard) if args.shard else settings.home_dir() / "backbones" / f"{fp[:16]}-backbone.gguf"
    out.parent.mkdir(parents=True, exist_ok=True)
    stats = FetchStats()
    async with open_host(identity, ["/ip4/127.0.0.1/tcp/0"]) as net:
        async with open_dht(net, server=False, bootstrap=args.bootstrap) as dht:
            sources = await find_sources(dht, fp, timeout_s=20.0)
            bar = ProgressBar("fetch", unit="B")
            try:
                path = await fetch_backbone(net, sources=sources, model=fp, out_path=out, token=args.backbone_token,
                                            trusted_issuers=args.trust_issuer, progress=bar.update, stats=stats)
            finally:
                bar.close()
    if stats.already_complete:
        log.info("backbone slice %s already complete and verified", path)
    else:
        log.info("downloaded backbone slice %s: %d tensors, %.1f MB, %d reused, %d bad fetched again", path,
                 stats.slabs_total, stats.bytes_fetched / 1e6, stats.slabs_reused, stats.bad_chunks)
    return path
