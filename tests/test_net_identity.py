"""Persistent node identities: created once with mode 0600, stable peer id, unsafe files refused,
and never shared by two live nodes."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from libp2p.peer.id import ID

from conftest import assert_one_line_error, run_cli, start_cli

from p2pswarm.errors import UserError
from p2pswarm.net.signed.identity import Identity, default_identity_path, load_identity, load_or_create_identity
from p2pswarm.signatures import peer_public_key, verify_peer_signature

REPO = Path(__file__).resolve().parent.parent


def test_created_once_with_mode_0600_and_stable_peer_id(tmp_path, caplog):
    path = tmp_path / "keys" / "node.key"
    caplog.set_level("INFO", "p2pswarm.net")
    first = load_or_create_identity(path)
    assert first.created
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert any(first.peer_id_str in r.getMessage() for r in caplog.records)  # the peer id is logged
    again = load_or_create_identity(path)
    assert not again.created
    assert again.peer_id == first.peer_id
    assert again.peer_id_str.startswith("12D3KooW")  # an Ed25519 libp2p peer id
    assert ID.from_pubkey(again.key_pair.public_key) == again.peer_id


def test_umask_does_not_loosen_the_mode(tmp_path):
    old = os.umask(0)
    try:
        path = tmp_path / "node.key"
        load_or_create_identity(path)
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644, 0o660])
def test_group_or_world_accessible_key_is_refused(tmp_path, mode):
    path = tmp_path / "node.key"
    load_or_create_identity(path)
    os.chmod(path, mode)
    with pytest.raises(UserError, match=rf"accessible by group/others \(mode {mode:04o}\).*chmod 600"):
        load_or_create_identity(path)


@pytest.mark.parametrize("content, needle", [
    (b"", "not an unencrypted PEM private key"),
    (b"-----BEGIN PRIVATE KEY-----\nnonsense\n-----END PRIVATE KEY-----\n", "not an unencrypted PEM"),
    (os.urandom(100), "not an unencrypted PEM"),
])
def test_corrupt_key_file_is_a_clear_error(tmp_path, content, needle):
    path = tmp_path / "node.key"
    path.write_bytes(content)
    os.chmod(path, 0o600)
    with pytest.raises(UserError, match=needle):
        load_identity(path)


def test_foreign_key_type_and_directory_refused(tmp_path):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    path = tmp_path / "ec.key"
    path.write_bytes(ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    os.chmod(path, 0o600)
    with pytest.raises(UserError, match="not an Ed25519 key"):
        load_identity(path)
    d = tmp_path / "dir.key"
    d.mkdir(mode=0o700)
    with pytest.raises(UserError, match="not a regular file"):
        load_identity(d)


def test_default_path_follows_p2pswarm_home(tmp_path, monkeypatch):
    monkeypatch.setenv("P2PSWARM_HOME", str(tmp_path))
    assert default_identity_path("worker") == tmp_path / "identity" / "worker.key"


def test_signatures_verify_against_the_peer_id_alone():
    a, b = Identity.generate(), Identity.generate()
    sig = a.sign(b"record")
    assert verify_peer_signature(a.peer_id_str, b"record", sig)
    assert verify_peer_signature(a.peer_id, b"record", sig)  # a libp2p ID works too
    assert not verify_peer_signature(b.peer_id_str, b"record", sig)
    assert not verify_peer_signature(a.peer_id_str, b"recorD", sig)
    assert not verify_peer_signature("not-a-peer-id", b"record", sig)
    assert peer_public_key(a.peer_id_str).public_bytes_raw() == a.public_key_bytes
    # a hashed (non-identity) peer id embeds no key: refused, not crashed on
    with pytest.raises(UserError, match="does not embed an Ed25519"):
        peer_public_key("QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N")


# --- one key, one live node ----------------------------------------------------------------------
def _start_worker(shard: Path, env: dict, log: Path) -> tuple[subprocess.Popen, str]:
    """``node --role worker --shard SHARD`` (no --identity, no --bootstrap); waits for READY."""
    return start_cli(["node", "--role", "worker", "--shard", str(shard)], log, env)


@pytest.mark.slow
def test_two_live_workers_never_share_one_key(tiny_f32, tmp_path):
    """Two `node --role worker` from one P2PSWARM_HOME without --identity: the second is refused in
    one line naming the key and --identity (nothing joined the swarm under a shared peer id); once
    the first is gone, even by kill -9, the key is free again. The isolated worker warns."""
    from p2pswarm.model.slicer import slice_experts

    shards = [tmp_path / "a.gguf", tmp_path / "b.gguf"]
    slice_experts(tiny_f32, shards[0], None, (0, 8))
    slice_experts(tiny_f32, shards[1], None, (8, 16))
    env = dict(os.environ, P2PSWARM_HOME=str(tmp_path / "home"), P2PSWARM_KERNEL="numpy")
    key = tmp_path / "home" / "identity" / "worker.key"
    first, addr = _start_worker(shards[0], env, tmp_path / "first.log")
    try:
        second = run_cli("node", "--role", "worker", "--shard", str(shards[1]), env=env, timeout=120)
        assert_one_line_error(second, str(key), "in use by process", str(first.pid), "--identity")
        assert second.returncode == 2 and second.stdout == ""
    finally:
        first.kill()
        first.wait()
    warning = [ln for ln in (tmp_path / "first.log").read_text().splitlines() if " WARNING " in ln]
    assert any("runs isolated" in ln and "--bootstrap" in ln for ln in warning), warning
    again, addr2 = _start_worker(shards[1], env, tmp_path / "again.log")
    try:
        assert addr2.split("/p2p/")[1] == addr.split("/p2p/")[1]  # the same key, now free
    finally:
        again.kill()
        again.wait(30)


@pytest.mark.slow
def test_lock_is_per_key_and_reentrant_in_one_process(tmp_path):
    a = load_or_create_identity(tmp_path / "a.key", exclusive=True)
    assert load_or_create_identity(tmp_path / "a.key", exclusive=True).peer_id_str == a.peer_id_str
    b = load_or_create_identity(tmp_path / "b.key", exclusive=True)
    assert b.peer_id_str != a.peer_id_str
    held = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        from p2pswarm.errors import UserError
        from p2pswarm.net.signed.identity import load_or_create_identity
        load_or_create_identity({str(tmp_path / 'c.key')!r}, exclusive=True)  # free: fine
        try:
            load_or_create_identity({str(tmp_path / 'a.key')!r}, exclusive=True)
        except UserError as exc:
            print(exc)
        load_or_create_identity({str(tmp_path / 'a.key')!r})  # reading it without the lock: fine
    """)], capture_output=True, text=True, timeout=60, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert held.returncode == 0, held.stderr
    assert f"identity key {tmp_path / 'a.key'} is in use by process {os.getpid()}" in held.stdout
    assert f"--identity {tmp_path / 'a-2.key'}" in held.stdout
