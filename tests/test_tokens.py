"""Node tokens: round trip, every refusal reason, tampering, scopes, the gate's counters, the CLI."""
from __future__ import annotations

import base64
import json
import os
import time

import msgpack
import pytest
from conftest import assert_one_line_error, run_cli

from p2pswarm.net.signed.identity import Identity
from p2pswarm.net.signed.tokens import (
    SCOPE_RELAY,
    TOKEN_PREFIX,
    NodeToken,
    TokenError,
    TokenGate,
    check_token,
    issue_token,
    load_token,
    parse_ttl,
    scope_covers,
    shard_scope,
)

FP = "ab" * 32
QUIET = {"P2PSWARM_LOG_LEVEL": "ERROR"}


@pytest.fixture(scope="module")
def ids():
    return {n: Identity.generate() for n in ("issuer", "holder", "other", "rogue")}


def _check(tok, ids, *, peer=None, scope=SCOPE_RELAY, now=None):
    return check_token(tok, peer=peer or ids["holder"].peer_id_str, scope=scope,
                       trusted_issuers={ids["issuer"].peer_id_str}, now=now)


def test_round_trip(ids):
    tok = issue_token(ids["issuer"], ids["holder"].peer_id_str, [SCOPE_RELAY, f"shard:{FP}:0-3:8-15"], 3600)
    text = tok.encode()
    assert text.startswith(TOKEN_PREFIX) and "\n" not in text and len(text) < 600
    back = NodeToken.decode(text)
    assert back == tok and back.verify_signature()
    assert back.issuer == ids["issuer"].peer_id_str and back.expires_at - back.issued_at == 3600
    assert _check(text, ids) == tok
    assert _check(tok, ids, scope=shard_scope(FP, (1, 3), (8, 12))) == tok


def test_scopes():
    assert shard_scope(FP, (0, 4), (8, 16)) == f"shard:{FP}:0-3:8-15"
    req = shard_scope(FP, (1, 3), (8, 12))
    assert scope_covers("shard", req)
    assert scope_covers(f"shard:{FP}", req)
    assert scope_covers("shard:*:0-3:0-15", req)
    assert scope_covers(f"shard:{FP}:1-2:8-11", req)
    assert not scope_covers(f"shard:{FP}:1-2:8-10", req)  # one expert short
    assert not scope_covers(f"shard:{FP}:2-3:8-11", req)  # one layer short
    assert not scope_covers("shard:" + "cd" * 32, req)  # another model
    assert not scope_covers("relay", req) and not scope_covers("shard", "relay")
    assert scope_covers("relay", "relay")
    with pytest.raises(TokenError):
        shard_scope(FP, (3, 3), (0, 1))


@pytest.mark.parametrize("reason,make,kw", [
    ("no token presented", lambda ids: None, {}),
    ("signature does not verify", "forged", {}),
    ("expired 2h ago", lambda ids: issue_token(ids["issuer"], ids["holder"].peer_id_str, ["relay"], 60,
                                               now=time.time() - 7260), {}),
    ("is not trusted", lambda ids: issue_token(ids["rogue"], ids["holder"].peer_id_str, ["relay"], 60), {}),
    ("not the connecting peer", lambda ids: issue_token(ids["issuer"], ids["other"].peer_id_str, ["relay"], 60), {}),
    ("does not allow 'relay'", lambda ids: issue_token(ids["issuer"], ids["holder"].peer_id_str, ["shard"], 60), {}),
    ("does not allow 'shard:", lambda ids: issue_token(ids["issuer"], ids["holder"].peer_id_str,
                                                       [f"shard:{FP}:0-0:0-3"], 60),
     {"scope": shard_scope(FP, (0, 1), (0, 5))}),
])
def test_each_refusal_has_its_reason(ids, reason, make, kw):
    if make == "forged":
        # Claims the trusted issuer, signed by someone else.
        real = issue_token(ids["issuer"], ids["holder"].peer_id_str, ["relay"], 60)
        fake = NodeToken(real.issuer, real.holder, real.allow, real.issued_at, real.expires_at,
                         ids["rogue"].sign(b"p2pswarm-token-v1\x00" + real.body()))
        tok = fake.encode()
    else:
        tok = make(ids)
    with pytest.raises(TokenError) as err:
        _check(tok, ids, **kw)
    assert reason in str(err.value)
    assert "\n" not in str(err.value)


def test_tampered_bytes_never_pass(ids):
    text = issue_token(ids["issuer"], ids["holder"].peer_id_str, [f"shard:{FP}:0-0:0-3"], 3600).encode()
    b64 = text[len(TOKEN_PREFIX):]
    wire = bytearray(base64.urlsafe_b64decode(b64 + "=" * (-len(b64) % 4)))
    passed = 0
    for i in range(len(wire)):
        bad = bytearray(wire)
        bad[i] ^= 0x01
        t = TOKEN_PREFIX + base64.urlsafe_b64encode(bytes(bad)).decode().rstrip("=")
        try:
            _check(t, ids, scope=shard_scope(FP, (0, 1), (0, 4)))
            passed += 1
        except TokenError:
            pass
    assert passed == 0
    # A widened scope with the old signature: refused by the signature check.
    outer = msgpack.unpackb(bytes(wire))
    body = msgpack.unpackb(outer["body"])
    body["allow"] = ["shard"]
    forged = msgpack.packb({"body": msgpack.packb(body), "sig": outer["sig"]})
    with pytest.raises(TokenError, match="signature does not verify"):
        _check(TOKEN_PREFIX + base64.urlsafe_b64encode(forged).decode(), ids, scope="shard")


@pytest.mark.parametrize("text", ["", "hello", TOKEN_PREFIX, TOKEN_PREFIX + "!!!", TOKEN_PREFIX + "AAAA",
                                  TOKEN_PREFIX + "A" * 5000,
                                  TOKEN_PREFIX + base64.urlsafe_b64encode(msgpack.packb([1, 2])).decode()])
def test_garbage_is_malformed(text):
    with pytest.raises(TokenError) as err:
        NodeToken.decode(text)
    assert "malformed token" in str(err.value)


def test_issue_refuses_bad_input(ids):
    with pytest.raises(TokenError, match="bad scope"):
        issue_token(ids["issuer"], ids["holder"].peer_id_str, ["shrd"], 60)
    with pytest.raises(TokenError, match="not an Ed25519 peer id"):
        issue_token(ids["issuer"], "QmNotAPeer", ["relay"], 60)
    with pytest.raises(TokenError, match="must allow something"):
        issue_token(ids["issuer"], ids["holder"].peer_id_str, [], 60)
    assert parse_ttl("7d") == 7 * 86400 and parse_ttl("90") == 90 and parse_ttl("30m") == 1800
    for bad in ("", "7w", "-1h", "0", "400d"):
        with pytest.raises(Exception, match="bad ttl"):
            parse_ttl(bad)


def test_gate_logs_and_counts(ids, caplog):
    gate = TokenGate([ids["issuer"].peer_id_str], what="relay")
    good = issue_token(ids["issuer"], ids["holder"].peer_id_str, ["relay"], 60).encode()
    gate.check(good, peer=ids["holder"].peer_id_str, scope="relay")
    for tok in (None, good, "junk"):
        with pytest.raises(TokenError):
            gate.check(tok, peer=ids["other"].peer_id_str, scope="relay")
    assert gate.accepted == 1
    assert gate.refused == {"no token": 1, "wrong holder": 1, "malformed": 1}
    lines = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(lines) == 3 and all(ln.startswith(f"relay refused {ids['other'].peer_id_str}: ") for ln in lines)


def test_load_token_from_text_or_file(ids, tmp_path):
    text = issue_token(ids["issuer"], ids["holder"].peer_id_str, ["relay"], 60).encode()
    assert load_token(text) == text
    f = tmp_path / "t.token"
    f.write_text(text + "\n")
    assert load_token(str(f)) == text
    (tmp_path / "junk").write_text("nope")
    for arg in (str(tmp_path / "junk"), str(tmp_path / "missing"), ""):
        with pytest.raises(TokenError):
            load_token(arg)


@pytest.mark.slow
def test_cli_identity_issue_show(tmp_path):
    worker_key, issuer_key = tmp_path / "w.key", tmp_path / "iss.key"
    peer = run_cli("identity", "--path", str(worker_key), env=QUIET, check=True).stdout.strip()
    assert peer.startswith("12D3KooW") and oct(worker_key.stat().st_mode & 0o777) == "0o600"
    assert run_cli("identity", "--path", str(worker_key), env=QUIET, check=True).stdout.strip() == peer
    assert_one_line_error(run_cli("token", "issue", "--key", str(issuer_key), "--peer", peer, "--allow", "relay",
                                  env=QUIET), "does not exist", "--create-key")
    out = tmp_path / "w.token"
    run_cli("token", "issue", "--key", str(issuer_key), "--create-key", "--peer", peer, "--allow", "relay",
            "--allow", f"shard:{FP}:0-3:0-7", "--ttl", "2h", "--out", str(out), env=QUIET, check=True)
    assert oct(out.stat().st_mode & 0o777) == "0o600"
    shown = json.loads(run_cli("token", "show", str(out), "--json", env=QUIET, check=True).stdout)
    assert shown["holder"] == peer and shown["signature_ok"] and not shown["expired"]
    assert shown["allow"] == ["relay", f"shard:{FP}:0-3:0-7"]
    assert shown["issuer"] == run_cli("identity", "--path", str(issuer_key), env=QUIET).stdout.strip()
    human = run_cli("token", "show", out.read_text().strip(), env=QUIET, check=True).stdout
    assert "signature: verifies" in human and "expires:" in human
    assert_one_line_error(run_cli("token", "issue", "--key", str(issuer_key), "--peer", peer, "--allow", "relay",
                                  "--out", str(out), env=QUIET), "exists")
    os.chmod(out, 0o600)


@pytest.mark.parametrize("args,needle", [
    (["token", "show", "garbage"], "neither a token"),
    (["token", "show", TOKEN_PREFIX + "AAAA"], "malformed token"),
    (["token", "show", TOKEN_PREFIX + "%%%"], "malformed token"),
    (["token", "issue", "--key", "/nonexistent/k", "--peer", "x", "--allow", "relay"], "does not exist"),
    (["token", "issue", "--key", "K", "--create-key", "--peer", "x", "--allow", "relay", "--ttl", "5y"], "bad ttl"),
])
@pytest.mark.slow
def test_cli_garbage_is_one_line(args, needle, tmp_path):
    proc = run_cli(*[a.replace("K", str(tmp_path / "k.key")) if a == "K" else a for a in args], env=QUIET)
    assert_one_line_error(proc, needle)


@pytest.mark.slow
def test_cli_bad_scope_and_holder(tmp_path):
    key = str(tmp_path / "iss.key")
    peer = run_cli("identity", "--path", str(tmp_path / "w.key"), env=QUIET, check=True).stdout.strip()
    assert_one_line_error(run_cli("token", "issue", "--key", key, "--create-key", "--peer", peer, "--allow",
                                  "shard:xyz:0-1", env=QUIET), "bad scope")
    assert_one_line_error(run_cli("token", "issue", "--key", key, "--create-key", "--peer", "notapeer",
                                  "--allow", "relay", env=QUIET), "not an ed25519 peer id")
