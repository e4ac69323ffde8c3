"""The verification market in process: signed receipts (and `p2pswarm rewards`), ban records, and the
dispatcher's sampled bit-exact verification against real worker objects (ExpertWorker on real
shards; the dishonest one is tests/helpers/dishonest_worker.py's subclass)."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from p2pswarm.backbone.dispatch.dispatcher import Dispatcher, InProcessOwner
from p2pswarm.backbone.sessions.local import ensure_shards
from p2pswarm.engine.kernels import make_bank
from p2pswarm.market.bans import BanKeeper, BanRecord, BanValidator, ban_key
from p2pswarm.market.receipts import ContributionLedger, Receipt, ReceiptStore, check_receipts, load_receipts
from p2pswarm.net.signed.envelope import SignedError, seal
from p2pswarm.market.verify import Verifier, rows_for_confidence
from p2pswarm.model.layout import ModelLayout
from p2pswarm.model.manifest import model_fingerprint
from p2pswarm.net.signed.identity import Identity
from p2pswarm.market.swarm_dht import record_kinds
from p2pswarm.net.signed.records import NodeRecordValidator, RecordError
from p2pswarm.worker.expert_worker import ExpertWorker

from conftest import run_cli
from helpers.dishonest_worker import DishonestWorker
from helpers.ggml import needs_ggml

MODEL = "ab" * 32


# -- receipts ---------------------------------------------------------------------------------------
def _ledger_with_receipts(worker: str, n: int = 3) -> tuple[ContributionLedger, list[Receipt]]:
    ledger = ContributionLedger(Identity.generate(), MODEL)
    out = []
    for i in range(n):
        ledger.add(worker, rows=10 + i, nbytes=1024 * (i + 1))
        ledger.add(worker, rows=1, nbytes=4)
        out += ledger.issue()
    return ledger, out


def test_receipts_sign_store_and_add_up(tmp_path):
    w = Identity.generate().peer_id_str
    ledger, receipts = _ledger_with_receipts(w)
    assert [r.seq for r in receipts] == [1, 2, 3] and receipts[-1].total_rows == 10 + 11 + 12 + 3
    store = ReceiptStore(tmp_path / "r", w)
    for r in receipts:
        assert store.save(r.signed, ledger.identity.peer_id_str).seq == r.seq
    store.save(receipts[0].signed, ledger.identity.peer_id_str)  # a re-sent receipt is stored once
    assert store.stored == 3 and not list((tmp_path / "r").rglob("*.tmp"))
    got, errors = load_receipts(tmp_path / "r")
    assert errors == [] and sorted(r.seq for r in got) == [1, 2, 3]
    [chain] = check_receipts(got)
    assert chain.problems == [] and (chain.rows, chain.requests) == (36, 6) and chain.bytes == 6 * 1024 + 12
    # a receipt for someone else, or relayed by a peer that did not sign it, is refused
    other = Identity.generate().peer_id_str
    with pytest.raises(SignedError, match="names worker"):
        ReceiptStore(tmp_path / "x", other).save(receipts[0].signed)
    with pytest.raises(SignedError, match="arrived from"):
        store.save(receipts[0].signed, other)
    # a missing receipt is a gap in the chain
    [gappy] = check_receipts([receipts[0], receipts[2]])
    assert any("missing" in p for p in gappy.problems)


def test_receipt_forgery_and_tampering_are_refused():
    w = Identity.generate().peer_id_str
    ledger, [r] = _ledger_with_receipts(w, 1)
    mallory = Identity.generate()
    forged = seal(mallory, b"p2pswarm-receipt-v1\x00", {**r.body(), "rows": 10 ** 6, "total_rows": 10 ** 6},
                  max_bytes=4096)  # claims the backbone signed it
    with pytest.raises(SignedError, match="bad signature"):
        Receipt.verify(forged)
    tampered = bytearray(r.signed)
    tampered[-70] ^= 1
    with pytest.raises(SignedError):
        Receipt.verify(bytes(tampered))
    with pytest.raises(SignedError, match="malformed"):
        Receipt.verify(b"\x93garbage")
    # a ban record's signature never verifies as a receipt (domain separation)
    ban = BanRecord.make(ledger.identity, banned=w, model=MODEL, evidence="0" * 64, reason="x", voids_epoch=1,
                         voids_from_seq=1)
    with pytest.raises(SignedError):
        Receipt.verify(ban.signed)


@pytest.mark.slow
def test_rewards_command_lists_verifies_and_reports_corrupt_files(tmp_path):
    w = Identity.generate().peer_id_str
    ledger, receipts = _ledger_with_receipts(w)
    store = ReceiptStore(tmp_path / "rec", w)
    for r in receipts:
        store.save(r.signed, ledger.identity.peer_id_str)
    ok = run_cli("rewards", "--dir", str(tmp_path / "rec"), "--json")
    assert ok.returncode == 0, ok.stderr
    doc = json.loads(ok.stdout)
    assert doc["ok"] and doc["chains"][0]["rows"] == 36 and doc["chains"][0]["worker"] == w
    table = run_cli("rewards", "--dir", str(tmp_path / "rec"))
    assert table.returncode == 0 and " 36 " in table.stdout and "ok" in table.stdout
    bad = store.path_of(receipts[1])
    bad.write_bytes(bad.read_bytes()[:-5])  # truncated on disk
    proc = run_cli("rewards", "--dir", str(tmp_path / "rec"))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert any(str(bad) in line and "malformed receipt" in line for line in lines)
    assert any("missing" in line for line in lines)  # seq 2 is gone from the chain
    missing = run_cli("rewards", "--dir", str(tmp_path / "nope"))
    assert missing.returncode == 2 and "no such receipts folder" in missing.stderr and "Traceback" not in missing.stderr


# -- ban records ------------------------------------------------------------------------------------
def test_ban_records_only_in_their_signers_name():
    bb, worker, mallory = Identity.generate(), Identity.generate().peer_id_str, Identity.generate()
    rec = BanRecord.make(bb, banned=worker, model=MODEL, evidence="f" * 64, reason="layer 1 expert 2",
                         voids_epoch=5, voids_from_seq=3)
    v = BanValidator()
    v.validate(rec.key, rec.signed)
    assert BanRecord.verify(rec.signed, key=ban_key(worker, bb.peer_id_str)).voids_from_seq == 3
    mine = BanRecord.make(mallory, banned=worker, model=MODEL, evidence="f" * 64, reason="x", voids_epoch=1,
                          voids_from_seq=1)
    with pytest.raises(RecordError):  # mallory's (valid) ban stored under bb's key
        v.validate(ban_key(worker, bb.peer_id_str), mine.signed)
    forged = seal(mallory, b"p2pswarm-ban-v1\x00", rec.body(), max_bytes=4096)  # bb's body, mallory's key
    with pytest.raises(RecordError, match="bad signature"):
        v.validate(rec.key, forged)
    with pytest.raises(RecordError):
        v.validate(rec.key, b"not a record")
    assert v.rejected == 3
    # one DHT namespace, several record types: the DHT's validator sends each key to its own kind's
    node_v = NodeRecordValidator(record_kinds())
    node_v.validate(rec.key, rec.signed)
    with pytest.raises(RecordError):
        node_v.validate(f"/p2pswarm/node/{worker}", rec.signed)
    with pytest.raises(RecordError):
        node_v.validate(rec.key, forged)
    assert node_v.rejected == 2


# -- verification against real workers ----------------------------------------------------------------
def _setup(tiny_f32, tmp_path):
    layout = ModelLayout.open(tiny_f32)
    shards = ensure_shards(layout, model_fingerprint(layout), 2, tmp_path)
    owners = [InProcessOwner(ExpertWorker(s, kernel="numpy"), f"w{i}") for i, s in enumerate(shards)]
    return layout, make_bank(layout, "numpy"), owners


def _random_step(rng, layout, n_embd=256):
    """One layer's routed work: n rows, top-4 distinct experts per row, grouped by expert."""
    n = int(rng.integers(1, 9))
    cur = rng.standard_normal((n, n_embd)).astype(np.float32)
    picks = np.stack([rng.choice(layout.n_expert, 4, replace=False) for _ in range(n)])
    groups = [(int(e), np.flatnonzero((picks == e).any(axis=1)).astype(np.int64)) for e in np.unique(picks)]
    return int(rng.integers(0, len(layout.expert_layers))), cur, groups


@pytest.mark.slow
async def test_honest_workers_are_never_banned_over_10000_requests(tiny_f32, tmp_path):
    layout, bank, owners = _setup(tiny_f32, tmp_path)
    disp = Dispatcher(bank, owners)
    disp.verifier = Verifier(1.0, seed=0)  # every row checked: the strictest version of any sample
    ledger = disp.ledger = ContributionLedger(Identity.generate(), MODEL)
    rng = np.random.default_rng(1)
    while disp.stats.requests < 10_000:
        layer, cur, groups = _random_step(rng, layout)
        outs = await disp.run_groups(layer, cur, groups)
        if disp.stats.layers % 97 == 0:  # and an independent check of what the step used
            assert all(np.array_equal(o, r) for o, r in zip(outs, bank.forward_groups(layer, cur, groups)))
    s = disp.stats
    assert disp.bans.banned == {} and s.mismatches == 0 and s.fallbacks == 0
    assert s.verified_groups == s.remote_groups > 10_000
    assert sum(a.requests for a in ledger.accounts.values()) == s.requests
    assert sum(a.rows for a in ledger.accounts.values()) == s.remote_rows


@pytest.mark.slow
async def test_dishonest_worker_caught_as_the_sample_rate_predicts(tiny_f32, tmp_path):
    """P(caught within n rows) = 1 - (1 - r p)^n for one-row groups: 80 independent backbones
    (seeds) against a worker falsifying p = 5% of its rows, sampled at r = 0.2 (r p = 1%)."""
    layout = ModelLayout.open(tiny_f32)
    shards = ensure_shards(layout, model_fingerprint(layout), 2, tmp_path)
    bank = make_bank(layout, "numpy")
    honest = ExpertWorker(shards[0], kernel="numpy")
    r, p, trials = 0.2, 0.05, 80
    caught_at, rng = [], np.random.default_rng(2)
    for t in range(trials):
        liar = DishonestWorker(shards[1], kernel="numpy", fraction=p, delta=1e-3, seed=1000 + t)
        disp = Dispatcher(bank, [InProcessOwner(honest, "h"), InProcessOwner(liar, "liar")])
        disp.verifier = Verifier(r, seed=t)
        seen = []
        disp.on_mismatch = lambda peer, ev: seen.append(ev)
        while not seen and disp.verifier.rows_served.get("liar", 0) < 5000:
            layer = int(rng.integers(0, 4))
            cur = rng.standard_normal((1, 256)).astype(np.float32)
            groups = [(e, np.array([0])) for e in (1, 9, 12, 15)]  # one-row groups, 3 to the liar
            outs = await disp.run_groups(layer, cur, groups)
            if seen:  # the detecting step already uses the replica's outputs for all the liar's groups
                assert all(np.array_equal(o, w) for o, w in zip(outs, bank.forward_groups(layer, cur, groups)))
        assert seen and disp.bans.banned.keys() == {"liar"} and seen[0].max_abs_delta > 0
        caught_at.append(seen[0].rows_served)
        assert [o.name for o in disp.assign(0, [(9, np.array([0]))])] == ["local"]  # banned: never asked again
    mean, expect = float(np.mean(caught_at)), 1 / (r * p)
    assert 0.6 * expect < mean < 1.5 * expect, (mean, expect)
    n90 = rows_for_confidence(r, p, 0.9)
    assert math.isclose(n90, math.log(0.1) / math.log(1 - r * p))
    within = np.mean(np.array(caught_at) <= n90 + 2)  # +2: the rest of the detecting request
    assert within >= 0.75, (within, caught_at)


@pytest.mark.slow
async def test_every_row_checked_means_outputs_stay_exact_throughout(tiny_f32, tmp_path):
    layout = ModelLayout.open(tiny_f32)
    shards = ensure_shards(layout, model_fingerprint(layout), 2, tmp_path)
    bank = make_bank(layout, "numpy")
    liar = DishonestWorker(shards[1], kernel="numpy", fraction=0.01, delta=1e-3, seed=3)
    ident = Identity.generate()
    disp = Dispatcher(bank, [InProcessOwner(ExpertWorker(shards[0], kernel="numpy"), "h"), InProcessOwner(liar, "liar")])
    disp.verifier = Verifier(1.0, seed=0)
    ledger = disp.ledger = ContributionLedger(ident, MODEL)
    keeper = BanKeeper(ident, MODEL, disp.bans, ledger=ledger)  # no DHT here: the ban is local and queued
    disp.on_mismatch = keeper.ban
    rng = np.random.default_rng(4)
    for step in range(400):
        layer, cur, groups = _random_step(rng, layout)
        outs = await disp.run_groups(layer, cur, groups)
        assert all(np.array_equal(o, w) for o, w in zip(outs, bank.forward_groups(layer, cur, groups))), step
        if step == 5:
            ledger.issue()  # the liar has receipts before it is caught
    assert liar.falsified > 0 and keeper.is_banned("liar") and disp.stats.mismatches == 1
    rec = keeper.issued["liar"]
    assert BanRecord.verify(rec.signed, key=rec.key).voids_from_seq == 1 and rec.voids_epoch == ledger.epoch
    assert ledger.accounts["liar"].banned and ledger.pending().get("liar") is None  # voided, none sent
    assert "h" in ledger.pending() or ledger.accounts["h"].requests > 0


@needs_ggml
async def test_checks_cost_the_rate_where_rows_are_exact_alone(tiny_q8, tmp_path):
    """With libggml on Q8_0 the backbone's probe finds the experts row-invariant, so the verifier
    recomputes only the sampled rows of a group, not every row of a group one row of which was
    drawn: the rows recomputed are about ``rate`` of those served (whole groups of ~16 rows were
    ~15% at rate 1%), an honest worker is never banned for it, and a worker lying on one row is
    still caught on the check that draws that row."""
    from p2pswarm.backbone.serving.runner import PROBE_ROWS, Backbone
    from p2pswarm.engine.arch import load_dense

    layout = ModelLayout.open(tiny_q8)
    shards = ensure_shards(layout, model_fingerprint(layout), 2, tmp_path)
    bank = make_bank(layout, "ggml")
    liar = DishonestWorker(shards[1], kernel="ggml", fraction=0.02, delta=1e-3, seed=5, honest_rows=3000)
    disp = Dispatcher(bank, [InProcessOwner(ExpertWorker(shards[0], kernel="ggml"), "h"), InProcessOwner(liar, "liar")])
    assert disp.exact_rows == 1  # nothing measured yet: whole groups
    Backbone(load_dense(layout), disp)._probe_row_invariance()
    assert disp.exact_rows == PROBE_ROWS
    r = 0.05
    disp.verifier = Verifier(r, seed=7)
    seen = []
    disp.on_mismatch = lambda peer, ev: seen.append(ev)
    rng = np.random.default_rng(8)
    local_rows = []
    real = disp.local.compute

    async def counted(layer, cur, groups):
        local_rows.append(sum(len(idx) for _, idx in groups))
        return await real(layer, cur, groups)

    disp.local.compute = counted
    while not seen:
        cur = rng.standard_normal((64, 256)).astype(np.float32)  # a 64-sequence decode step (n_embd 256)
        picks = np.stack([rng.choice(layout.n_expert, 4, replace=False) for _ in range(64)])
        groups = [(int(e), np.flatnonzero((picks == e).any(axis=1)).astype(np.int64)) for e in np.unique(picks)]
        layer = int(rng.integers(0, len(layout.expert_layers)))
        outs = await disp.run_groups(layer, cur, groups)
        if seen:  # the detecting step uses the replica's outputs for every group of the liar
            assert all(np.array_equal(o, w) for o, w in zip(outs, bank.forward_groups(layer, cur, groups)))
        assert disp.stats.layers < 2000, "the liar was never caught"
    v = disp.verifier
    assert seen[0].rows_in_group < 16 and disp.bans.banned.keys() == {"liar"} and "h" not in disp.bans.banned
    served, checked = v.rows_served["h"], v.rows_checked["h"]
    assert served > 1000 and 0.5 * r < checked / served < 2 * r, (checked, served)  # whole groups: ~0.5
    assert sum(local_rows[:-1]) < 3 * r * (v.rows_served["h"] + v.rows_served["liar"])


def test_pick_equals_a_per_group_draw():
    """Verifier.pick visits only the groups with a draw: the same picks as reading every group's
    slice of the draws (the rule it replaced), on the same random stream."""
    rng = np.random.default_rng(3)
    for t in range(20):
        groups = [(int(e), np.arange(int(rng.integers(1, 9)))) for e in range(int(rng.integers(0, 300)))]
        rate, exact = float(rng.choice([0.01, 0.2, 0.7])), int(rng.integers(1, 5))
        draws = Verifier(rate, seed=t)._rng("w").random(sum(len(i) for _, i in groups)) < rate
        want, pos = [], 0
        for i, (_, idx) in enumerate(groups):
            sel = draws[pos : pos + len(idx)]
            if sel.any():
                want.append((i, (np.flatnonzero(sel) if len(idx) <= exact else np.arange(len(idx))).tolist()))
            pos += len(idx)
        got = Verifier(rate, seed=t).pick("w", groups, exact)
        assert [(i, at.tolist()) for i, at in got] == want


async def test_a_layers_checks_make_one_local_call(tiny_f32, tmp_path):
    """The verifier's recomputation of every remote owner's picks of a layer is *one* call to the
    local replica (not one per owner), of the same rows a per-owner draw picks (one random stream
    per worker), and the step's outputs stay the replica's bits; a liar among the owners is still
    caught on the step that draws a falsified row, and that step uses the replica for its groups."""
    layout = ModelLayout.open(tiny_f32)
    shards = ensure_shards(layout, model_fingerprint(layout), 4, tmp_path)
    bank = make_bank(layout, "numpy")
    liar = DishonestWorker(shards[3], kernel="numpy", fraction=0.3, delta=1e-3, seed=2, honest_rows=60)
    owners = [InProcessOwner(ExpertWorker(s, kernel="numpy"), f"w{i}") for i, s in enumerate(shards[:3])]
    disp = Dispatcher(bank, owners + [InProcessOwner(liar, "liar")])
    disp.verifier, twin = Verifier(0.3, seed=5), Verifier(0.3, seed=5)
    seen: list = []
    disp.on_mismatch = lambda peer, ev: seen.append(ev)
    calls: list[list[tuple[int, list[int]]]] = []
    real = disp.local.compute

    async def counted(layer, cur, groups):
        calls.append([(int(e), idx.tolist()) for e, idx in groups])
        return await real(layer, cur, groups)

    disp.local.compute = counted
    rng = np.random.default_rng(6)
    steps = 0
    while not seen:
        layer, cur, groups = _random_step(rng, layout)
        by_owner = {owner.name: og for owner, og in disp.assign(layer, groups).items()}
        want = [(og[i][0], og[i][1][at].tolist()) for name, og in by_owner.items() if name != "local"
                for i, at in twin.pick(name, og, disp.exact_rows)]
        del calls[:]
        outs = await disp.run_groups(layer, cur, groups)
        lied = {e for e, _ in by_owner.get("liar", [])} if not seen else set()  # (unchecked rows are used)
        assert all(np.array_equal(o, w) for o, w, (e, _) in zip(outs, bank.forward_groups(layer, cur, groups), groups)
                   if e not in lied)
        if seen:  # the detecting step: the checks' call, then the liar's groups recomputed here
            assert len(calls) == 2 and calls[0] and sorted(calls[0]) == sorted(want)
            break
        assert len(calls) == (1 if want else 0) and sorted(calls[0] if calls else []) == sorted(want), steps
        steps += 1
        assert steps < 500, "the liar was never caught"
    assert steps > 3 and disp.bans.banned.keys() == {"liar"} and disp.stats.fallbacks == 0
