"""A node's persistent Ed25519 identity: one private key file, the libp2p peer id derived from it.

Why persistent: the peer id is what DHT records, node tokens and routing tables name. A node that
got a fresh id on every start would look like a new peer each time, leave stale provider records
behind, and could not hold tokens issued to it.

The key file is PKCS#8 PEM (what ``openssl pkey`` reads), created on first start with mode 0600
inside a directory created 0700. A key file that the group or others can read (or write) is
refused, not silently used: a leaked node key lets anyone sign shard records in this node's name.
"""
from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import base58
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from p2pswarm.errors import UserError

log = logging.getLogger("p2pswarm.net")

KEY_FILE_MODE = 0o600
MAX_KEY_FILE_BYTES = 16 << 10


def default_identity_path(name: str = "node") -> Path:
    """``$P2PSWARM_HOME/identity/<name>.key`` (default home ``~/.p2pswarm``)."""
    home = Path(os.environ.get("P2PSWARM_HOME") or Path.home() / ".p2pswarm")
    return home / "identity" / f"{name}.key"


@dataclass(frozen=True)
class Identity:
    """An Ed25519 key pair and the libp2p peer id it defines."""

    private_key: ed25519.Ed25519PrivateKey
    key_pair: object  # libp2p KeyPair: the same key in libp2p's types, for the host
    peer_id: object  # libp2p peer ID
    path: Path | None = None
    created: bool = False

    @property
    def peer_id_str(self) -> str:
        return self.peer_id.to_base58()

    @property
    def public_key_bytes(self) -> bytes:
        return self.private_key.public_key().public_bytes(serialization.Encoding.Raw,
                                                          serialization.PublicFormat.Raw)

    def sign(self, data: bytes) -> bytes:
        return self.private_key.sign(data)

    @classmethod
    def from_private_key(cls, key: ed25519.Ed25519PrivateKey, path: Path | None = None,
                         created: bool = False) -> "Identity":
        # libp2p is imported here, not at module level: importing any libp2p module costs ~0.8 s,
        # and record checks (socket workers, tools) need only the pure-Python helpers below.
        from libp2p.crypto.ed25519 import Ed25519PrivateKey as LibEd25519PrivateKey  # noqa: PLC0415
        from libp2p.crypto.keys import KeyPair  # noqa: PLC0415
        from libp2p.peer.id import ID  # noqa: PLC0415
        from nacl.signing import SigningKey  # noqa: PLC0415

        seed = key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                 serialization.NoEncryption())
        lib_key = LibEd25519PrivateKey(SigningKey(seed))
        key_pair = KeyPair(lib_key, lib_key.get_public_key())
        return cls(key, key_pair, ID.from_pubkey(key_pair.public_key), path, created)

    @classmethod
    def generate(cls) -> "Identity":
        """A throw-away identity (tests, one-shot tools such as `swarm-status`)."""
        return cls.from_private_key(ed25519.Ed25519PrivateKey.generate())


def _check_mode(path: Path, st: os.stat_result) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise UserError(f"identity key {path} is not a regular file")
    if st.st_mode & 0o077:
        raise UserError(f"identity key {path} is accessible by group/others (mode {stat.S_IMODE(st.st_mode):04o}); "
                        f"run `chmod 600 {path}` if it has not leaked, or delete it to make a new identity")


def load_identity(path: str | os.PathLike[str]) -> Identity:
    """Load an existing key file; refuse a group/world-accessible, foreign or corrupt one."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        raise UserError(f"identity key {path} does not exist") from None
    except OSError as exc:
        raise UserError(f"cannot open identity key {path}: {exc.strerror or exc}") from None
    try:
        _check_mode(path, os.fstat(fd))
        data = os.read(fd, MAX_KEY_FILE_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_KEY_FILE_BYTES:
        raise UserError(f"identity key {path} is too large to be a key file")
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise UserError(f"identity key {path} is not an unencrypted PEM private key ({str(exc)[:60]})") from None
    if not isinstance(key, ed25519.Ed25519PrivateKey):
        raise UserError(f"identity key {path} holds a {type(key).__name__}, not an Ed25519 key")
    return Identity.from_private_key(key, path)


def load_or_create_identity(path: str | os.PathLike[str] | None = None) -> Identity:
    """The identity at ``path``, created (mode 0600) on first start. Logs the peer id."""
    path = Path(path) if path is not None else default_identity_path()
    if path.exists() or path.is_symlink():
        ident = load_identity(path)
        log.info("identity %s: peer id %s", path, ident.peer_id_str)
        return ident
    key = ed25519.Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        # O_EXCL: two nodes started at once on one path must not overwrite each other's key.
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, KEY_FILE_MODE)
        try:
            os.fchmod(fd, KEY_FILE_MODE)  # whatever the umask
            os.write(fd, pem)
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)  # fails if another process created the key meanwhile
        finally:
            os.unlink(tmp)
    except FileExistsError:
        return load_identity(path)
    except OSError as exc:
        raise UserError(f"cannot create identity key {path}: {exc.strerror or exc}") from None
    ident = Identity.from_private_key(key, path, created=True)
    log.info("identity %s created: peer id %s", path, ident.peer_id_str)
    return ident


# An Ed25519 libp2p peer id is an identity multihash of the protobuf PublicKey
# {Type: Ed25519 (1), Data: 32 bytes}: 00 24 | 08 01 12 20 | key.
_ED25519_PEER_PREFIX = bytes([0x00, 0x24, 0x08, 0x01, 0x12, 0x20])


def peer_id_bytes(peer_id) -> bytes:
    if isinstance(peer_id, (bytes, bytearray)):
        return bytes(peer_id)
    if hasattr(peer_id, "to_bytes"):
        return peer_id.to_bytes()
    try:
        return base58.b58decode(str(peer_id))
    except Exception:
        raise UserError(f"malformed peer id {str(peer_id)[:60]!r}") from None


def peer_public_key(peer_id) -> ed25519.Ed25519PublicKey:
    """The Ed25519 public key a peer id (base58 string, bytes or libp2p ID) embeds; UserError if
    it embeds none (e.g. a hashed RSA id): only Ed25519 identities can sign our records."""
    raw = peer_id_bytes(peer_id)
    if len(raw) != len(_ED25519_PEER_PREFIX) + 32 or not raw.startswith(_ED25519_PEER_PREFIX):
        raise UserError(f"peer id {str(peer_id)[:60]} does not embed an Ed25519 public key")
    return ed25519.Ed25519PublicKey.from_public_bytes(raw[len(_ED25519_PEER_PREFIX):])


def verify_peer_signature(peer_id, data: bytes, signature: bytes) -> bool:
    """Whether ``signature`` over ``data`` was made by the key behind ``peer_id``."""
    try:
        peer_public_key(peer_id).verify(signature, data)
        return True
    except (InvalidSignature, UserError, ValueError, TypeError):
        return False
