"""Coverage units and signed node records: round trip, forgeries, malformed input, DHT validator."""
from __future__ import annotations

import time

import msgpack
import pytest

from p2pswarm.engine.ggml.lib import _CPU_FEATURES
from p2pswarm.engine.kernels import kernel_id
from p2pswarm.net.wire.expert_protocol import MAX_KERNEL_ID_CHARS
from p2pswarm.net.signed.identity import Identity
from p2pswarm.net.signed.records import (DEFAULT_BLOCK_SIZE, MAX_RECORD_BYTES, SIGNING_DOMAIN, CoverageUnit, NodeRecord,
                                  NodeRecordValidator, RecordError, ShardEntry, model_key, node_record_key, units_for)

MODEL = "ab" * 32
SHARD = ShardEntry(MODEL, "cd" * 32, (0, 4), (8, 24))


def _record(ident: Identity, **kw) -> NodeRecord:
    args = dict(addrs=["/ip4/127.0.0.1/tcp/4001"], protocol=1, kernel="numpy", block_size=8, shards=[SHARD],
                ttl_s=600)
    args.update(kw)
    return NodeRecord.make(ident, **args)


def _resign(ident: Identity, body: dict) -> bytes:
    """A record with an arbitrary body, correctly signed by ``ident`` (tests semantic checks)."""
    raw = msgpack.packb(body, use_bin_type=True)
    return msgpack.packb({"body": raw, "sig": ident.sign(SIGNING_DOMAIN + raw)}, use_bin_type=True)


def test_units_cover_a_shard_exactly():
    units = units_for(MODEL, (0, 2), (8, 24), 8)
    assert [(u.layer, u.block) for u in units] == [(0, 1), (0, 2), (1, 1), (1, 2)]
    # a range that straddles blocks provides every block it touches
    assert [u.block for u in units_for(MODEL, (0, 1), (5, 17), 8)] == [0, 1, 2]
    assert units_for(MODEL, (0, 1), (5, 5), 8) == []
    keys = {u.key() for u in units_for(MODEL, (0, 4), (0, 64), 8)}
    assert len(keys) == 32 and all(len(k) == 34 and k[:2] == b"\x12\x20" for k in keys)
    # the key depends on every part of the unit, block size included
    base = CoverageUnit(MODEL, 3, 1, 8).key()
    assert len({base, CoverageUnit(MODEL, 3, 1, 16).key(), CoverageUnit(MODEL, 3, 2, 8).key(),
                CoverageUnit(MODEL, 4, 1, 8).key(), CoverageUnit("ef" * 32, 3, 1, 8).key()}) == 5
    assert str(CoverageUnit(MODEL, 3, 1, 8)) == "layer 3 experts 8-15"


def test_signed_record_round_trip():
    ident = Identity.generate()
    rec = _record(ident)
    got = NodeRecord.verify(rec.signed, peer=ident.peer_id_str)
    assert got == rec
    assert got.live() and not got.withdrawn
    assert got.shard_for(MODEL, 3, 23) == SHARD and got.shard_for(MODEL, 4, 8) is None
    assert got.fingerprint(SHARD).short().startswith("protocol 1, model abababababab")
    assert [(u.layer, u.block) for u in got.units()][:2] == [(0, 1), (0, 2)]
    assert len(rec.signed) < 1024


def test_forged_records_rejected():
    owner, forger = Identity.generate(), Identity.generate()
    rec = _record(owner)
    # 1. the forger signs a body that claims to be the owner
    forged = _resign(forger, rec.body())
    with pytest.raises(RecordError, match="bad signature"):
        NodeRecord.verify(forged)
    # 2. one byte of the owner's body changed after signing (a new address, say)
    outer = msgpack.unpackb(rec.signed)
    body = msgpack.unpackb(outer["body"])
    body["addrs"] = ["/ip4/6.6.6.6/tcp/4001"]
    tampered = msgpack.packb({"body": msgpack.packb(body), "sig": outer["sig"]})
    with pytest.raises(RecordError, match="bad signature"):
        NodeRecord.verify(tampered)
    # 3. a valid record of another peer offered under the owner's key
    with pytest.raises(RecordError, match="expected"):
        NodeRecord.verify(_record(forger).signed, peer=owner.peer_id_str)
    # 4. signing someone else's record is refused at the source
    with pytest.raises(RecordError, match="only be signed by the peer it describes"):
        NodeRecord(**{**rec.__dict__, "signed": b""}).sign(forger)


def _body(ident, **over):
    now = int(time.time())
    b = {"v": 1, "peer": ident.peer_id_str, "addrs": ["/ip4/127.0.0.1/tcp/1"], "protocol": 1, "kernel": "numpy",
         "block_size": 8, "shards": [SHARD.to_wire()], "seq": 1, "issued": now, "expires": now + 60,
         "withdrawn": False}
    b.update(over)
    return b


@pytest.mark.parametrize("over, needle", [
    ({"v": 2}, "version"),
    ({"addrs": "x"}, "addrs must be a list"),
    ({"addrs": ["not a multiaddr"]}, "bad address"),
    ({"addrs": ["/ip4/1.2.3.4/tcp/1/p2p/12D3KooWFiQeFpMbxV1LBtipkZkQUvz3mqfFJv5kMbEWcAXemEnL"]}, "must not carry /p2p/"),
    ({"addrs": ["/ip4/1.2.3.4/tcp/1"] * 17}, "at most 16"),
    ({"protocol": "1"}, "protocol must be an integer"),
    ({"block_size": 0}, "block_size"),
    ({"kernel": ""}, "kernel"),
    ({"kernel": "k" * (MAX_KERNEL_ID_CHARS + 1)}, "kernel"),
    ({"shards": [{"model": MODEL, "shard": "x", "layers": [3, 3], "experts": [0, 8]}]}, "empty layers"),
    ({"shards": [{"model": MODEL, "shard": "x", "layers": [0, 1]}]}, "experts must be"),
    ({"shards": ["x"]}, "not a map"),
    ({"withdrawn": 0}, "withdrawn must be a boolean"),
    ({"seq": -1}, "seq"),
    ({"expires": 1}, "bad lifetime"),
    ({"issued": int(time.time()) + 3600, "expires": int(time.time()) + 7200}, "in the future"),
    ({"issued": 1000, "expires": 2000}, "expired"),
])
def test_malformed_but_signed_records_rejected(over, needle):
    ident = Identity.generate()
    with pytest.raises(RecordError, match=needle):
        NodeRecord.verify(_resign(ident, _body(ident, **over)))


def test_long_kernel_ids_fit_a_record():
    """A ggml kernel id lists every SIMD path of its CPU build: 131 characters on a CPU with AVX-512
    and AMX, past the 128 a record's kernel field once allowed; every worker on such a CPU had its
    record refused by every peer (a swarm with no owners). Every feature at once must fit."""
    ident = Identity.generate()
    every = "ggml-0.25.3-0c1e570/x86_64+" + "+".join(_CPU_FEATURES)
    for kid in (every, kernel_id("auto"), "portable-1/aarch64"):
        rec = _record(ident, kernel=kid)
        assert NodeRecord.verify(rec.signed, peer=ident.peer_id_str).kernel == kid
    assert len(every) <= MAX_KERNEL_ID_CHARS


def test_a_record_peers_would_refuse_fails_when_made():
    """A node's own record is read back as a peer would read it before it is published: a
    malformed one is a one-line error at start-up, not a record every DHT peer drops in silence."""
    with pytest.raises(RecordError, match="kernel must be a short string") as info:
        _record(Identity.generate(), kernel="k" * (MAX_KERNEL_ID_CHARS + 1))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("data", [
    b"", b"\xc1", msgpack.packb([1, 2]), msgpack.packb({"body": "str", "sig": b"x"}),
    msgpack.packb({"body": b"\xc1", "sig": b"x"}), msgpack.packb({"body": msgpack.packb([1]), "sig": b"x"}),
    b"\x00" * (MAX_RECORD_BYTES + 1), "not bytes",
])
def test_garbage_rejected_with_one_line(data):
    with pytest.raises(RecordError) as info:
        NodeRecord.verify(data)
    assert "\n" not in str(info.value)


def test_expired_and_withdrawn():
    ident = Identity.generate()
    old = _record(ident, ttl_s=10, now=time.time() - 100)
    with pytest.raises(RecordError, match="expired"):
        NodeRecord.verify(old.signed)
    assert not NodeRecord.verify(old.signed, allow_expired=True).live()
    gone = _record(ident, withdrawn=True)
    assert not NodeRecord.verify(gone.signed).live()


def test_dht_validator_checks_key_and_keeps_newest():
    a, b = Identity.generate(), Identity.generate()
    v = NodeRecordValidator({})  # node records only
    r1 = _record(a, seq=10)
    r2 = _record(a, seq=11, addrs=["/ip4/127.0.0.1/tcp/4002"])
    v.validate(node_record_key(a.peer_id_str), r1.signed)
    with pytest.raises(RecordError):
        v.validate(node_record_key(b.peer_id_str), r1.signed)  # a's record under b's key
    with pytest.raises(RecordError):
        v.validate("/p2pswarm/other/x", r1.signed)
    with pytest.raises(RecordError):
        v.validate(node_record_key(a.peer_id_str), _resign(b, r1.body()))
    assert v.rejected == 3
    key = node_record_key(a.peer_id)
    assert v.select(key, [r1.signed, r2.signed]) == 1
    assert v.select(key, [r2.signed, r1.signed]) == 0
    assert v.select(key, [b"junk", r1.signed]) == 1  # an invalid value never wins


def test_model_key_names_the_model_not_the_block_size():
    k = model_key(MODEL)
    assert len(k) == 34 and k[:2] == b"\x12\x20"
    assert k == model_key(MODEL.upper()) and k != model_key("ef" * 32)
    assert k not in {u.key() for u in units_for(MODEL, (0, 4), (0, 64), DEFAULT_BLOCK_SIZE)}


def test_default_block_size_is_one_value_and_the_docs_say_it():
    import inspect
    from pathlib import Path

    import p2pswarm.net.signed.records as records

    src = inspect.getsource(records)
    assert src.count("DEFAULT_BLOCK_SIZE =") == 1
    protocol = (Path(__file__).resolve().parent.parent / "docs" / "protocol.md").read_text()
    assert f"default {DEFAULT_BLOCK_SIZE} experts" in protocol


def test_unusable_reason_names_what_differs():
    ident = Identity.generate()
    ours = dict(model=MODEL, protocol=1, kernel="numpy", block_size=8)
    assert _record(ident).unusable_reason(**ours) is None
    cases = [(dict(kernel="ggml-0.3.36/x86_64+avx2"), "kernel mismatch: worker computes with 'ggml-0.3.36/x86_64+avx2',"
                                                       " we with 'numpy'"),
             (dict(block_size=4), "block size mismatch: worker provides units of 4 experts, we look up units of 8"),
             (dict(protocol=2), "protocol version mismatch: worker speaks 2, we 1"),
             (dict(shards=[ShardEntry("ef" * 32, "s", (0, 1), (0, 8))]), f"model mismatch: worker serves {'ef' * 32}")]
    for change, needle in cases:
        reason = _record(ident, **change).unusable_reason(**ours)
        assert reason is not None and reason.startswith(needle), reason


def test_same_content_ignores_only_times_and_seq():
    ident = Identity.generate()
    a = _record(ident, seq=1, now=time.time() - 30)
    assert a.same_content(_record(ident, seq=2))  # a periodic re-publication
    assert not a.same_content(None)
    for change in (dict(addrs=["/ip4/127.0.0.1/tcp/4002"]), dict(kernel="ggml-x"), dict(block_size=4),
                   dict(shards=[ShardEntry(MODEL, "ee" * 32, (0, 4), (8, 24))]), dict(withdrawn=True)):
        assert not a.same_content(_record(ident, seq=3, **change)), change
