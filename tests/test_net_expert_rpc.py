"""The expert RPC over libp2p streams (/p2pswarm/expert/1.0.0), in one trio process.

Real hosts on 127.0.0.1, the real worker handler (the same one that serves local sockets), the
real Libp2pOwner; and a backbone whose owners come from DHT look-ups, checked bit for bit against
the monolithic run while a worker disappears.
"""
from __future__ import annotations

import os
import struct
from contextlib import asynccontextmanager

import msgpack
import numpy as np
import pytest
import trio

from p2pswarm.backbone.dispatch.dispatcher import Dispatcher, pack_rows
from p2pswarm.backbone.owners.libp2p_owner import SwarmOwners
from p2pswarm.backbone.sessions.local import open_backbone
from p2pswarm.errors import WorkerError
from p2pswarm.model.layout import ModelLayout
from p2pswarm.model.manifest import model_fingerprint
from p2pswarm.net.wire import expert_protocol as proto
from p2pswarm.market.swarm_dht import open_dht
from p2pswarm.net.dht.advertiser import ShardAdvertiser
from p2pswarm.net.dht.coverage import CoverageResolver
from p2pswarm.net.wire.expert_protocol import PROTOCOL_EXPERT
from p2pswarm.net.libp2p.host import open_host
from p2pswarm.net.signed.identity import Identity
from p2pswarm.net.signed.records import ShardEntry
from p2pswarm.worker.expert_worker import worker_shard_hash
from p2pswarm.worker.expert_worker import ExpertWorker
from p2pswarm.worker.server import serve_libp2p

from helpers.owners import entry, libp2p_owner, served
from p2pswarm.backbone.serving.generate import sequence_logits

SIZES = [0, 1, 65535, 65536, 65537, 16 << 20]
TOKENS = list(range(3, 19))


@pytest.fixture(autouse=True)
def _numpy_kernel(monkeypatch):
    # The same kernel on every side: bit-equality needs it, and the handshake insists on it.
    monkeypatch.setenv("P2PSWARM_KERNEL", "numpy")


async def test_expert_request_bit_identical_to_direct_compute(shards):
    worker = ExpertWorker(shards[1])
    rng = np.random.default_rng(7)
    async with served(worker) as wnet, open_host(Identity.generate()) as bnet:
        owner = libp2p_owner(bnet, wnet, worker)
        for layer in range(worker.info.layer_begin, worker.info.layer_end):
            cur = rng.standard_normal((9, worker.info.n_embd)).astype(np.float32)
            experts = rng.choice(np.arange(worker.info.expert_begin, worker.info.expert_end), 4, replace=False)
            groups = [(int(e), np.sort(rng.choice(9, rng.integers(1, 9), replace=False))) for e in experts]
            got = await owner.compute(layer, cur, groups)
            rows, local = pack_rows(cur, groups)
            want = worker.compute(layer, rows, local)
            assert len(got) == len(want)
            assert all(np.array_equal(g, w) and g.dtype == np.float32 for g, w in zip(got, want))
            if layer == worker.info.layer_begin:  # it dialled: a dial is no round trip (the hot-expert path reads rtt_s)
                assert owner.rtt_s is None
        assert worker.info.layer_end - worker.info.layer_begin >= 2
        assert owner.requests == worker.info.layer_end - worker.info.layer_begin and owner.rtt_s > 0
        await owner.aclose()


async def test_frames_cross_the_expert_protocol_intact(shards):
    worker = ExpertWorker(shards[0])
    async with served(worker) as wnet, open_host(Identity.generate()) as bnet:
        owner = libp2p_owner(bnet, wnet, worker)
        for n in SIZES:
            payload = os.urandom(n)
            with trio.fail_after(60):
                assert await owner.echo(payload) == payload
        await owner.aclose()


async def _raw_exchange(net, peer, data: bytes) -> bytes:
    stream = await net.open_stream(peer, PROTOCOL_EXPERT)
    await stream.send_all(data)
    await stream.send_eof()
    out = b""
    with trio.fail_after(10):
        while chunk := await stream.receive_some(65536):
            out += chunk
    await stream.aclose()
    return out


@pytest.mark.parametrize("frame", [
    struct.pack("!Q", 5) + b"\xc1\xc1\xc1\xc1\xc1",  # never-used msgpack byte
    pytest.param(struct.pack("!Q", 3) + msgpack.packb([1, 2]), marks=pytest.mark.slow),  # not a map
    pytest.param(struct.pack("!Q", 1 << 62) + b"x", marks=pytest.mark.slow),  # absurd length: refused before reading
    pytest.param(struct.pack("!Q", 10) + b"short", marks=pytest.mark.slow),  # closed mid-frame
    pytest.param(struct.pack("!Q", 200_000) + b"y" * 200_000, marks=pytest.mark.slow),  # over this worker's maximum
], ids=["bad-msgpack", "not-a-map", "absurd-length", "closed-mid-frame", "oversized"])
async def test_malformed_or_oversized_frame_closes_only_that_stream(shards, frame, caplog):
    worker = ExpertWorker(shards[0])
    async with served(worker, max_frame=100_000) as wnet, open_host(Identity.generate()) as bnet:
        good = libp2p_owner(bnet, wnet, worker)
        assert await good.echo(b"before") == b"before"  # a stream opened before the bad one
        reply = await _raw_exchange(bnet, wnet.full_addrs()[0], frame)
        if reply:  # an error frame with the reason, then the stream is closed
            (n,) = struct.unpack("!Q", reply[:8])
            msg = msgpack.unpackb(reply[8 : 8 + n])
            assert msg["op"] == "error" and msg["error"]
        assert await good.echo(b"after") == b"after"  # the worker keeps serving others
        fresh = libp2p_owner(bnet, wnet, worker)
        assert await fresh.echo(b"new") == b"new"
        with pytest.raises(WorkerError, match="exceeds the maximum of 100000"):
            await fresh.echo(b"z" * 200_000)
        for o in (good, fresh):
            await o.aclose()
    assert any("closing connection from" in r.getMessage() for r in caplog.records)


async def test_build_mismatch_refused_on_both_sides(shards, tiny_q8, tmp_path, caplog):
    caplog.set_level("INFO")
    worker = ExpertWorker(shards[0])
    other_layout = ModelLayout.open(tiny_q8)
    other_model = model_fingerprint(other_layout)
    async with served(worker) as wnet, open_host(Identity.generate()) as bnet:
        # a backbone of another model: the worker refuses, both sides say why
        wrong = libp2p_owner(bnet, wnet, worker, model=other_model)
        with pytest.raises(WorkerError, match="refused the handshake: model mismatch"):
            await wrong.compute(0, np.zeros((1, 256), np.float32), [(0, np.array([0]))])
        assert any("refused" in r.getMessage() and "model mismatch" in r.getMessage() for r in caplog.records)
        # the record promised another shard: the worker refuses (it was told which one we expect)
        forged = ShardEntry(worker.info.model_fingerprint, "0" * 64, (0, 4), (0, 8))
        with pytest.raises(WorkerError, match="refused the handshake: shard mismatch"):
            await libp2p_owner(bnet, wnet, worker, shard=forged).echo(b"x")
        # the worker holds less than its record claims: we refuse it
        bigger = ShardEntry(worker.info.model_fingerprint, worker_shard_hash(worker), (0, 4), (0, 16))
        with pytest.raises(WorkerError, match="refused by us at the handshake: .*less than its record"):
            await libp2p_owner(bnet, wnet, worker, shard=bigger).echo(b"x")
        assert any("refused worker" in r.getMessage() for r in caplog.records)
        # and a correct one still works
        ok = libp2p_owner(bnet, wnet, worker)
        assert await ok.echo(b"fine") == b"fine"
        await ok.aclose()


@pytest.mark.slow
async def test_failures_become_worker_errors(shards, monkeypatch):
    worker = ExpertWorker(shards[0])
    failures = []
    async with open_host(Identity.generate()) as bnet:
        async with served(worker) as wnet:
            owner = libp2p_owner(bnet, wnet, worker, timeout_s=1.0, connect_timeout_s=3, on_failure=failures.append)
            assert await owner.echo(b"up") == b"up"
            # a worker that hangs: timeout, not a hang
            monkeypatch.setattr(worker, "compute", lambda *a: __import__("time").sleep(3) or [])
            with pytest.raises(WorkerError, match="timed out after 1 s"):
                await owner.compute(0, np.zeros((1, 256), np.float32), [(0, np.array([0]))])
        # the worker's host is gone: unreachable
        with trio.fail_after(15), pytest.raises(WorkerError, match="unreachable|closed"):
            await owner.echo(b"anyone?")
        assert len(failures) == 2 and owner.failures == 2
        await owner.aclose()


@asynccontextmanager
async def _node(shard_path, boot: str, *, ttl_s: float = 30.0):
    """A worker node: host + DHT + expert protocol + advertisement, like `node --role worker`."""
    worker = ExpertWorker(shard_path)
    async with open_host(Identity.generate()) as net:
        async with open_dht(net, bootstrap=[boot]) as dht:
            serve_libp2p(net, worker)
            adv = ShardAdvertiser(dht, net.identity, shards=[entry(worker)], protocol=proto.PROTOCOL_VERSION,
                                  kernel=worker.info.kernel, block_size=4, ttl_s=ttl_s)
            async with trio.open_nursery() as nursery:
                await nursery.start(adv.run)
                try:
                    yield net, adv
                finally:
                    nursery.cancel_scope.cancel()


@pytest.mark.slow
async def test_backbone_through_dht_owners_bit_equal_while_a_worker_leaves(tiny_f32, shards, caplog):
    """Bootstrap + 3 workers (two of them replicas) + backbone, one process: owners found by DHT
    look-ups only; prefill and decode logits bit-equal to monolithic; the busiest worker vanishes
    mid-decode (no withdrawal: a crash) and the result is still bit-equal, through the local
    replica and then the other replica."""
    async with open_backbone(tiny_f32, workers=0) as mono:
        want_prefill = await sequence_logits(mono.backbone, TOKENS)
        want_decode = await sequence_logits(mono.backbone, TOKENS, decode=True)
        bank = mono.backbone.dispatcher.local.bank
        fingerprint = mono.fingerprint
        layout = ModelLayout.open(tiny_f32)
        async with open_host(Identity.generate()) as boot_net, open_dht(boot_net) as _boot:
            boot = boot_net.full_addrs()[0]
            async with _node(shards[0], boot) as (a, _), _node(shards[0], boot) as (b, _), _node(shards[1], boot):
                nets = {n.peer_id_str: n for n in (a, b)}
                async with open_host(Identity.generate()) as bnet, open_dht(bnet, bootstrap=[boot]) as bdht:
                    resolver = CoverageResolver(bdht, model=fingerprint, layers=layout.expert_layers,
                                                n_expert=layout.n_expert, block_size=4,
                                                protocol=proto.PROTOCOL_VERSION, kernel=bank.kernel, refresh_s=60)
                    pool = SwarmOwners(bnet, model_fingerprint=fingerprint, kernel=bank.kernel, timeout_s=5,
                                       connect_timeout_s=3, resolver=resolver)
                    resolver.on_change = pool.sync
                    async with trio.open_nursery() as nursery:
                        await nursery.start(resolver.run)
                        assert not resolver.map.missing() and len(pool.owners) == 3
                        mono.backbone.dispatcher = Dispatcher(bank, [], backoff_s=60)
                        pool.attach(mono.backbone.dispatcher)
                        stats = mono.backbone.dispatcher.stats
                        assert np.array_equal(await sequence_logits(mono.backbone, TOKENS), want_prefill)
                        assert stats.requests > 0 and stats.fallbacks == 0 and stats.local_groups == 0
                        # decode token by token; after 5 tokens the busiest shard-0 worker crashes
                        state, rows, victim = mono.backbone.new_state(), [], None
                        with trio.fail_after(120):
                            for i, token in enumerate(TOKENS):
                                if i == 5:
                                    victim = next(o for o in pool.owners if o.peer in nets)  # the one in use
                                    await nets[victim.peer].host.get_network().close()  # no goodbye, no withdrawal
                                rows.append(await mono.backbone.forward([token], state))
                        got = np.concatenate(rows, axis=0)
                        assert np.array_equal(got, want_decode)
                        assert stats.fallbacks >= 1 and victim.failures >= 1
                        survivor = next(o for o in pool.owners if o.peer in nets and o is not victim)
                        assert survivor.requests > 0  # the other replica took over
                        with trio.fail_after(10):  # the failure asked the resolver for a refresh at once
                            while resolver.stats.refreshes < 2:
                                await trio.sleep(0.05)
                        assert any("fell back to the local replica" in r.getMessage() for r in caplog.records)
                        nursery.cancel_scope.cancel()
                    await pool.aclose()


async def test_keepalive_pings_idle_streams_and_drops_dead_ones_without_blame(shards):
    """Idle expert streams get an echo (so a CDN or NAT does not cut a relayed circuit between
    requests); one that fails is only dropped - no failure counted, no back-off, no refresh."""
    worker = ExpertWorker(shards[0])
    async with open_host(Identity.generate()) as bnet:
        async with served(worker) as wnet:
            owner = libp2p_owner(bnet, wnet, worker)
            pool = SwarmOwners(bnet, model_fingerprint=worker.info.model_fingerprint, kernel=worker.info.kernel)
            pool.owners.append(owner)
            assert await pool.ping_idle(0.0) == 0  # no stream open yet: nothing to keep alive
            assert await owner.echo(b"x") == b"x"
            assert await pool.ping_idle(3600.0) == 0  # just used: not idle
            owner.last_used -= 100
            assert await pool.ping_idle(30.0) == 1
            assert owner._stream is not None and owner.last_used > 0
        owner.last_used -= 100  # the worker is gone
        assert await pool.ping_idle(30.0) == 0
        assert owner._stream is None and owner.failures == 0
        await owner.aclose()


def test_wire_arrays_with_unhashable_fields_are_malformed_not_a_crash():
    """Found by the fuzzer (bench/fuzz_protocols.py): a list or map where a dtype string belongs
    made the dtype check itself raise TypeError, failing the handler instead of refusing the frame."""
    import pytest

    from p2pswarm.errors import FrameError
    from p2pswarm.net.wire import expert_protocol

    for dtype in ([1], {"a": 1}, None, 5):
        with pytest.raises(FrameError, match="malformed rows"):
            expert_protocol.array_from_wire({"dtype": dtype, "shape": [1], "data": b"\0" * 4}, "rows")
