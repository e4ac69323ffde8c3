"""Signed manifests and partial shard download over `/p2pswarm/shard/1.0.0`.

In-process tests run a server host and a client host in one trio loop over real TCP sockets; the
``slow`` ones run `p2pswarm serve-shards` and `p2pswarm fetch` as OS processes, kill a download
with SIGKILL, corrupt chunks on the server (helpers/faulty_serve_shards.py), and check each token
refusal at the server."""
from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trio
from conftest import assert_one_line_error, run_cli
from helpers.procs import Proc, wait_until

from p2pswarm.model.layout import ModelLayout
from p2pswarm.model.manifest import (
    ManifestError,
    ModelManifest,
    build_manifest,
    read_manifest,
    write_manifest,
)
from p2pswarm.model.slicer import (
    header_layout,
    patch_header,
    plan_expert_shard,
    shard_header,
    slice_experts,
)
from p2pswarm.net.libp2p.host import open_host
from p2pswarm.net.signed.identity import Identity, load_or_create_identity
from p2pswarm.net.shards.fetch import FetchStats, fetch_slice
from p2pswarm.net.shards.server import load_source_sidecar, serve_shards
from p2pswarm.net.shards.wire import ShardTransferError
from p2pswarm.net.signed.tokens import NodeToken, TokenGate, issue_token

QUIET = {"P2PSWARM_LOG_LEVEL": "ERROR"}


@pytest.fixture(scope="module")
def issuer():
    return Identity.generate()


@pytest.fixture(scope="module")
def manifest_q8(tiny_q8, issuer):
    return build_manifest(tiny_q8, issuer)


# ---- manifest ------------------------------------------------------------------------------------
def test_manifest_hashes_every_tensor_and_every_slab(tiny_q8, issuer, manifest_q8):
    m = manifest_q8
    lay = ModelLayout.open(tiny_q8)
    data = lay.reader.data
    assert len(m.tensors) == len(lay.reader.tensors)
    for t in lay.reader.tensors:
        d = m.tensor(t.name)
        raw = data[t.data_offset: t.data_offset + t.n_bytes].tobytes()
        assert d.sha256 == hashlib.sha256(raw).digest() and d.nbytes == t.n_bytes
    n_slabs = 0
    for il in lay.expert_layers:
        for et in lay.expert_tensors[il].values():
            d = m.tensor(et.name)
            assert d.n_expert == lay.n_expert and d.expert_nbytes == et.expert_nbytes
            for e in range(lay.n_expert):
                off, n = et.slab(e)
                assert d.slab_sha256(e) == hashlib.sha256(data[off: off + n].tobytes()).digest()
                n_slabs += 1
    assert n_slabs == lay.n_layer * 3 * lay.n_expert
    assert m.header_sha256 == hashlib.sha256(data[: m.header_len].tobytes()).hexdigest()
    back = ModelManifest.decode(m.encode())
    assert back == m
    assert back.verify(trusted_issuers=[issuer.peer_id_str], fingerprint=m.fingerprint) is back


def test_manifest_refusals(manifest_q8, issuer):
    m = manifest_q8
    with pytest.raises(ManifestError, match="not trusted"):
        m.verify(trusted_issuers=[Identity.generate().peer_id_str])
    with pytest.raises(ManifestError, match="not the requested"):
        m.verify(trusted_issuers=[issuer.peer_id_str], fingerprint="cd" * 32)
    wire = bytearray(m.encode())
    wire[len(wire) // 2] ^= 0x01  # inside a slab hash
    with pytest.raises(ManifestError):
        ModelManifest.decode(bytes(wire)).verify(trusted_issuers=[issuer.peer_id_str])
    for junk in (b"", b"\x00" * 10, b"\x81\xa4body\x01"):
        with pytest.raises(ManifestError, match="malformed"):
            ModelManifest.decode(junk)


@pytest.mark.slow
def test_manifest_cli(tiny_f32, tmp_path):
    key = tmp_path / "iss.key"
    issuer = load_or_create_identity(key)
    out = tmp_path / "m.manifest"
    proc = run_cli("manifest", "--model", str(tiny_f32), "--key", str(key), "--out", str(out), check=True)
    assert "signed by " + issuer.peer_id_str in proc.stdout
    m = read_manifest(out)
    m.verify(trusted_issuers=[issuer.peer_id_str], fingerprint=m.fingerprint)
    assert_one_line_error(run_cli("manifest", "--model", str(tiny_f32), "--key", str(key), "--out", str(out),
                                  env=QUIET), "exists")
    assert_one_line_error(run_cli("manifest", "--model", str(tiny_f32), "--key", str(tmp_path / "nokey"),
                                  "--out", str(tmp_path / "x"), env=QUIET), "does not exist")
    assert not (tmp_path / "x").exists()


def test_shard_header_from_source_header_bytes_equals_slicer(tiny_q8, manifest_q8, tmp_path):
    ref = tmp_path / "ref.gguf"
    res = slice_experts(tiny_q8, ref, (1, 3), (2, 9))
    hdr = tmp_path / "src.header"
    hdr.write_bytes(Path(tiny_q8).read_bytes()[: manifest_q8.header_len])
    plan = plan_expert_shard(header_layout(hdr, manifest_q8.file_size), (1, 3), (2, 9), manifest_q8.fingerprint)
    header, slots = shard_header(plan.gguf)
    final = patch_header(header, slots, [res.tensors[t.name] for t in plan.gguf.tensors])
    assert ref.read_bytes()[: len(final)] == final


# ---- in-process download over real sockets -------------------------------------------------------
async def test_fetch_in_process_equals_slicer(tiny_q8, manifest_q8, issuer, tmp_path):
    ref = tmp_path / "ref.gguf"
    slice_experts(tiny_q8, ref, (0, 4), (5, 13))
    worker = Identity.generate()
    model = manifest_q8.fingerprint
    token = issue_token(issuer, worker.peer_id_str, [f"shard:{model}:0-3:4-15"], 600).encode()
    gate = TokenGate([issuer.peer_id_str], what="shard server")
    out = tmp_path / "got.gguf"
    stats = FetchStats()
    seen = []
    async with open_host(Identity.generate()) as server_net, open_host(worker) as client_net:
        server = serve_shards(server_net, tiny_q8, manifest_q8, gate, chunk_max=20000)  # several chunks a slab
        try:
            got = await fetch_slice(client_net, sources=[server_net.full_addrs()[0]], model=model, layers=(0, 4),
                                    experts=(5, 13), out_path=out, token=token,
                                    trusted_issuers=[issuer.peer_id_str], stats=stats,
                                    progress=lambda d, t: seen.append((d, t)))
            assert got == out and out.read_bytes() == ref.read_bytes()
            assert stats.slabs_total == stats.slabs_fetched == 4 * 3 * 8 and stats.bad_chunks == 0
            assert server.stats.chunks > stats.slabs_fetched  # slabs were split into chunks
            assert seen[-1][0] == seen[-1][1] == sum(int(t.n_bytes) for t in ModelLayout.open(ref).reader.tensors)
            assert not list(tmp_path.glob("got.gguf.*"))  # no .part, no journal left behind
            # Run again: the complete file is verified and kept, nothing fetched.
            again = FetchStats()
            mtime = out.stat().st_mtime_ns
            await fetch_slice(client_net, sources=[server_net.full_addrs()[0]], model=model, layers=(0, 4),
                              experts=(5, 13), out_path=out, token=token, trusted_issuers=[issuer.peer_id_str],
                              stats=again)
            assert again.already_complete and out.stat().st_mtime_ns == mtime
            # Another range into the same path: refused, the file untouched.
            with pytest.raises(ShardTransferError, match="refusing to overwrite"):
                await fetch_slice(client_net, sources=[server_net.full_addrs()[0]], model=model, layers=(0, 4),
                                  experts=(5, 12), out_path=out, token=token,
                                  trusted_issuers=[issuer.peer_id_str])
            assert out.read_bytes() == ref.read_bytes()
            # A manifest signed by someone we do not trust: nothing written.
            with pytest.raises(ShardTransferError, match="not trusted"):
                await fetch_slice(client_net, sources=[server_net.full_addrs()[0]], model=model, layers=(0, 4),
                                  experts=(5, 13), out_path=tmp_path / "x.gguf", token=token,
                                  trusted_issuers=[worker.peer_id_str])
            assert not list(tmp_path.glob("x.gguf*"))
        finally:
            server.close()


# ---- processes -----------------------------------------------------------------------------------
FAULTY = str(Path(__file__).parent / "helpers" / "faulty_serve_shards.py")


def _served(server: Proc) -> list[int]:
    return [int(n) for n in re.findall(r"shard server: served (\d+) chunks", server.text())]


@pytest.fixture
def setup(tiny_f32, tmp_path):
    """Issuer + manifest of tiny_f32, a worker identity, a token for layers 0-3 experts 0-15."""
    issuer = load_or_create_identity(tmp_path / "issuer.key")
    worker = load_or_create_identity(tmp_path / "worker.key")
    man = tmp_path / "tiny.manifest"
    m = build_manifest(tiny_f32, issuer)
    write_manifest(m, man)
    token = tmp_path / "worker.token"
    token.write_text(issue_token(issuer, worker.peer_id_str, [f"shard:{m.fingerprint}:0-3:0-15"], 3600).encode())
    env = dict(os.environ, P2PSWARM_HOME=str(tmp_path / "home"))
    return {"issuer": issuer, "worker": worker, "manifest": man, "model": m.fingerprint, "token": token, "env": env,
            "path": tiny_f32, "m": m}


def _server(setup, tmp_path, name="server", faults=(), extra_args=()):
    """``faults``: options of helpers/faulty_serve_shards.py (``--delay-s``, ``--corrupt-chunks``)."""
    return Proc(["serve-shards", "--model", str(setup["path"]), "--manifest", str(setup["manifest"]),
                 "--trust-issuer", setup["issuer"].peer_id_str, "--identity", str(tmp_path / f"{name}.key"),
                 *extra_args], tmp_path / f"{name}.log", setup["env"],
                entry=[FAULTY, *faults] if faults else ("-m", "p2pswarm.cli"))


def _fetch_args(setup, out, *, source=None, bootstrap=None, layers="0-3", experts="0-15"):
    where = ["--source", source] if source else ["--bootstrap", bootstrap]
    return ["fetch", "--model", setup["model"], "--layers", layers, "--experts", experts, *where,
            "--token", str(setup["token"]), "--trust-issuer", setup["issuer"].peer_id_str,
            "--identity", str(setup["tmp"] / "worker.key"), "--out", str(out)]


@pytest.mark.slow
def test_fetch_killed_resumes_without_refetching(setup, tmp_path):
    setup["tmp"] = tmp_path
    ref = tmp_path / "ref.gguf"
    slice_experts(setup["path"], ref, (0, 4), (0, 16))
    server = _server(setup, tmp_path, faults=["--delay-s", "0.05"])
    out = tmp_path / "shard.gguf"
    journal = tmp_path / "shard.gguf.part.journal"
    try:
        first = subprocess.Popen([sys.executable, "-m", "p2pswarm.cli", *_fetch_args(setup, out, source=server.addr)],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=setup["env"])
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if journal.exists() and len(journal.read_text().splitlines()) > 40:  # > 2 tensors of 16 slabs
                break
            assert first.poll() is None, first.communicate()
            time.sleep(0.05)
        first.send_signal(signal.SIGKILL)
        first.wait()
        assert not out.exists()
        done_before = {tuple(ln.split()) for ln in journal.read_text().splitlines()[1:]}
        total = 4 * 3 * 16
        assert 40 <= len(done_before) < total
        # the server logs each of the killed client's 4 streams (fetch --streams 4) as it resets
        wait_until(lambda: len(_served(server)) >= 4, timeout=20, what="the killed client's 4 streams logged")
        served_first = sum(_served(server))
        proc = run_cli(*_fetch_args(setup, out, source=server.addr), "--json", env=setup["env"], check=True)
        stats = json.loads(proc.stdout)
        fetched, reused = stats["slabs_fetched"], stats["slabs_reused"]
        assert stats["slabs_total"] == total and reused == len(done_before) and fetched == total - reused
        assert "resuming" in proc.stderr
        wait_until(lambda: sum(_served(server)) - served_first >= fetched, timeout=20, what="second run logged")
        served_second = sum(_served(server)) - served_first
        assert served_second == fetched  # the server saw no request for a journaled slab
        assert out.read_bytes() == ref.read_bytes()
        assert not journal.exists() and not (tmp_path / "shard.gguf.part").exists()
    finally:
        server.stop()


@pytest.mark.slow
def test_corrupted_chunks_are_detected_and_fetched_again(setup, tmp_path):
    setup["tmp"] = tmp_path
    ref = tmp_path / "ref.gguf"
    slice_experts(setup["path"], ref, (1, 3), (4, 12))
    server = _server(setup, tmp_path, faults=["--corrupt-chunks", "3,10,11"])
    out = tmp_path / "shard.gguf"
    try:
        proc = run_cli(*_fetch_args(setup, out, source=server.addr, layers="1-2", experts="4-11"), "--json",
                       env=setup["env"], check=True)
        assert json.loads(proc.stdout)["bad_chunks"] == 3, proc.stdout
        assert proc.stderr.count("does not match the manifest's sha256") == 3
        assert out.read_bytes() == ref.read_bytes()
    finally:
        server.stop()
    assert server.log.read_text().count("fault injection: corrupted chunk") == 3


@pytest.mark.slow
def test_token_refusals_at_the_shard_server(setup, tmp_path):
    """Forged, expired, another peer's, wrong scope, no token: each refused with its reason, logged
    and counted by the server, and nothing served (not even the manifest)."""
    issuer, worker, model = setup["issuer"], setup["worker"], setup["model"]
    server = _server(setup, tmp_path)
    scope = f"shard:{model}:0-3:0-15"
    real = issue_token(issuer, worker.peer_id_str, [scope], 600)
    rogue = Identity.generate()
    forged = NodeToken(real.issuer, real.holder, real.allow, real.issued_at, real.expires_at,
                       rogue.sign(b"p2pswarm-token-v1\x00" + real.body())).encode()
    cases = {
        "signature does not verify": forged,
        "token expired 2h": issue_token(issuer, worker.peer_id_str, [scope], 60, now=time.time() - 7300).encode(),
        "not the connecting peer": issue_token(issuer, rogue.peer_id_str, [scope], 600).encode(),
        "does not allow": issue_token(issuer, worker.peer_id_str, [f"shard:{model}:0-3:0-7"], 600).encode(),
        "no token presented": "",
    }
    out = tmp_path / "never.gguf"

    async def attempt_all() -> dict:
        errors = {}
        async with open_host(worker) as net:
            for reason, tok in cases.items():
                with pytest.raises(ShardTransferError) as err:
                    await fetch_slice(net, sources=[server.addr], model=model, layers=(0, 4), experts=(0, 16),
                                      out_path=out, token=tok, trusted_issuers=[issuer.peer_id_str])
                errors[reason] = str(err.value)
        return errors

    try:
        errors = trio.run(attempt_all)
    finally:
        server.stop()
    log = server.log.read_text()
    for reason, msg in errors.items():
        assert reason in msg, msg
        assert f"shard server refused {worker.peer_id_str}: " in log and reason in log
    assert _served(server) == []
    assert "served 0 chunks (0.0 MB) on 5 streams; refused 5" in log, log[-600:]
    for key in ("bad signature: 1", "expired: 1", "wrong holder: 1", "wrong scope: 1", "no token: 1"):
        assert key in log
    assert not list(tmp_path.glob("never.gguf*"))


@pytest.mark.slow
def test_fetch_finds_the_source_through_the_dht(setup, tmp_path):
    setup["tmp"] = tmp_path
    env = setup["env"]
    boot = Proc(["bootstrap", "--listen", "/ip4/127.0.0.1/tcp/0", "--identity", str(tmp_path / "boot.key")],
                tmp_path / "boot.log", env)
    server = None
    try:
        server = _server(setup, tmp_path, extra_args=["--bootstrap", boot.addr])
        out = tmp_path / "shard.gguf"
        proc = run_cli(*_fetch_args(setup, out, bootstrap=boot.addr, layers="2-3", experts="0-3"), env=env,
                       check=True)
        assert "found 1 shard source(s)" in proc.stderr
        ref = tmp_path / "ref.gguf"
        slice_experts(setup["path"], ref, (2, 4), (0, 4))
        assert out.read_bytes() == ref.read_bytes()
    finally:
        if server is not None:
            server.stop()
        boot.stop()


@pytest.mark.slow
def test_fetch_bad_input_is_one_line_and_writes_nothing(setup, tmp_path):
    setup["tmp"] = tmp_path
    env = dict(setup["env"], **QUIET)
    out = tmp_path / "shard.gguf"
    server = _server(setup, tmp_path)
    try:
        cases = [
            (["--model", "xyz"], "not a model fingerprint"),
            (["--experts", "9-3"], "bad expert range"),
            (["--token", "garbage"], "neither a token"),
            (["--model", "cd" * 32], "no source would serve"),
            (["--experts", "0-16"], "no source would serve"),  # beyond the model (and the token)
        ]
        base = _fetch_args(setup, out, source=server.addr)
        for override, needle in cases:
            args = list(base)
            for i in range(0, len(override), 2):
                args[args.index(override[i]) + 1] = override[i + 1]
            assert_one_line_error(run_cli(*args, env=env), needle)
            assert not list(tmp_path.glob("shard.gguf*"))
        # An existing file that is not this shard is never overwritten.
        out.write_bytes(b"precious")
        assert_one_line_error(run_cli(*base, env=env), "refusing to overwrite")
        assert out.read_bytes() == b"precious"
        # Another node's identity cannot use the worker's token.
        other = [a if a != str(tmp_path / "worker.key") else str(tmp_path / "other.key") for a in base]
        other[other.index("--out") + 1] = str(tmp_path / "o.gguf")
        assert_one_line_error(run_cli(*other, env=env), "the token is for peer")
    finally:
        server.stop()


@pytest.mark.slow
async def test_bad_source_is_avoided_and_a_hopeless_slab_aborts(tiny_f32, issuer, tmp_path):
    """A source that corrupts everything: with a good second source the download succeeds (bad
    slabs are fetched again from the other one); alone, it aborts after bounded retries with no
    final file (the .part and journal stay for a resume)."""
    m = build_manifest(tiny_f32, issuer)
    ref = tmp_path / "ref.gguf"
    slice_experts(tiny_f32, ref, (0, 2), (0, 8))
    worker = Identity.generate()
    token = issue_token(issuer, worker.peer_id_str, ["shard"], 600).encode()
    every = range(1, 100000)
    async with open_host(Identity.generate()) as good_net, open_host(Identity.generate()) as bad_net, \
            open_host(worker) as client:
        good = serve_shards(good_net, tiny_f32, m, TokenGate([issuer.peer_id_str], what="good"))
        bad = serve_shards(bad_net, tiny_f32, m, TokenGate([issuer.peer_id_str], what="bad"), corrupt_chunks=every)
        try:
            stats = FetchStats()
            out = tmp_path / "two.gguf"
            await fetch_slice(client, sources=[bad_net.full_addrs()[0], good_net.full_addrs()[0]], model=m.fingerprint,
                              layers=(0, 2), experts=(0, 8), out_path=out, token=token,
                              trusted_issuers=[issuer.peer_id_str], stats=stats)
            assert out.read_bytes() == ref.read_bytes()
            assert stats.bad_chunks == bad.stats.corrupted > 0
            with pytest.raises(ShardTransferError, match="failed verification 4 times"):
                await fetch_slice(client, sources=[bad_net.full_addrs()[0]], model=m.fingerprint, layers=(0, 2),
                                  experts=(0, 8), out_path=tmp_path / "bad.gguf", token=token,
                                  trusted_issuers=[issuer.peer_id_str])
            assert not (tmp_path / "bad.gguf").exists() and (tmp_path / "bad.gguf.part.journal").exists()
        finally:
            good.close()
            bad.close()


@pytest.mark.slow
async def test_cancelled_download_resumes_and_a_damaged_part_is_caught(tiny_f32, issuer, tmp_path):
    """Cancel a (throttled) download midway: the journal keeps what is on disk. Damage a journaled
    slab in OUT.part: the resumed run's final re-read from disk catches it, fetches that slab again,
    and the result still equals the slicer's."""
    m = build_manifest(tiny_f32, issuer)
    ref = tmp_path / "ref.gguf"
    slice_experts(tiny_f32, ref, (0, 4), (0, 16))
    worker = Identity.generate()
    token = issue_token(issuer, worker.peer_id_str, ["shard"], 600).encode()
    out = tmp_path / "s.gguf"
    part, journal = tmp_path / "s.gguf.part", tmp_path / "s.gguf.part.journal"
    async with open_host(Identity.generate()) as server_net, open_host(worker) as client:
        server = serve_shards(server_net, tiny_f32, m, TokenGate([issuer.peer_id_str], what="x"), delay_s=0.02)
        kw = {"sources": [server_net.full_addrs()[0]], "model": m.fingerprint, "layers": (0, 4),
              "experts": (0, 16), "out_path": out, "token": token, "trusted_issuers": [issuer.peer_id_str]}
        try:
            with trio.move_on_after(1.0) as scope:
                await fetch_slice(client, **kw)
            assert scope.cancelled_caught and not out.exists()
            lines = journal.read_text().splitlines()[1:]
            assert 0 < len(lines) < 192
            tensor, expert = map(int, lines[0].split())
            lay_ref = ModelLayout.open(ref)
            t = lay_ref.reader.tensors[tensor]
            slab = int(t.n_bytes) // 16
            with open(part, "r+b") as f:  # flip a byte inside that journaled slab
                pos = int(t.data_offset) + (expert - 0) * slab + 7
                f.seek(pos)
                b = f.read(1)
                f.seek(pos)
                f.write(bytes([b[0] ^ 0xFF]))
            server.delay_s = 0
            stats = FetchStats()
            await fetch_slice(client, stats=stats, **kw)
            assert stats.slabs_reused == len(set(lines))
            assert stats.slabs_fetched == 192 - stats.slabs_reused + 1  # the damaged one, again
            assert stats.bad_chunks == 1
            assert out.read_bytes() == ref.read_bytes()
        finally:
            server.close()


async def test_a_worker_serves_its_own_slice_onwards(tiny_q8, manifest_q8, issuer, tmp_path):
    """Worker A downloads experts 4-11 (keeping the manifest and source header beside its shard)
    and serves them; worker B downloads experts 6-9 from A alone: equal to the slicer's cut. A
    range A does not hold is refused with the reason."""
    model = manifest_q8.fingerprint
    a_id, b_id = Identity.generate(), Identity.generate()
    tok_a = issue_token(issuer, a_id.peer_id_str, ["shard"], 600).encode()
    tok_b = issue_token(issuer, b_id.peer_id_str, ["shard"], 600).encode()
    trusted = [issuer.peer_id_str]
    shard_a, shard_b, ref = tmp_path / "a.gguf", tmp_path / "b.gguf", tmp_path / "ref.gguf"
    slice_experts(tiny_q8, ref, (1, 3), (6, 10))
    async with open_host(Identity.generate()) as bb, open_host(a_id) as a, open_host(b_id) as b:
        backbone = serve_shards(bb, tiny_q8, manifest_q8, TokenGate(trusted, what="backbone"))
        await fetch_slice(a, sources=[bb.full_addrs()[0]], model=model, layers=(0, 4), experts=(4, 12),
                          out_path=shard_a, token=tok_a, trusted_issuers=trusted, keep_source=True)
        backbone.close()
        bb.remove_handler("/p2pswarm/shard/1.0.0")
        man, header = load_source_sidecar(shard_a)
        man.verify(trusted_issuers=trusted, fingerprint=model)
        worker = serve_shards(a, shard_a, man, TokenGate(trusted, what="worker"), source_header=header)
        try:
            assert worker.held == ((0, 4), (4, 12))
            await fetch_slice(b, sources=[a.full_addrs()[0]], model=model, layers=(1, 3), experts=(6, 10),
                              out_path=shard_b, token=tok_b, trusted_issuers=trusted)
            assert shard_b.read_bytes() == ref.read_bytes()
            with pytest.raises(ShardTransferError, match="holds layers 0-3, experts 4-11 only"):
                await fetch_slice(b, sources=[a.full_addrs()[0]], model=model, layers=(1, 3), experts=(2, 6),
                                  out_path=tmp_path / "c.gguf", token=tok_b, trusted_issuers=trusted)
        finally:
            worker.close()
