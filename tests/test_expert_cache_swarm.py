"""The expert cache and the swarm's bytes (issue 41, second part): workers serve their downloaded
shards' slabs onwards to a backbone's cache; a backbone downloads only its slice (the dense part)
by fingerprint, resumably, checked against the manifest; workers' rewards follow the ``lacks``
flags of the backbones' demand records. Real processes over the libp2p swarm."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from p2pswarm.model.layout import ModelLayout
from p2pswarm.model.slicer import slice_backbone

from helpers.expert_cache import _complete, arch_model


@pytest.mark.slow
def test_cache_filled_from_workers_shards_with_no_seeder(models_dir, tmp_path):
    """Workers serve their own downloaded shards' slabs onwards: two workers (experts 0-7 and
    8-15) download their slices from a serve-shards seeder, which is then stopped, so no peer but
    the workers holds an expert's bytes. A backbone from the backbone file with a partial cache
    refills it by demand: every fetched unit comes from a worker's shard (logged per source, the
    workers' shard servers served the chunks), checked against the manifest, and the text
    computed with the fetched units cached (hot experts: computed locally) is the text the
    workers gave alone."""
    import httpx

    from helpers.procs import Proc, start_bootstrap
    from p2pswarm.model.manifest import build_manifest, source_fingerprint, write_manifest
    from p2pswarm.net.signed.identity import Identity, load_or_create_identity
    from p2pswarm.net.signed.tokens import issue_token, shard_scope

    path = arch_model(models_dir, "qwen35moe")
    layers = ModelLayout.open(path).expert_layers
    l0, l1 = layers[0], layers[-1] + 1
    bfile = tmp_path / "backbone.gguf"
    slice_backbone(path, bfile)
    env = dict(os.environ, P2PSWARM_KERNEL="numpy", P2PSWARM_HOME=str(tmp_path / "home"),
               P2PSWARM_CACHE=str(tmp_path / "cache"))
    fp = source_fingerprint(ModelLayout.open(path))
    issuer = Identity.generate()
    manifest = write_manifest(build_manifest(path, issuer), tmp_path / "m.manifest")
    ids = {name: load_or_create_identity(tmp_path / f"{name}.key") for name in ("w0", "w1", "bb")}
    nodes: list = []
    try:
        boot = start_bootstrap(tmp_path, env)
        nodes.append(boot)
        seeder = Proc(["serve-shards", "--model", str(path), "--manifest", str(manifest), "--trust-issuer",
                       issuer.peer_id_str, "--bootstrap", boot.addr, "--identity", str(tmp_path / "seed.key")],
                      tmp_path / "seed.log", env)
        nodes.append(seeder)
        workers = []
        for name, (e0, e1) in (("w0", (0, 8)), ("w1", (8, 16))):
            tok = issue_token(issuer, ids[name].peer_id_str, [shard_scope(fp, (l0, l1), (e0, e1))], 3600).encode()
            workers.append(Proc(["node", "--role", "worker", "--model", fp, "--layers", f"{l0}-{l1 - 1}", "--experts",
                                 f"{e0}-{e1 - 1}", "--token", tok, "--trust-issuer", issuer.peer_id_str, "--bootstrap",
                                 boot.addr, "--identity", str(tmp_path / f"{name}.key"), "--ttl", "600"],
                                tmp_path / f"{name}.log", env, timeout=180))
            nodes.append(workers[-1])
        for w in workers:
            assert "serving my shard's expert slabs" in w.text(), w.text()[-2000:]
        seeder.stop()  # from now on only the workers hold the experts' bytes
        bb_tok = issue_token(issuer, ids["bb"].peer_id_str, [f"shard:{fp}"], 3600).encode()
        bb = Proc(["node", "--role", "backbone", "--model", str(bfile), "--expert-cache", "50%", "--token", bb_tok,
                   "--trust-issuer", issuer.peer_id_str, "--bootstrap", boot.addr, "--http", "127.0.0.1:0",
                   "--identity", str(tmp_path / "bb.key"), "--cache-refill", "1", "--verify-rate", "0"],
                  tmp_path / "bb.log", env)
        nodes.append(bb)
        base = next(w for w in bb.ready if w.startswith("http="))[5:]
        whole = _complete(base, "hello swarm", 16)
        deadline = time.monotonic() + 90
        while "a worker's shard" not in bb.text() and time.monotonic() < deadline:
            time.sleep(1)
        log = bb.text()
        wid = {ids[n].peer_id_str for n in ("w0", "w1")}
        fetched = [ln for ln in log.splitlines() if "expert cache:" in ln and " unit(s) of layer " in ln
                   and " from " in ln]
        assert fetched and all(any(w in ln for w in wid) and "a worker's shard" in ln for ln in fetched), log[-3000:]
        assert any("shard server: served" in w.text() and ids["bb"].peer_id_str in w.text() for w in workers)
        metrics = httpx.get(base + "/metrics", timeout=30).text
        assert "p2pswarm_expert_cache_fetches_total 0.0" not in metrics
        assert "p2pswarm_expert_cache_bad_slabs_total 0.0" in metrics
        assert _complete(base, "hello swarm", 16) == whole
        hits = [ln for ln in httpx.get(base + "/metrics", timeout=30).text.splitlines()
                if ln.startswith('p2pswarm_expert_cache_lookups_total{result="hit"}')]
        assert hits and float(hits[0].split()[-1]) > 0, hits  # the fetched units computed the second text
    finally:
        for n in reversed(nodes):
            n.stop()


def test_rewards_follow_the_lacks_flags():
    """A unit a backbone lacks locally (its demand record's ``lacks`` flag) is worth more to serve:
    its demand counts LACKS_WEIGHT times in the sum workers enrol by (auto.aggregate), so with equal
    raw demand and replicas the lacked unit pays more, and a worker with room for one unit takes
    it; scarcity still comes first (a lacked unit with 2 replicas does not outbid an unlacked one
    with none). Records without flags count as before."""
    from p2pswarm.market.auto import aggregate
    from p2pswarm.market.demand import DemandRecord
    from p2pswarm.market.enrol import choose_units
    from p2pswarm.market.reward import LACKS_WEIGHT, backbone_demand, reward
    from p2pswarm.net.signed.identity import Identity

    def record(demand, lacks=()):
        return DemandRecord.make(Identity.generate(), model="ab" * 32, layers=[0], n_expert=16, block_size=4,
                                 unit_bytes=[1000], demand=demand, lacks=lacks)

    full = record([3.0, 3.0, 1.0, 1.0])
    cached = record([1.0, 1.0, 1.0, 1.0], lacks=[True, False, False, False])
    _, summed = aggregate([full, cached], None)
    assert summed.tolist() == [3.0 + LACKS_WEIGHT, 4.0, 2.0, 2.0]
    _, plain = aggregate([full, record([1.0, 1.0, 1.0, 1.0])], None)
    assert plain.tolist() == [4.0, 4.0, 2.0, 2.0]  # no flags: a plain sum, as before
    assert backbone_demand([[1.0, 2.0]], [()]).tolist() == [1.0, 2.0]

    w = reward(summed, np.array([1.0, 1.0, 1.0, 1.0]))
    assert w[0] > w[1] > 0 and w[2] == w[3]
    w_plain = reward(plain, np.array([1.0, 1.0, 1.0, 1.0]))
    assert w_plain[0] == w_plain[1]
    picks = [choose_units(demand=summed, replicas=np.ones(4), sizes=np.full(4, 1000.0), budget=1000,
                          rng=np.random.default_rng(seed), crowd=1).units[0] for seed in range(200)]
    assert picks.count(0) > picks.count(1)  # the weighted-random pick favours the lacked unit
    scarce = reward(summed, np.array([2.0, 0.0, 2.0, 2.0]))
    assert scarce[1] > scarce[0]  # scarcity first: an unserved unit outbids a lacked, covered one


@pytest.mark.slow
def test_backbone_downloads_its_slice_by_fingerprint(models_dir, tmp_path):
    """``node --role backbone --model FINGERPRINT --token --trust-issuer`` downloads only the dense
    part from a serve-shards seeder (checked against the signed manifest), byte for byte the file
    ``slice --backbone`` cuts, starts from it with ``--expert-cache none`` and answers through the
    workers the text a backbone on the full model gives; started again, it reuses the verified
    file. A worker token (one range) is refused the dense part."""
    import httpx

    from helpers.procs import Proc, start_bootstrap, start_shard_workers
    from p2pswarm.model.manifest import build_manifest, source_fingerprint, write_manifest
    from p2pswarm.net.signed.identity import Identity, load_or_create_identity
    from p2pswarm.net.signed.tokens import issue_token, shard_scope

    path = arch_model(models_dir, "qwen35moe")
    sliced = tmp_path / "sliced.gguf"
    slice_backbone(path, sliced)
    env = dict(os.environ, P2PSWARM_KERNEL="numpy", P2PSWARM_HOME=str(tmp_path / "home"),
               P2PSWARM_CACHE=str(tmp_path / "cache"))
    fp = source_fingerprint(ModelLayout.open(path))
    issuer = Identity.generate()
    manifest = write_manifest(build_manifest(path, issuer), tmp_path / "m.manifest")
    bb_id = load_or_create_identity(tmp_path / "bb.key").peer_id_str
    out = tmp_path / "downloaded.gguf"
    nodes: list = []

    def backbone(model: str, token, log: str) -> Proc:
        extra = ["--token", token.encode(), "--trust-issuer", issuer.peer_id_str, "--shard", str(out)] if token else []
        return Proc(["node", "--role", "backbone", "--model", model, *extra, "--expert-cache", "none",
                     "--bootstrap", boot.addr, "--http", "127.0.0.1:0", "--identity", str(tmp_path / "bb.key"),
                     "--verify-rate", "0"], tmp_path / log, env, timeout=180)

    try:
        boot = start_bootstrap(tmp_path, env)
        nodes.append(boot)
        nodes.append(Proc(["serve-shards", "--model", str(path), "--manifest", str(manifest), "--trust-issuer",
                           issuer.peer_id_str, "--bootstrap", boot.addr, "--identity", str(tmp_path / "seed.key")],
                          tmp_path / "seed.log", env))
        nodes += start_shard_workers(path, tmp_path, env, [(0, 8), (8, 16)], boot.addr, ("--ttl", "600"))
        narrow = issue_token(issuer, bb_id, [shard_scope(fp, (0, 1), (0, 8))], 3600)
        bad = run_cli_node(["node", "--role", "backbone", "--model", fp, "--token", narrow.encode(), "--trust-issuer",
                            issuer.peer_id_str, "--shard", str(tmp_path / "narrow.gguf"), "--bootstrap", boot.addr,
                            "--identity", str(tmp_path / "bb.key"), "--http", "off"], env)
        assert bad.returncode != 0 and "Traceback" not in bad.stderr and not (tmp_path / "narrow.gguf").exists()
        assert "token does not allow" in bad.stderr.splitlines()[-1], bad.stderr[-2000:]

        token = issue_token(issuer, bb_id, [f"shard:{fp}"], 3600)
        bb = backbone(fp, token, "bb.log")
        nodes.append(bb)
        assert "downloaded backbone slice" in bb.text(), bb.text()[-2000:]
        assert out.read_bytes() == sliced.read_bytes()
        base = next(w for w in bb.ready if w.startswith("http="))[5:]
        text = _complete(base, "hello swarm", 12)
        assert "expert cache: fetched" not in bb.text()  # the workers computed every expert
        assert "p2pswarm_expert_fallbacks_total 0.0" in httpx.get(base + "/metrics", timeout=30).text
        bb.stop()
        nodes.remove(bb)
        again = backbone(fp, token, "bb2.log")
        nodes.append(again)
        assert "already complete and verified" in again.text(), again.text()[-2000:]
        again.stop()
        nodes.remove(again)
        full = backbone(str(path), None, "full.log")
        nodes.append(full)
        assert _complete(next(w for w in full.ready if w.startswith("http="))[5:], "hello swarm", 12) == text
    finally:
        for n in reversed(nodes):
            n.stop()


def run_cli_node(args, env):
    return subprocess.run([sys.executable, "-m", "p2pswarm.cli", *args], env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.slow
def test_backbone_slice_download_resumes_and_refuses_bad_bytes(models_dir, tmp_path):
    """The backbone's download of its slice, killed (-9) halfway, resumes from its journal (the
    tensors already on disk are not fetched again) and ends byte for byte ``slice --backbone``; a
    chunk corrupted by the source fails the manifest's sha256 and is fetched again, never kept."""
    from helpers.procs import Proc, start_bootstrap
    from p2pswarm.model.manifest import build_manifest, source_fingerprint, write_manifest
    from p2pswarm.net.signed.identity import Identity, load_or_create_identity
    from p2pswarm.net.signed.tokens import issue_token

    path = arch_model(models_dir, "qwen35moe")
    sliced = tmp_path / "sliced.gguf"
    slice_backbone(path, sliced)
    env = dict(os.environ, P2PSWARM_KERNEL="numpy", P2PSWARM_HOME=str(tmp_path / "home"),
               P2PSWARM_CACHE=str(tmp_path / "cache"))
    fp = source_fingerprint(ModelLayout.open(path))
    issuer = Identity.generate()
    manifest = write_manifest(build_manifest(path, issuer), tmp_path / "m.manifest")
    token = issue_token(issuer, load_or_create_identity(tmp_path / "bb.key").peer_id_str, [f"shard:{fp}"], 3600)
    out = tmp_path / "downloaded.gguf"
    journal = tmp_path / "downloaded.gguf.part.journal"
    nodes: list = []

    def backbone(log: str, ready: bool) -> Proc:
        return Proc(["node", "--role", "backbone", "--model", fp, "--token", token.encode(), "--trust-issuer",
                     issuer.peer_id_str, "--shard", str(out), "--expert-cache", "none", "--bootstrap", boot.addr,
                     "--http", "off", "--identity", str(tmp_path / "bb.key")], tmp_path / log, env,
                    expect_ready=ready, timeout=180)

    try:
        boot = start_bootstrap(tmp_path, env)
        nodes.append(boot)
        nodes.append(Proc(["--delay-s", "0.15", "--corrupt-chunks", "3", "serve-shards", "--model", str(path),
                           "--manifest", str(manifest), "--trust-issuer", issuer.peer_id_str, "--bootstrap", boot.addr,
                           "--identity", str(tmp_path / "seed.key")], tmp_path / "seed.log", env,
                          entry=[str(Path(__file__).parent / "helpers" / "faulty_serve_shards.py")]))
        first = backbone("bb1.log", False)
        nodes.append(first)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and (not journal.exists() or len(journal.read_text().splitlines()) < 6):
            time.sleep(0.2)
        first.kill()
        nodes.remove(first)
        on_disk = len(journal.read_text().splitlines()) - 1
        assert 5 <= on_disk < 64 and not out.exists(), on_disk
        assert "does not match the manifest's sha256" in first.text(), first.text()[-2000:]
        second = backbone("bb2.log", True)
        nodes.append(second)
        log = second.text()
        assert f"resuming {out}.part: {on_disk} of 64 tensors already on disk" in log, log[-2000:]
        assert f"{on_disk} reused" in log, log[-2000:]
        assert out.read_bytes() == sliced.read_bytes() and not journal.exists()
    finally:
        for n in reversed(nodes):
            n.stop()


@pytest.mark.slow
def test_dishonest_worker_caught_with_no_cache_by_fetched_slabs(models_dir, tmp_path):
    """Verification with no expert cache (issue 41, item 4): a backbone from the backbone file
    with ``--expert-cache none`` holds no unit, so each check of a worker's answer fetches the
    unit's slabs (manifest-checked) from a holder, recomputes the picked rows and drops them. No
    seeder runs: the only holders are the workers, each serving its own shard - the honest one
    started with a local ``--shard`` whose ``.source`` sidecar ``slice --manifest`` wrote, the liar
    (experts 8-15) with its sidecar. The liar, honest for its first rows (used unverified), is
    caught on a unit the backbone does not hold, banned, the sequences that used its rows are
    replayed, its units are fetched on demand from then on, and the text equals the monolithic
    run's."""
    import httpx

    from conftest import run_cli
    from helpers.procs import Proc, start_bootstrap
    from p2pswarm.model.manifest import source_fingerprint
    from p2pswarm.net.signed.identity import load_or_create_identity

    path = arch_model(models_dir, "qwen35moe")
    bfile = tmp_path / "backbone.gguf"
    slice_backbone(path, bfile)
    env = dict(os.environ, P2PSWARM_KERNEL="numpy", P2PSWARM_HOME=str(tmp_path / "home"),
               P2PSWARM_CACHE=str(tmp_path / "cache"))
    fp = source_fingerprint(ModelLayout.open(path))
    issuer_key = tmp_path / "issuer.key"
    issuer = run_cli("identity", "--path", str(issuer_key), env=env, check=True).stdout.split()[-1]
    ids = {n: load_or_create_identity(tmp_path / f"{n}.key").peer_id_str for n in ("bb", "honest", "liar")}
    manifest = tmp_path / "m.manifest"
    run_cli("manifest", "--model", str(path), "--key", str(issuer_key), "--out", str(manifest), env=env, check=True)
    token = tmp_path / "bb.token"
    run_cli("token", "issue", "--key", str(issuer_key), "--peer", ids["bb"], "--allow", f"shard:{fp}", "--ttl", "1h",
            "--out", str(token), env=env, check=True)
    for name, experts in (("lo", "0-7"), ("hi", "8-15")):
        out = run_cli("slice", str(path), "--experts", experts, "-o", str(tmp_path / f"{name}.gguf"), "--manifest",
                      str(manifest), "-q", env=env, check=True).stdout
        assert f"{name}.gguf.source" in out, out
    nodes: list = []
    try:
        mono = Proc(["node", "--role", "backbone", "--model", str(path), "--http", "127.0.0.1:0", "--identity",
                     str(tmp_path / "mono.key")], tmp_path / "mono.log", env)
        nodes.append(mono)
        want = _complete(next(w for w in mono.ready if w.startswith("http="))[5:], "hello swarm", 40)
        mono.stop()
        boot = start_bootstrap(tmp_path, env)
        nodes.append(boot)
        honest = Proc(["node", "--role", "worker", "--shard", str(tmp_path / "lo.gguf"), "--trust-issuer", issuer,
                       "--bootstrap", boot.addr, "--identity", str(tmp_path / "honest.key"), "--ttl", "600"],
                      tmp_path / "honest.log", env)
        nodes.append(honest)
        assert "serving my shard's expert slabs (lo.gguf)" in honest.text(), honest.text()[-2000:]
        liar = Proc([str(Path(__file__).parent / "helpers" / "dishonest_worker.py"), "--shard",
                     str(tmp_path / "hi.gguf"), "--bootstrap", boot.addr, "--identity", str(tmp_path / "liar.key"), "--receipts-dir",
                     str(tmp_path / "liar-r"), "--fraction", "0.2", "--seed", "5", "--honest-rows", "40",
                     "--trust-issuer", issuer], tmp_path / "liar.log", env, entry=())
        nodes.append(liar)
        bb = Proc(["node", "--role", "backbone", "--model", str(bfile), "--expert-cache", "none", "--token", str(token),
                   "--trust-issuer", issuer, "--bootstrap", boot.addr, "--http", "127.0.0.1:0", "--identity",
                   str(tmp_path / "bb.key"), "--verify-rate", "0.3", "--verify-seed", "7"], tmp_path / "bb.log", env)
        nodes.append(bb)
        base = next(w for w in bb.ready if w.startswith("http="))[5:]
        assert ", 0 missing" in bb.text(), bb.text()[-2000:]
        # not streamed: a stream whose tokens went out before the ban cannot take them back (it fails
        # with a clear error, docs/market.md); a whole reply is replayed before it is sent
        r = httpx.post(base + "/v1/completions", json={"prompt": "hello swarm", "max_tokens": 40, "temperature": 0},
                       timeout=300)
        assert r.status_code == 200, r.text
        got = r.json()["choices"][0]["text"]
        log = bb.text()
        m = re.search(rf"BANNED worker {ids['liar']}: layer \d+ expert (\d+) ", log)
        assert m and 8 <= int(m.group(1)) < 16, log[-4000:]
        assert re.search(rf"replaying request \S+ from position \d+.*: worker {ids['liar']}", log), log[-4000:]
        # the check fetches came from the workers' own shards: the liar's units from the liar, the
        # honest worker's (a local --shard) from it
        assert re.search(rf"unit\(s\) of layer \d+ from {ids['liar']} \(a worker's shard, experts 8-15\)", log), \
            log[-4000:]
        assert re.search(rf"unit\(s\) of layer \d+ from {ids['honest']} \(a worker's shard, experts 0-7\)", log), \
            log[-4000:]
        assert "shard server: served" in honest.text() and ids["bb"] in honest.text()
        assert got == want
        checks = httpx.get(base + "/v1/swarm", timeout=30).json()["expert_cache"]["check_fetches"]
        assert checks["checks"] > 0 and checks["fetched_bytes"] > 0, checks
        assert "Traceback" not in log
    finally:
        for n in reversed(nodes):
            n.stop()


@pytest.mark.slow
def test_auto_worker_serves_its_slabs_to_a_backbone_without_experts(models_dir, tmp_path):
    """An ``--auto`` worker (its slices picked from the market and downloaded from a seeder, one
    per unit) serves them onwards: once the seeder is gone it is the only holder of every unit,
    and a backbone from the backbone file with ``--expert-cache none`` fetches the units its checks
    pick from it (the log names the worker and its shard's range), and answers the full model's
    text."""
    import httpx

    from helpers.procs import Proc, start_bootstrap
    from p2pswarm.model.manifest import build_manifest, source_fingerprint, write_manifest
    from p2pswarm.net.signed.identity import Identity, load_or_create_identity
    from p2pswarm.net.signed.tokens import issue_token

    path = arch_model(models_dir, "qwen35moe")
    layout = ModelLayout.open(path)
    bfile = tmp_path / "backbone.gguf"
    slice_backbone(path, bfile)
    env = dict(os.environ, P2PSWARM_KERNEL="numpy", P2PSWARM_HOME=str(tmp_path / "home"),
               P2PSWARM_CACHE=str(tmp_path / "cache"))
    fp = source_fingerprint(layout)
    issuer = Identity.generate()
    manifest = write_manifest(build_manifest(path, issuer), tmp_path / "m.manifest")
    ids = {n: load_or_create_identity(tmp_path / f"{n}.key").peer_id_str for n in ("bb", "auto")}
    experts = sum(layout.expert_bytes(layer) for layer in layout.expert_layers) * layout.n_expert
    nodes: list = []
    try:
        mono = Proc(["node", "--role", "backbone", "--model", str(path), "--http", "127.0.0.1:0", "--identity",
                     str(tmp_path / "mono.key")], tmp_path / "mono.log", env)
        nodes.append(mono)
        want = _complete(next(w for w in mono.ready if w.startswith("http="))[5:], "hello swarm", 16)
        mono.stop()
        boot = start_bootstrap(tmp_path, env)
        nodes.append(boot)
        seeder = Proc(["serve-shards", "--model", str(path), "--manifest", str(manifest), "--trust-issuer",
                       issuer.peer_id_str, "--bootstrap", boot.addr, "--identity", str(tmp_path / "seed.key")],
                      tmp_path / "seed.log", env)
        nodes.append(seeder)
        bb_tok = issue_token(issuer, ids["bb"], [f"shard:{fp}"], 3600).encode()
        bb = Proc(["node", "--role", "backbone", "--model", str(bfile), "--expert-cache", "none", "--token", bb_tok,
                   "--trust-issuer", issuer.peer_id_str, "--bootstrap", boot.addr, "--http", "127.0.0.1:0",
                   "--identity", str(tmp_path / "bb.key"), "--verify-rate", "0.3", "--verify-seed", "3"],
                  tmp_path / "bb.log", env)
        nodes.append(bb)
        base = next(w for w in bb.ready if w.startswith("http="))[5:]
        auto_tok = issue_token(issuer, ids["auto"], [f"shard:{fp}"], 3600).encode()
        auto = Proc(["node", "--role", "worker", "--auto", "--memory", f"{experts * 1.2 / 1e6 + 1:.1f}MB", "--token",
                     auto_tok, "--trust-issuer", issuer.peer_id_str, "--bootstrap", boot.addr, "--identity",
                     str(tmp_path / "auto.key"), "--ttl", "600", "--enrol-period", "600"], tmp_path / "auto.log", env,
                    timeout=240)
        nodes.append(auto)
        assert "serving my shard's expert slabs" in auto.text(), auto.text()[-3000:]
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # the backbone sees the worker hold every unit
            units = httpx.get(base + "/v1/swarm", timeout=30).json()["units"]
            if units and all(u["replicas"] > 0 for u in units):
                break
            time.sleep(1)
        else:
            raise AssertionError(f"coverage incomplete: {units}")
        seeder.stop()  # from now on only the --auto worker holds the experts' bytes
        nodes.remove(seeder)
        r = httpx.post(base + "/v1/completions", json={"prompt": "hello swarm", "max_tokens": 16, "temperature": 0},
                       timeout=300)
        assert r.status_code == 200, r.text
        log = bb.text()
        assert re.search(rf"unit\(s\) of layer \d+ from {ids['auto']} \(a worker's shard, experts \d+-\d+\)", log), \
            log[-4000:]
        assert "shard server: served" in auto.text() and ids["bb"] in auto.text()
        checks = httpx.get(base + "/v1/swarm", timeout=30).json()["expert_cache"]["check_fetches"]
        assert checks["checks"] > 0, checks
        assert r.json()["choices"][0]["text"] == want
        assert "BANNED" not in log and "Traceback" not in log
    finally:
        for n in reversed(nodes):
            n.stop()


def test_slice_manifest_writes_the_source_sidecar(models_dir, tmp_path):
    """``slice --experts --manifest`` writes ``OUT.source`` (the manifest and the model's header),
    what a worker started with that ``--shard`` serves its slabs by; a manifest of another model is
    refused in one line before any file is written; ``--manifest`` with ``--backbone`` too."""
    import argparse

    from p2pswarm.commands import slice as slice_cmd
    from p2pswarm.errors import UserError
    from p2pswarm.model.manifest import build_manifest, write_manifest
    from p2pswarm.net.signed.identity import Identity
    from p2pswarm.net.shards.server import ShardServer, load_source_sidecar
    from p2pswarm.net.signed.tokens import TokenGate

    path, other = arch_model(models_dir, "qwen35moe"), arch_model(models_dir, "deepseek2")
    issuer = Identity.generate()
    manifest = write_manifest(build_manifest(path, issuer), tmp_path / "m.manifest")
    wrong = write_manifest(build_manifest(other, issuer), tmp_path / "o.manifest")

    def args(out, man, backbone=False, experts="0-7"):
        return argparse.Namespace(model=str(path), layers=None, experts=None if backbone else experts,
                                  backbone=backbone, output=str(out), quiet=True, manifest=str(man))

    with pytest.raises(UserError, match="the manifest is for model"):
        slice_cmd.run(args(tmp_path / "bad.gguf", wrong))
    assert not (tmp_path / "bad.gguf").exists() and not (tmp_path / "bad.gguf.source").exists()
    with pytest.raises(UserError, match="--manifest is for an expert shard"):
        slice_cmd.run(args(tmp_path / "bb.gguf", manifest, backbone=True))
    assert slice_cmd.run(args(tmp_path / "lo.gguf", manifest)) == 0
    m, header = load_source_sidecar(tmp_path / "lo.gguf")
    m.verify(trusted_issuers=[issuer.peer_id_str])
    server = ShardServer(tmp_path / "lo.gguf", m, TokenGate([issuer.peer_id_str], what="shard server"), source_header=header)
    assert server.held[1] == (0, 8)
    server.close()
