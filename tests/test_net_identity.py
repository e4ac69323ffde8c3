"""Persistent node identities: created once with mode 0600, stable peer id, unsafe files refused."""
from __future__ import annotations

import os
import stat

import pytest
from libp2p.peer.id import ID

from p2pswarm.errors import UserError
from p2pswarm.net.identity import (Identity, default_identity_path, load_identity, load_or_create_identity,
                                   peer_public_key, verify_peer_signature)


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
