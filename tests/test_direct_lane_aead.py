"""The direct lane's AEAD choice (p2pswarm/net/wire/direct.py): AES-256-GCM where both ends' CPUs
have AES instructions, ChaCha20-Poly1305 otherwise and with older peers (a hello without
``direct_aeads``, an offer without ``aead``). Real hosts and sockets on 127.0.0.1: whichever AEAD
seals the lane, the answers are the worker's bits; a tampered record is refused under either; a
worker that names an AEAD the backbone did not offer, or a backbone whose list the worker cannot
meet, leaves the requests on libp2p with one log line saying why."""
from __future__ import annotations

import os
import struct

import numpy as np
import pytest
import trio
import trio.testing

from p2pswarm.backbone.dispatch.dispatcher import pack_rows
from p2pswarm.backbone.owners import libp2p_owner as owner_mod
from p2pswarm.errors import FrameError, UserError
from p2pswarm.net.libp2p.host import open_host
from p2pswarm.net.signed.identity import Identity
from p2pswarm.net.wire import direct
from p2pswarm.net.wire import expert_protocol as proto
from p2pswarm.net.wire.direct import AES_GCM, CHACHA, DirectLane, SealedStream
from p2pswarm.net.wire.framing import DEFAULT_MAX_FRAME, FrameReader, send_frame
from p2pswarm.worker import server as server_mod
from p2pswarm.worker.expert_worker import ExpertWorker

from helpers.owners import hello_offer, libp2p_owner, random_request, served

BOTH = [AES_GCM, CHACHA]


@pytest.fixture
def worker(shards):
    return ExpertWorker(shards[1])


def _sides(monkeypatch, backbone: list[str], worker: list[str]) -> None:
    """What each end seals with, best first (both live in this process: the backbone's list is the
    name libp2p_owner imported, the worker's is what ``choose_aead`` reads)."""
    monkeypatch.setattr(owner_mod, "local_aeads", lambda: list(backbone))
    monkeypatch.setattr(direct, "local_aeads", lambda: list(worker))


def _sealed_aead(owner) -> str:
    return owner._stream.stream.aead  # CountingStream -> SealedStream


async def _serve_and_compute(worker, rng, lane=None, **owner_kw):
    """An owner of ``worker`` (served with a direct lane) after one compute checked bit for bit."""
    lane = lane or DirectLane("127.0.0.1", 0, max_frame=DEFAULT_MAX_FRAME)
    async with trio.open_nursery() as nursery, served(worker, direct=lane) as wnet, \
            open_host(Identity.generate()) as bnet:
        await nursery.start(lane.serve)
        owner = libp2p_owner(bnet, wnet, worker, **owner_kw)
        for layer in range(worker.info.layer_begin, worker.info.layer_end):
            cur, groups = random_request(worker, rng)
            got = await owner.compute(layer, cur, groups)
            want = worker.compute(layer, *pack_rows(cur, groups))
            assert all(np.array_equal(g, w) for g, w in zip(got, want))
        state = (owner.lane, owner.direct_failed, _sealed_aead(owner) if owner.lane == "direct" else None)
        assert await owner.echo(b"z" * 300_000) == b"z" * 300_000  # a reply-sized record both ways
        await owner.aclose()
        nursery.cancel_scope.cancel()
    return state


@pytest.mark.parametrize("backbone, worker_side, want", [
    (BOTH, BOTH, AES_GCM),  # both have AES instructions
    (BOTH, [CHACHA], CHACHA),  # the worker has none (an ARM phone): ChaCha20-Poly1305
    ([CHACHA], BOTH, CHACHA),  # the backbone has none: the worker takes the backbone's list
    ([CHACHA, AES_GCM], BOTH, CHACHA),  # the backbone's order decides among the common ones
], ids=["both-aes", "worker-no-aes", "backbone-no-aes", "backbone-prefers-chacha"])
async def test_the_lane_is_sealed_with_the_negotiated_aead_and_answers_bit_for_bit(worker, monkeypatch, backbone,
                                                                                   worker_side, want):
    _sides(monkeypatch, backbone, worker_side)
    lane, failed, aead = await _serve_and_compute(worker, np.random.default_rng(7))
    assert (lane, failed, aead) == ("direct", None, want)


async def test_an_older_backbone_gets_chacha_from_a_worker_with_aes(worker, monkeypatch):
    """A hello with ``direct: true`` and no ``direct_aeads`` (a backbone from before the choice):
    the offer says ChaCha20-Poly1305, and a lane opened the old way (no AEAD named) works."""
    _sides(monkeypatch, BOTH, BOTH)
    lane = DirectLane("127.0.0.1", 0, max_frame=DEFAULT_MAX_FRAME)
    async with trio.open_nursery() as nursery, served(worker, direct=lane) as wnet, \
            open_host(Identity.generate()) as bnet:
        await nursery.start(lane.serve)
        offer, hello = await hello_offer(bnet, wnet, worker)
        assert offer["aead"] == CHACHA
        sealed = await direct.open_direct("127.0.0.1", offer["port"], offer["ticket"], offer["key"],
                                          max_frame=DEFAULT_MAX_FRAME)  # the old call: no aead argument
        await send_frame(sealed, proto.pack(dict(hello, direct=False)))
        assert proto.unpack(await FrameReader(sealed).read_frame())["ok"]
        await trio.aclose_forcefully(sealed)
        nursery.cancel_scope.cancel()


async def test_an_older_worker_without_aead_in_its_offer_is_chacha(worker, monkeypatch):
    """A worker from before the choice ignores ``direct_aeads``, seals with ChaCha20-Poly1305 and
    names nothing in its offer: the backbone (with AES, listing it first) opens ChaCha20-Poly1305."""
    _sides(monkeypatch, BOTH, BOTH)
    monkeypatch.setattr(server_mod, "choose_aead", lambda asked: (CHACHA, None))

    class OldLane(DirectLane):
        def offer(self, peer, serve, aead=CHACHA):
            out = super().offer(peer, serve, aead)
            del out["aead"]
            return out

    lane = OldLane("127.0.0.1", 0, max_frame=DEFAULT_MAX_FRAME)
    assert await _serve_and_compute(worker, np.random.default_rng(8), lane=lane) == ("direct", None, CHACHA)


async def test_a_worker_naming_an_aead_we_did_not_offer_is_refused_and_requests_stay_on_libp2p(worker, monkeypatch,
                                                                                                caplog):
    caplog.set_level("INFO")
    _sides(monkeypatch, [CHACHA], BOTH)
    monkeypatch.setattr(server_mod, "choose_aead", lambda asked: (AES_GCM, None))  # ignores our list
    lane = DirectLane("127.0.0.1", 0, max_frame=DEFAULT_MAX_FRAME)
    got = await _serve_and_compute(worker, np.random.default_rng(9), lane=lane)
    assert got[0] == "libp2p" and "chose AEAD 'aes-256-gcm', which we did not offer" in got[1]
    assert lane.redeemed == 0  # refused before dialling
    lines = [r.getMessage() for r in caplog.records if "no direct lane to worker" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0] and "did not offer" in lines[0], lines


async def test_no_aead_in_common_is_said_in_the_hello_and_requests_stay_on_libp2p(worker, monkeypatch, caplog):
    caplog.set_level("INFO")
    _sides(monkeypatch, ["rot13-poly1305"], BOTH)
    lane = DirectLane("127.0.0.1", 0, max_frame=DEFAULT_MAX_FRAME)
    got = await _serve_and_compute(worker, np.random.default_rng(10), lane=lane)
    assert got[0] == "libp2p" and "no AEAD in common" in got[1] and "rot13-poly1305" in got[1]
    assert lane.redeemed == 0 and not lane._tickets  # no ticket was handed out
    lines = [r.getMessage() for r in caplog.records if "no direct lane to worker" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0] and "no AEAD in common" in lines[0], lines


@pytest.mark.parametrize("aead", BOTH)
async def test_a_tampered_or_misread_record_is_refused_under_either_aead(aead):
    key = os.urandom(32)
    a, b = trio.testing.memory_stream_pair()
    tx = SealedStream(a, key, initiator=True, max_record=1 << 20, aead=aead)
    rx = SealedStream(b, key, initiator=False, max_record=1 << 20, aead=aead)
    payload = os.urandom(70_000)
    await tx.send_all(payload)
    assert await rx.receive_some() == payload
    # one flipped ciphertext bit in the next record
    head = struct.pack("!I", len(payload) + 16)
    sealed = bytearray(tx._aead.encrypt(tx._nonce(tx._send_dir, 1), payload, head))
    sealed[1234] ^= 0x10
    await a.send_all(head + bytes(sealed))
    with pytest.raises(FrameError, match="failed authentication"):
        await rx.receive_some()
    # the same key under the other AEAD: nothing opens (a mismatched lane cannot misread silently)
    other = CHACHA if aead == AES_GCM else AES_GCM
    c, d = trio.testing.memory_stream_pair()
    await SealedStream(c, key, initiator=True, max_record=1 << 20, aead=aead).send_all(b"hello")
    with pytest.raises(FrameError, match="failed authentication"):
        await SealedStream(d, key, initiator=False, max_record=1 << 20, aead=other).receive_some()


def test_aes_goes_first_only_with_aes_instructions(tmp_path, monkeypatch):
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 aes pclmulqdq vaes\n\nprocessor\t: 1\n")
    old = tmp_path / "old"
    old.write_text("processor\t: 0\nflags\t\t: fpu sse2 pclmulqdq\n")
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32\n")
    arm_no = tmp_path / "arm_no"
    arm_no.write_text("processor\t: 0\nFeatures\t: fp asimd evtstrm crc32\n")
    assert [direct.cpu_has_aes(str(p)) for p in (x86, old, arm, arm_no)] == [True, False, True, False]
    assert direct.cpu_has_aes(str(tmp_path / "missing")) is False
    monkeypatch.delenv("P2PSWARM_DIRECT_AEAD", raising=False)
    for has, want in ((True, BOTH), (False, [CHACHA])):
        monkeypatch.setattr(direct, "_HAS_AES", has)
        assert direct.local_aeads() == want
        assert direct.choose_aead(None) == (CHACHA, None)  # an older backbone: ChaCha20-Poly1305
        assert direct.choose_aead(BOTH) == (want[0], None)
    monkeypatch.setenv("P2PSWARM_DIRECT_AEAD", CHACHA)
    assert direct.local_aeads() == [CHACHA]
    monkeypatch.setenv("P2PSWARM_DIRECT_AEAD", "des")
    with pytest.raises(UserError, match="P2PSWARM_DIRECT_AEAD='des': not one of chacha20-poly1305, aes-256-gcm"):
        direct.local_aeads()
    monkeypatch.delenv("P2PSWARM_DIRECT_AEAD")
    assert direct.choose_aead("aes")[0] is None  # not a list
