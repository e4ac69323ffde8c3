"""A worker's start-up checks: a token no shard source could accept is refused at
start with one line and exit 2 (it used to be retried forever), and an `--auto` worker with no shard
source in the swarm says what to start instead of 'none found'."""
from __future__ import annotations

import os
import signal
import time

import pytest

from conftest import assert_one_line_error, run_cli
from helpers.procs import Proc, stop_all
from p2pswarm.net.signed.identity import load_or_create_identity
from p2pswarm.net.signed.tokens import issue_token

FP = "ab" * 32
NOWHERE = "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWRVJ9bMa6unxaZvC929uzP45jEYfDnxvb929oGF9ekYCU"


@pytest.fixture
def keys(tmp_path):
    return (load_or_create_identity(tmp_path / "issuer.key"), load_or_create_identity(tmp_path / "w.key"),
            load_or_create_identity(tmp_path / "other.key"))


def _auto(tmp_path, token, issuer, *extra, key="w.key", timeout=60):
    return run_cli("node", "--role", "worker", "--auto", "--memory", "10MB", "--token", token, "--trust-issuer",
                   issuer, "--bootstrap", NOWHERE, "--identity", str(tmp_path / key), *extra, timeout=timeout,
                   env=dict(os.environ, P2PSWARM_HOME=str(tmp_path / "home")))


@pytest.mark.slow
def test_auto_token_of_another_peer_is_refused_at_start(tmp_path, keys):
    issuer, me, other = keys
    tok = issue_token(issuer, other.peer_id_str, [f"shard:{FP}"], 3600).encode()
    proc = _auto(tmp_path, tok, issuer.peer_id_str)
    assert proc.returncode == 2
    assert_one_line_error(proc, f"issued to peer {other.peer_id_str}", f"this node is {me.peer_id_str}")


@pytest.mark.slow
def test_auto_token_for_a_key_not_made_yet_is_refused(tmp_path, keys):
    issuer, _me, other = keys
    tok = issue_token(issuer, other.peer_id_str, [f"shard:{FP}"], 3600).encode()
    proc = _auto(tmp_path, tok, issuer.peer_id_str, key="fresh.key")
    assert proc.returncode == 2
    assert_one_line_error(proc, "does not exist yet", "--identity")
    assert not (tmp_path / "fresh.key").exists()


@pytest.mark.slow
def test_auto_token_of_an_untrusted_issuer_is_refused(tmp_path, keys):
    issuer, me, other = keys
    tok = issue_token(other, me.peer_id_str, [f"shard:{FP}"], 3600).encode()
    proc = _auto(tmp_path, tok, issuer.peer_id_str)
    assert proc.returncode == 2
    assert_one_line_error(proc, f"signed by {other.peer_id_str}", "not a --trust-issuer")


@pytest.mark.slow
@pytest.mark.parametrize("allow,needle", [
    (["relay"], "needs shard:"),
    ([f"shard:{FP}:0-1:0-3"], "no ranges"),  # an --auto worker may pick any unit
    (["shard:" + "cd" * 32], f"needs shard:{FP}"),  # another model than --model
])
def test_auto_token_of_the_wrong_scope_is_refused(tmp_path, keys, allow, needle):
    issuer, me, _other = keys
    tok = issue_token(issuer, me.peer_id_str, allow, 3600).encode()
    proc = _auto(tmp_path, tok, issuer.peer_id_str, "--model", FP)
    assert proc.returncode == 2
    assert_one_line_error(proc, needle)


@pytest.mark.slow
def test_fetch_token_that_does_not_cover_the_slice_is_refused(tmp_path, keys):
    issuer, me, _other = keys
    tok = issue_token(issuer, me.peer_id_str, [f"shard:{FP}:0-1:0-3"], 3600).encode()
    proc = run_cli("node", "--role", "worker", "--model", FP, "--layers", "0-3", "--experts", "0-3", "--token", tok,
                   "--trust-issuer", issuer.peer_id_str, "--bootstrap", NOWHERE, "--identity", str(tmp_path / "w.key"),
                   timeout=60, env=dict(os.environ, P2PSWARM_HOME=str(tmp_path / "home")))
    assert proc.returncode == 2
    assert_one_line_error(proc, f"does not allow shard:{FP}:0-3:0-3")


@pytest.mark.slow
def test_auto_worker_without_a_shard_source_says_what_to_start(tiny_f32, tmp_path, keys):
    """A backbone without --manifest serves no downloads: the --auto worker's log says exactly that
    and how to start a source (once, not one line per unit per retry)."""
    issuer, me, _other = keys
    env = dict(os.environ, P2PSWARM_KERNEL="numpy", P2PSWARM_HOME=str(tmp_path / "home"))
    procs: list[Proc] = []
    try:
        boot = Proc(["bootstrap", "--listen", "/ip4/127.0.0.1/tcp/0", "--identity", str(tmp_path / "boot.key")],
                    tmp_path / "boot.log", env)
        procs.append(boot)
        procs.append(Proc(["node", "--role", "backbone", "--model", str(tiny_f32), "--bootstrap", boot.addr,
                           "--http", "off", "--identity", str(tmp_path / "bb.key")], tmp_path / "bb.log", env))
        tok = issue_token(issuer, me.peer_id_str, ["shard"], 3600).encode()
        worker = Proc(["node", "--role", "worker", "--auto", "--memory", "100MB", "--token", tok, "--trust-issuer",
                       issuer.peer_id_str, "--bootstrap", boot.addr, "--identity", str(tmp_path / "w.key"),
                       "--enrol-period", "2"], tmp_path / "w.log", env, expect_ready=False)
        procs.append(worker)
        worker.wait_log("no shard source", timeout=60)
        time.sleep(65)  # a dozen retries (every ~5 s) and enrolment periods, and the minute gone round
        text = worker.text()
        worker.proc.send_signal(signal.SIGTERM)  # before READY, while it waits for a source
        rc = worker.proc.wait(timeout=30)
        text_after = worker.text()
    finally:
        stop_all([p.proc for p in procs])
    lines = text.splitlines()
    said = [ln for ln in lines if "no shard source" in ln]
    assert "--manifest" in said[0] and "serve-shards" in said[0], said[0]
    assert len(said) == 2, said  # said at once, then once a minute: not per unit per retry
    # the warning is the first thing it says after joining the market, and nothing repeats between
    market = next(i for i, ln in enumerate(lines) if "market: model" in ln)
    assert "no shard source" in lines[market + 1], lines[market:market + 3]
    assert not [ln for ln in lines if "shard source(s)" in ln or "enrolled in 0 units" in ln], text[-3000:]
    assert "none found or given" not in text and "could not fetch" not in text, text[-3000:]
    # SIGTERM in that phase: a line and a clean exit, as SIGINT gives
    assert rc == 0 and "signal SIGTERM: shutting down" in text_after, (rc, text_after[-2000:])
    assert "Traceback" not in text_after
