"""The backbone's experts as a bounded cache (issue 41): ``--expert-cache none | N% | all`` and a
backbone started from the backbone file give logits bit-identical to the monolithic run, through
worker processes, and the workers compute every unit the cache lacks (no fallback: the local
replica refuses a unit it does not hold, so a silent local computation would fail the run).

A unit that no live owner holds and the cache lacks ends the step with :class:`UnitsUnavailable`
(HTTP 503) naming it, at once when the backbone fetches nothing; a bad ``--expert-cache`` and a
size that does not fit free memory are refused in one line."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from p2pswarm.backbone.owners import expert_cache as ec
from p2pswarm.backbone.sessions.local import open_backbone
from p2pswarm.errors import UnitsUnavailable, UserError
from p2pswarm.model.layout import ModelLayout
from p2pswarm.model.manifest import model_fingerprint
from p2pswarm.model.slicer import slice_backbone

from helpers.expert_cache import ARCHS, _complete, arch_model
from helpers.procs import shard_swarm
from p2pswarm.backbone.serving.generate import sequence_logits

TOKENS = [5, 211, 37, 90, 14, 14, 14, 302, 8, 66, 129, 3, 250, 77, 41, 19]
async def logits_of(path, tokens=TOKENS, kernel="numpy", **kw):
    """(prefill, decode) logits and the dispatcher of one backbone."""
    async with open_backbone(path, kernel=kernel, **kw) as swarm:
        return await _both(swarm, tokens)


async def _both(swarm, tokens):
    bb = swarm.backbone
    prefill = await sequence_logits(bb, tokens)
    decode = await sequence_logits(bb, tokens, decode=True)
    return prefill, decode, bb.dispatcher


def test_cache_size_parsing_and_refusals(monkeypatch):
    p = ec.parse_cache_size
    assert p("all").kind == "all" and p("none").kind == "none" and p("0").kind == "none"
    assert p("10%").bytes_of(1000) == 100 and p("1.5GB").bytes_of(10 ** 12) == 1_500_000_000
    for bad in ("banana", "110%", "-3GB", ""):
        with pytest.raises(UserError, match="--expert-cache"):
            p(bad)
    monkeypatch.setattr(ec, "available_memory", lambda: 50_000_000)
    with pytest.raises(UserError) as err:
        ec.cache_bound(p("80MB"), 200_000_000, holds_experts=False, what="m.gguf")
    assert "80.0 MB" in str(err.value) and "50.0 MB of memory available" in str(err.value)
    # the default for a file without experts: what fits half the available memory, stated
    assert ec.cache_bound(None, 200_000_000, holds_experts=False, what="m.gguf") == 25_000_000
    assert ec.cache_bound(None, 200_000_000, holds_experts=True, what="m.gguf") == 200_000_000


def test_bad_expert_cache_flag_is_one_line(tiny_f32, tmp_path):
    env = dict(os.environ, P2PSWARM_HOME=str(tmp_path / "home"))
    proc = subprocess.run([sys.executable, "-m", "p2pswarm.cli", "node", "--role", "backbone", "--model",
                           str(tiny_f32), "--expert-cache", "lots", "--http", "off"],
                          capture_output=True, text=True, env=env, timeout=120, stdin=subprocess.DEVNULL)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--expert-cache 'lots'" in proc.stderr.strip().splitlines()[-1]


@pytest.mark.slow
@pytest.mark.parametrize("arch", list(ARCHS))
async def test_cache_none_partial_all_exact_through_worker_processes(models_dir, arch):
    """none: 2 worker processes compute every routed expert; 50%: the cache holds experts 0-7 of
    every layer and the one worker left holds 8-15 (no replica of 0-7 in the swarm: the cache
    computes them); all: as today. Each bit-identical to the monolithic run, no fallback."""
    path = arch_model(models_dir, arch)
    mono_p, mono_d, _ = await logits_of(path)

    p, d, disp = await logits_of(path, workers=2, expert_cache=ec.parse_cache_size("none"))
    s = disp.stats
    assert s.local_groups == 0 and s.fallbacks == 0 and s.remote_groups > 0
    assert disp.cache.stats.hits == 0 and disp.cache.stats.misses > 0 and not disp.cache.held
    assert np.array_equal(p, mono_p) and np.array_equal(d, mono_d)

    async with open_backbone(path, workers=2, kernel="numpy", expert_cache=ec.parse_cache_size("50%")) as swarm:
        cache = swarm.cache
        n_expert = cache.n_expert
        assert {e for _, e in cache.held} == set(range(n_expert // 2))  # every layer's first half
        first = swarm.owners[0]  # holds experts 0-7: take it out of the swarm
        swarm.backbone.dispatcher.owners.remove(first)
        p, d, disp = await _both(swarm, TOKENS)
        s = disp.stats
        assert s.fallbacks == 0 and s.local_groups > 0 and s.remote_groups > 0
        assert set(s.per_owner) == {"local", swarm.owners[1].name}
        assert cache.stats.hits == s.local_groups and cache.stats.misses == s.remote_groups
    assert np.array_equal(p, mono_p) and np.array_equal(d, mono_d)

    p, d, disp = await logits_of(path, workers=2, expert_cache=ec.parse_cache_size("all"))
    assert disp.stats.fallbacks == 0 and disp.cache is None
    assert np.array_equal(p, mono_p) and np.array_equal(d, mono_d)


async def test_unit_nobody_holds(models_dir, tmp_path):
    """Cache none and the replica of experts 0-7 gone. A backbone on the full model caches those
    units from its own file (the text does not change); one started from the backbone file, with
    nothing to fetch them from, fails the step at once with UnitsUnavailable naming them."""
    path = arch_model(models_dir, "qwen35moe")
    mono_p, _, _ = await logits_of(path)
    async with open_backbone(path, workers=2, kernel="numpy", expert_cache=ec.parse_cache_size("none")) as swarm:
        swarm.backbone.dispatcher.owners.remove(swarm.owners[0])
        got = await sequence_logits(swarm.backbone, TOKENS)
        assert swarm.cache.stats.fetches > 0 and {e for _, e in swarm.cache.held} <= set(range(8))
        assert swarm.backbone.dispatcher.stats.fallbacks == 0
    assert np.array_equal(got, mono_p)

    bfile = tmp_path / "backbone.gguf"
    slice_backbone(path, bfile)
    async with open_backbone(bfile, kernel="numpy", expert_cache=ec.parse_cache_size("none")) as swarm:
        assert swarm.fingerprint == model_fingerprint(ModelLayout.open(path))  # the source's: workers match it
        assert swarm.cache.store.disk_bytes() < 64 << 10  # a sparse store: the header, no expert bytes
        with pytest.raises(UnitsUnavailable) as err:
            await sequence_logits(swarm.backbone, TOKENS)
    msg = str(err.value)
    assert "no live owner holds expert(s)" in msg and "fetches none" in msg and err.value.experts


@pytest.mark.slow
@pytest.mark.parametrize("arch", list(ARCHS))
def test_backbone_file_through_the_libp2p_swarm(models_dir, arch, tmp_path):
    """The backbone file (no routed experts) as the backbone's model: `logits --swarm` over two
    worker processes found in the DHT equals the full model's monolithic run, prefill and decode;
    every routed expert came from the workers, none from the backbone."""
    path = arch_model(models_dir, arch)
    bfile = tmp_path / "backbone.gguf"
    slice_backbone(path, bfile)
    assert not ModelLayout.open(bfile).expert_tensors
    env = dict(os.environ, P2PSWARM_KERNEL="numpy", P2PSWARM_HOME=str(tmp_path / "home"),
               P2PSWARM_CACHE=str(tmp_path / "cache"))
    with shard_swarm(path, tmp_path, env, [(0, 8), (8, 16)]) as (boot, _):
        for decode in (False, True):
            flag = ["--decode"] if decode else []
            mono, out = tmp_path / f"mono{decode}.npy", tmp_path / f"bb{decode}.npy"
            for model, o, where in ((path, mono, []), (bfile, out, ["--swarm", boot.addr, "--expert-cache", "none"])):
                proc = subprocess.run([sys.executable, "-m", "p2pswarm.cli", "logits", str(model), "--tokens",
                                       ",".join(map(str, TOKENS)), "--out", str(o), "--json", *where, *flag],
                                      capture_output=True, text=True, env=env, timeout=300, stdin=subprocess.DEVNULL)
                assert proc.returncode == 0, proc.stderr[-3000:]
            stats = json.loads(proc.stdout)
            assert stats["fallbacks"] == 0 and stats["local_groups"] == 0 and stats["remote_groups"] > 0, stats
            assert stats["expert_cache"]["units"] == 0 and stats["expert_cache"]["misses"] > 0
            assert np.array_equal(np.load(mono), np.load(out))


@pytest.mark.slow
def test_every_replica_killed_mid_generation_then_no_holder(models_dir, tmp_path):
    """A backbone from the backbone file with --expert-cache none, two workers (experts 0-7 and
    8-15, one replica each) and a serve-shards seeder that corrupts its first chunk. The worker of
    0-7 is killed mid-generation: the backbone fetches those units' slabs from the seeder, checked
    against the manifest (the corrupted slab is reported with its source, never cached; asked
    again), caches and computes them, and the text is the one the whole swarm gave. With the
    seeder gone too (the cache trimmed back to none), a request ends with a 503 naming the units."""
    import httpx

    from conftest import run_cli
    from helpers.procs import Proc, start_bootstrap, start_shard_workers
    from p2pswarm.model.manifest import source_fingerprint

    path = arch_model(models_dir, "qwen35moe")
    bfile = tmp_path / "backbone.gguf"
    slice_backbone(path, bfile)
    env = dict(os.environ, P2PSWARM_KERNEL="numpy", P2PSWARM_HOME=str(tmp_path / "home"),
               P2PSWARM_CACHE=str(tmp_path / "cache"))
    fp = source_fingerprint(ModelLayout.open(path))
    issuer_key = tmp_path / "issuer.key"
    issuer = run_cli("identity", "--path", str(issuer_key), env=env, check=True).stdout.split()[-1]
    bb_id = run_cli("identity", "--path", str(tmp_path / "bb.key"), env=env, check=True).stdout.split()[-1]
    manifest = tmp_path / "m.manifest"
    run_cli("manifest", "--model", str(path), "--key", str(issuer_key), "--out", str(manifest), env=env, check=True)
    token = tmp_path / "bb.token"
    run_cli("token", "issue", "--key", str(issuer_key), "--peer", bb_id, "--allow", f"shard:{fp}", "--ttl", "1h",
            "--out", str(token), env=env, check=True)
    nodes: list = []
    try:
        boot = start_bootstrap(tmp_path, env)
        nodes.append(boot)
        seed_id = run_cli("identity", "--path", str(tmp_path / "seed.key"), env=env, check=True).stdout.split()[-1]
        seeder = Proc(["--corrupt-chunks", "1", "serve-shards", "--model", str(path), "--manifest", str(manifest),
                       "--trust-issuer", issuer, "--bootstrap", boot.addr, "--identity", str(tmp_path / "seed.key")],
                      tmp_path / "seed.log", env, entry=[str(Path(__file__).parent / "helpers" / "faulty_serve_shards.py")])
        nodes.append(seeder)
        w0, w1 = start_shard_workers(path, tmp_path, env, [(0, 8), (8, 16)], boot.addr, ("--ttl", "600"))
        nodes += [w0, w1]
        bb = Proc(["node", "--role", "backbone", "--model", str(bfile), "--expert-cache", "none", "--token",
                   str(token), "--trust-issuer", issuer, "--bootstrap", boot.addr, "--http", "127.0.0.1:0",
                   "--identity", str(tmp_path / "bb.key"), "--cache-refill", "1", "--verify-rate", "0"],
                  tmp_path / "bb.log", env)
        nodes.append(bb)
        base = next(w for w in bb.ready if w.startswith("http="))[5:]
        assert ", 0 missing" in bb.text(), bb.text()[-2000:]
        whole = _complete(base, "hello swarm", 24)
        assert "fetched" not in bb.text()  # the workers computed every expert

        def kill_at(i: int) -> None:
            if i == 4:
                w0.kill()

        assert _complete(base, "hello swarm", 24, on_piece=kill_at) == whole
        log = bb.text()
        assert "fetched" in log and f"source {seed_id} sent a slab" in log and "fails its manifest hash" in log, \
            log[-3000:]
        metrics = httpx.get(base + "/metrics", timeout=30).text
        assert "p2pswarm_expert_cache_bad_slabs_total 1.0" in metrics
        assert "p2pswarm_expert_cache_fetches_total 0.0" not in metrics
        seeder.stop()
        time.sleep(2.5)  # two refills: the fetched units are dropped again (--expert-cache none)
        t0 = time.monotonic()
        r = httpx.post(base + "/v1/completions", json={"prompt": "hello swarm", "max_tokens": 4, "temperature": 0},
                       timeout=120)
        assert r.status_code == 503, r.text
        msg = r.json()["error"]["message"]
        assert "no live owner holds expert(s)" in msg and "coverage units L" in msg
        assert time.monotonic() - t0 < 45  # the stated bound (30 s) plus a step's own time
    finally:
        for n in reversed(nodes):
            n.stop()


async def test_refill_by_demand_status_metrics_and_demand_record(models_dir):
    """The cache moves to the hottest units by the dispatcher's measured demand (only what fits;
    a pinned unit is never dropped); /metrics, the status snapshot and the signed demand record
    show it (the record flags the units the backbone lacks)."""
    from prometheus_client import generate_latest

    from p2pswarm.backbone.dispatch.dispatcher import DemandCounter
    from p2pswarm.backbone.api.metrics import BackboneMetrics
    from p2pswarm.backbone.api.status_page import SwarmView
    from p2pswarm.market.demand import DemandRecord
    from p2pswarm.net.signed.identity import Identity

    path = arch_model(models_dir, "deepseek2")
    async with open_backbone(path, workers=2, kernel="numpy", expert_cache=ec.parse_cache_size("25%")) as swarm:
        cache, d = swarm.cache, swarm.backbone.dispatcher
        assert d.hot_experts is False  # open_backbone's default; None would turn it on for a cache
        layers = cache.layers
        per_layer = cache.capacity // cache.unit_bytes[layers[0]] // len(layers)
        demand = DemandCounter(half_life_s=1e9)
        hot = [(layer, 15 - i) for layer in layers for i in range(per_layer)]  # the last experts: none cached
        for layer, e in hot:
            demand.add(layer, [(e, np.arange(5))])
        pinned = cache.pin(layers[0], [0])
        added, dropped = cache.rebalance(demand.top(1000))
        assert (layers[0], 0) in cache.held  # pinned: kept through the refill
        cache.unpin(pinned)
        added2, dropped2 = cache.rebalance(demand.top(1000))
        assert set(hot) <= cache.held and cache.used <= cache.capacity and added + added2 == len(hot)
        await sequence_logits(swarm.backbone, TOKENS)  # hits and misses counted
        st = cache.status()
        assert st["hits"] + st["misses"] > 0 and st["units"] == len(cache.held)

        metrics = BackboneMetrics(d, lambda: (0, 0, 0), lambda: 0)
        text = generate_latest(metrics.registry).decode()
        assert f'p2pswarm_expert_cache_lookups_total{{result="hit"}} {float(st["hits"])}' in text
        assert f"p2pswarm_expert_cache_units {float(len(cache.held))}" in text
        snap = SwarmView.for_backbone(swarm.backbone, swarm.layout).snapshot(
            model="m", fingerprint="f", active=0, rate=metrics.rate, metrics_totals={})
        assert snap["expert_cache"]["units"] == len(cache.held)

        lacks = cache.lacks(layers, 8)
        assert len(lacks) == 2 * len(layers) and any(lacks)
        ident = Identity.generate()
        rec = DemandRecord.make(ident, model="ab" * 32, layers=layers, n_expert=16, block_size=8,
                                unit_bytes=[1000] * len(layers), demand=[1.0] * len(lacks), lacks=lacks)
        assert DemandRecord.verify(rec.signed).lacks == tuple(lacks)
        from p2pswarm.commands.swarm_status import _market  # what swarm-status counts of it

        m = _market([DemandRecord.verify(rec.signed)], {}, layers, 2, 8)
        assert m["cached_backbones"] == 1
        assert [m["units"][f"{layer}/{b}"]["lacked_by"] for layer in layers for b in range(2)] == [int(x) for x in lacks]
        plain = DemandRecord.make(ident, model="ab" * 32, layers=layers, n_expert=16, block_size=8,
                                  unit_bytes=[1000] * len(layers), demand=[1.0] * len(lacks))
        assert DemandRecord.verify(plain.signed).lacks == ()


@pytest.mark.parametrize("kernel", ["numpy", "ggml"])
async def test_store_filled_from_slabs_is_the_model(models_dir, tmp_path, kernel):
    """A backbone file's cache with every unit written into its sparse store (as fetched slabs are,
    after the bank mapped the file) computes the monolithic logits bit for bit, on both kernels;
    a dropped unit gives its blocks back and is never computed."""
    path = arch_model(models_dir, "deepseek2")
    mono_p, mono_d, _ = await logits_of(path, kernel=kernel)
    bfile = tmp_path / "backbone.gguf"
    slice_backbone(path, bfile)
    full = ModelLayout.open(path)
    async with open_backbone(bfile, kernel=kernel, expert_cache=ec.parse_cache_size("all")) as swarm:
        cache = swarm.cache
        for layer in cache.layers:
            for e in range(cache.n_expert):
                cache.store.copy_from(full, layer, e)
                cache.add(layer, e)
        assert cache.complete and cache.store.disk_bytes() >= cache.total_bytes
        p, d, disp = await _both(swarm, TOKENS)
        assert disp.stats.remote_groups == 0 and disp.stats.local_groups > 0
        before = cache.store.disk_bytes()
        assert cache.drop(cache.layers[0], 3) and not cache.holds(cache.layers[0], 3)
        if cache.store.punch:
            assert cache.store.disk_bytes() < before
    assert np.array_equal(p, mono_p) and np.array_equal(d, mono_d)


async def test_dishonest_worker_caught_with_a_partial_cache(tiny_f32, tmp_path):
    """The cache holds experts 0-7 of every layer; a worker lying about some rows of experts 0-7
    is caught by the checks (which recompute only cached units), banned, and its units computed by
    the cache from then on: every step's outputs equal the full bank's. The honest worker of 8-15
    (not cached) is never checked here - what a partial cache can verify is its hit share."""
    from p2pswarm.backbone.dispatch.dispatcher import Dispatcher, InProcessOwner
    from p2pswarm.backbone.sessions.local import ensure_shards
    from p2pswarm.engine.kernels import make_bank
    from p2pswarm.market.verify import Verifier
    from p2pswarm.worker.expert_worker import ExpertWorker

    from helpers.dishonest_worker import DishonestWorker

    layout = ModelLayout.open(tiny_f32)
    shards = ensure_shards(layout, model_fingerprint(layout), 2, tmp_path)
    full = make_bank(layout, "numpy")
    cache = ec.ExpertCache(make_bank(layout, "numpy"), 0)
    cache.capacity = cache.total_bytes // 2
    cache.fill_from_file()
    assert {e for _, e in cache.held} == set(range(8))
    liar = DishonestWorker(shards[0], kernel="numpy", fraction=0.05, delta=1e-3, seed=3)
    disp = Dispatcher(cache, [InProcessOwner(liar, "liar"), InProcessOwner(ExpertWorker(shards[1], kernel="numpy"), "h")])
    disp.verifier = Verifier(1.0, seed=0)
    caught = []
    disp.on_mismatch = lambda peer, ev: caught.append(peer)
    rng = np.random.default_rng(4)
    for step in range(200):
        n = int(rng.integers(1, 6))
        cur = rng.standard_normal((n, 256)).astype(np.float32)
        picks = np.stack([rng.choice(16, 4, replace=False) for _ in range(n)])
        groups = [(int(e), np.flatnonzero((picks == e).any(axis=1)).astype(np.int64)) for e in np.unique(picks)]
        layer = int(rng.integers(0, len(layout.expert_layers)))
        outs = await disp.run_groups(layer, cur, groups)
        assert all(np.array_equal(o, w) for o, w in zip(outs, full.forward_groups(layer, cur, groups))), step
    assert liar.falsified > 0 and caught == ["liar"] and disp.bans.banned.keys() == {"liar"}
    assert disp.stats.fallbacks == 0 and disp.stats.per_owner.get("h", 0) > 0
    assert disp.stats.per_owner.get("local", 0) > 0  # the cache computed the liar's units after the ban


async def test_checks_reach_units_the_cache_lacks(tiny_f32, tmp_path):
    """A cache of none on the full model's file: every check picks a unit the cache lacks, whose
    bytes are in the file, so it is added for the check and dropped after.
    A liar on experts 0-7 is caught though the cache holds nothing, and every output equals the
    full bank's; the honest worker of 8-15 is checked too (the picks were not thrown away)."""
    from p2pswarm.backbone.dispatch.dispatcher import Dispatcher, InProcessOwner
    from p2pswarm.backbone.sessions.local import ensure_shards
    from p2pswarm.engine.kernels import make_bank
    from p2pswarm.market.verify import Verifier
    from p2pswarm.worker.expert_worker import ExpertWorker

    from helpers.dishonest_worker import DishonestWorker

    layout = ModelLayout.open(tiny_f32)
    shards = ensure_shards(layout, model_fingerprint(layout), 2, tmp_path)
    full = make_bank(layout, "numpy")
    cache = ec.ExpertCache(make_bank(layout, "numpy"), 0)
    liar = DishonestWorker(shards[0], kernel="numpy", fraction=0.05, delta=1e-3, seed=3, honest_rows=30)
    disp = Dispatcher(cache, [InProcessOwner(liar, "liar"), InProcessOwner(ExpertWorker(shards[1], kernel="numpy"), "h")])
    disp.fetch = cache.fetch_from_file
    disp.verifier = Verifier(0.5, seed=0)
    caught = []
    disp.on_mismatch = lambda peer, ev: caught.append(peer)
    rng = np.random.default_rng(4)
    for step in range(120):
        n = int(rng.integers(1, 6))
        cur = rng.standard_normal((n, 256)).astype(np.float32)
        picks = np.stack([rng.choice(16, 4, replace=False) for _ in range(n)])
        groups = [(int(e), np.flatnonzero((picks == e).any(axis=1)).astype(np.int64)) for e in np.unique(picks)]
        layer = int(rng.integers(0, len(layout.expert_layers)))
        outs = await disp.run_groups(layer, cur, groups)
        if not caught:  # (before the catch, unchecked lies are used: replay on ban fixes them)
            continue
        assert all(np.array_equal(o, w) for o, w in zip(outs, full.forward_groups(layer, cur, groups))), step
        # units fetched for a check are dropped after it: only the banned liar's (fetched because no
        # live owner holds them) stay until a refill
        assert all(e < 8 for _, e in cache.held), step
    assert liar.falsified > 0 and caught == ["liar"] and disp.bans.banned.keys() == {"liar"}
    assert disp.verifier.rows_checked.get("h", 0) > 0 and disp.stats.fallbacks == 0


def test_check_fetch_budget():
    """The budget of checks on units the cache lacks: bytes per period (a fixed window) and units
    held at once; a refused pick is counted."""
    from p2pswarm.market.verify import CheckFetchBudget

    now = [0.0]
    b = CheckFetchBudget(100, period_s=60, units_max=2, clock=lambda: now[0])
    assert b.take(40) and b.take(40) and not b.take(10)  # two held: the bound
    b.release()
    assert not b.take(30) and b.take(20)  # 80 + 30 > 100; 80 + 20 fits
    b.release(2)
    assert not b.take(1) and b.refused == 3
    now[0] = 61.0  # a new period
    assert b.take(100) and not b.take(1)
    assert CheckFetchBudget(0).take(1) is False  # 0: check cached units only
