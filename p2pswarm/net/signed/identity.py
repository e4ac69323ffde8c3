"""A node's persistent Ed25519 identity: one private key file, the libp2p peer id derived from it.

Why persistent: the peer id is what DHT records, node tokens and routing tables name. A node that
got a fresh id on every start would look like a new peer each time, leave stale provider records
behind, and could not hold tokens issued to it.

The key file is PKCS#8 PEM (what ``openssl pkey`` reads), created on first start with mode 0600
inside a directory created 0700. A key file that the group or others can read (or write) is
refused, not silently used: a leaked node key lets anyone sign shard records in this node's name.

One key, one live node: two processes running with the same key would be one peer id on two
addresses, and the swarm would see only whichever announced itself last (three workers started from
one home without ``--identity`` used to do exactly that, silently). So a node holds an exclusive
``flock`` on ``KEY.lock`` next to its key for as long as it runs (``exclusive=True``); a second
process asking for the same key is refused with one line naming the key, the process holding it and
the fix (``--identity`` with a key of its own). The kernel drops the lock when the holder exits,
however it exits (kill -9 too), so a stale lock file never blocks a restart. Tools that only read
or sign with a key (``identity``, ``token issue``, ``manifest``) take no lock.
"""
from __future__ import annotations

import fcntl
import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from p2pswarm import settings
from p2pswarm.errors import UserError, clip

if TYPE_CHECKING:  # libp2p is imported when an identity is made, not with this module (see from_private_key)
    from libp2p.crypto.keys import KeyPair
    from libp2p.peer.id import ID

log = logging.getLogger("p2pswarm.net")

KEY_FILE_MODE = 0o600
MAX_KEY_FILE_BYTES = 16 << 10


def default_identity_path(name: str = "node") -> Path:
    """``$P2PSWARM_HOME/identity/<name>.key`` (default home ``~/.p2pswarm``)."""
    return settings.home_dir() / "identity" / f"{name}.key"


@dataclass(frozen=True)
class Identity:
    """An Ed25519 key pair and the libp2p peer id it defines."""

    private_key: ed25519.Ed25519PrivateKey
    key_pair: KeyPair  # the same key in libp2p's types, for the host
    peer_id: ID
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
        from libp2p.crypto.ed25519 import Ed25519PrivateKey as LibEd25519PrivateKey
        from libp2p.crypto.keys import KeyPair
        from libp2p.peer.id import ID
        from nacl.signing import SigningKey

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
        raise UserError(f"identity key {path} is not an unencrypted PEM private key ({clip(exc, 200)})") from None
    if not isinstance(key, ed25519.Ed25519PrivateKey):
        raise UserError(f"identity key {path} holds a {type(key).__name__}, not an Ed25519 key")
    return Identity.from_private_key(key, path)


#: Key path (resolved) -> the open file descriptor of its held ``KEY.lock``: kept open (and so
#: locked) for the rest of the process's life; a second request from this same process reuses it.
_HELD_LOCKS: dict[Path, int] = {}


def lock_path(path: Path) -> Path:
    return path.with_name(path.name + ".lock")


def hold_identity_lock(path: str | os.PathLike[str]) -> None:
    """Take an exclusive lock on ``KEY.lock`` for the rest of this process's life; UserError (one
    line, naming the key, the holder's pid and ``--identity``) if another live process holds it."""
    path = Path(path)
    key = path.resolve()
    if key in _HELD_LOCKS:
        return
    lock = lock_path(path)
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), KEY_FILE_MODE)
    except OSError as exc:
        raise UserError(f"cannot open the lock file {lock} of identity key {path}: {exc.strerror or exc}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        os.close(fd)
        who = f"process {holder}" if holder.isdigit() else "another process"
        raise UserError(f"identity key {path} is in use by {who}: two live nodes must not share one peer id; "
                        f"give this one its own key with --identity FILE (e.g. --identity {_free_key_path(path)})"
                        ) from None
    except OSError as exc:
        os.close(fd)
        raise UserError(f"cannot lock {lock} for identity key {path}: {exc.strerror or exc}") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _HELD_LOCKS[key] = fd


def _free_key_path(path: Path) -> Path:
    """A sibling key name nobody uses yet: worker.key -> worker-2.key, worker-3.key, ..."""
    for n in range(2, 1000):
        cand = path.with_name(f"{path.stem}-{n}{path.suffix}")
        if not cand.exists():
            return cand
    return path.with_name(f"{path.stem}-{os.getpid()}{path.suffix}")


def load_or_create_identity(path: str | os.PathLike[str] | None = None, *, exclusive: bool = False) -> Identity:
    """The identity at ``path``, created (mode 0600) on first start. Logs the peer id.

    ``exclusive``: this process is a node that will be live under this identity: hold the key's
    lock for the process's life (see the module doc), refusing if another live process holds it."""
    path = Path(path) if path is not None else default_identity_path()
    ident = _load_or_create(path)
    if exclusive:
        hold_identity_lock(path)
    log.info("identity %s%s: peer id %s", path, " created" if ident.created else "", ident.peer_id_str)
    return ident


def _load_or_create(path: Path) -> Identity:
    if path.exists() or path.is_symlink():
        return load_identity(path)
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
    return Identity.from_private_key(key, path, created=True)
