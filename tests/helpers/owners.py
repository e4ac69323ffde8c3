"""Libp2p owners of real workers for in-process tests: a worker served on its own host, and the
backbone-side owner that reaches it (the expert RPC and market tests)."""
from __future__ import annotations

from contextlib import asynccontextmanager

from p2pswarm.backbone.owners.libp2p_owner import Libp2pOwner
from p2pswarm.net.wire import expert_protocol as proto
from p2pswarm.net.dht.coverage import OwnerInfo
from p2pswarm.net.libp2p.host import open_host
from p2pswarm.net.signed.identity import Identity
from p2pswarm.net.signed.records import NodeRecord, ShardEntry
from p2pswarm.worker.expert_worker import worker_shard_hash
from p2pswarm.worker.expert_worker import ExpertWorker
from p2pswarm.worker.server import serve_libp2p


def entry(worker: ExpertWorker) -> ShardEntry:
    i = worker.info
    return ShardEntry(i.model_fingerprint, worker_shard_hash(worker), (i.layer_begin, i.layer_end),
                      (i.expert_begin, i.expert_end))


def owner_info(net, worker: ExpertWorker, shard: ShardEntry | None = None) -> OwnerInfo:
    shard = shard or entry(worker)
    rec = NodeRecord.make(net.identity, addrs=net.addrs(), protocol=proto.PROTOCOL_VERSION,
                          kernel=worker.info.kernel, block_size=4, shards=[shard], ttl_s=60)
    return OwnerInfo(net.peer_id_str, rec.addrs, shard, rec)


@asynccontextmanager
async def served(worker: ExpertWorker, **kw):
    async with open_host(Identity.generate()) as net:
        serve_libp2p(net, worker, **kw)
        yield net


def libp2p_owner(backbone_net, worker_net, worker, *, model=None, kernel=None, shard=None, **kw) -> Libp2pOwner:
    return Libp2pOwner(backbone_net, owner_info(worker_net, worker, shard),
                       model_fingerprint=model or worker.info.model_fingerprint,
                       kernel=kernel or worker.info.kernel, **kw)


def random_request(worker: ExpertWorker, rng, rows: int = 9):
    """Rows for ``worker`` and 4 of its experts, each on a random subset of them: ``(cur, groups)``."""
    import numpy as np

    cur = rng.standard_normal((rows, worker.info.n_embd)).astype(np.float32)
    experts = rng.choice(np.arange(worker.info.expert_begin, worker.info.expert_end), 4, replace=False)
    return cur, [(int(e), np.sort(rng.choice(rows, rng.integers(1, rows), replace=False))) for e in experts]


async def hello_offer(bnet, wnet, worker: ExpertWorker) -> tuple[dict, dict]:
    """What a backbone's hello asking for the direct lane (``direct: true``, no ``direct_aeads``:
    as a backbone from before the AEAD choice) gets back on the libp2p stream: (offer, hello)."""
    from p2pswarm.net.wire.framing import FrameReader, send_frame

    stream = await bnet.open_stream(wnet.full_addrs()[0], proto.PROTOCOL_EXPERT)
    hello = {"op": "hello", "protocol": proto.PROTOCOL_VERSION, "model": worker.info.model_fingerprint,
             "kernel": worker.info.kernel, "shard": entry(worker).shard, "direct": True}
    await send_frame(stream, proto.pack(hello))
    reply = proto.unpack(await FrameReader(stream).read_frame())
    await stream.aclose()
    assert reply["ok"], reply
    return reply["direct"], hello
