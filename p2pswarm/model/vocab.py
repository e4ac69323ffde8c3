"""Real vocab-only GGUFs, fetched from the llama-cpp-python sdist and cached.

Why: the tokenizer must be checked against the real Qwen3.5 vocabulary (151,936 tokens), and we
do not ship third-party model files in this repository. llama.cpp keeps small vocab-only GGUFs
for its own tokenizer tests under ``models/``, and the llama-cpp-python 0.3.36 source
distribution vendors them. So we ask pip for that exact sdist (pip's HTTP cache makes a repeat
cheap), pull only the vocab files out of the tarball into our cache directory, and check each
against a pinned SHA-256. Nothing is downloaded once the cache holds the file.

The cache directory is ``$P2PSWARM_CACHE`` if set, else ``~/.cache/p2pswarm``.
"""
from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from p2pswarm.errors import UserError

log = logging.getLogger(__name__)

SDIST_NAME = "llama-cpp-python"
SDIST_VERSION = "0.3.36"
_MEMBER_DIR = "vendor/llama.cpp/models/"

# name -> sha256 of ``vendor/llama.cpp/models/ggml-vocab-<name>.gguf`` in the 0.3.36 sdist.
# All are fetched in one go, because fetching the sdist is the slow part.
KNOWN_VOCABS: dict[str, str] = {
    "qwen35": "63ed952ff338996cf0bdf24a7b10015124273f75c6dc9bb427356aa3f67ec62c",
    "qwen2": "44c2f46b715f585c6ab513970e8a006bfa5badd6108560054921cf598d154d8c",
    "llama-bpe": "97272e430d53bc7688f52d5e0ad8ea8f163ede9f1bbd1694feaa504797d5d96e",
    "gpt-2": "cedc56ca6e2e89f63e781696d1fd76b4b1d49e6720dee86463e915f6e90016ac",
    "mpt": "59dc382612866d1fc6c11ea531318d327598f3412d9c8f8600607cdf3030898f",
}

PIP_TIMEOUT_S = 1800


def cache_dir() -> Path:
    """``$P2PSWARM_CACHE`` if set, else ``~/.cache/p2pswarm``."""
    env = os.environ.get("P2PSWARM_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "p2pswarm"


def _vocab_dir() -> Path:
    return cache_dir() / "vocab" / f"{SDIST_NAME}-{SDIST_VERSION}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _cached(name: str) -> Path | None:
    path = _vocab_dir() / f"ggml-vocab-{name}.gguf"
    if not path.is_file():
        return None
    if _sha256(path) != KNOWN_VOCABS[name]:
        log.warning("cached %s does not match its pinned sha256; fetching it again", path)
        return None
    return path


def _download_sdist(dest: Path) -> Path:
    """``pip download`` the sdist into ``dest``; return the tarball's path."""
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
        f"{SDIST_NAME}=={SDIST_VERSION}", "-d", str(dest),
    ]
    log.info("fetching %s %s sdist for its vocab files (once; cached afterwards)", SDIST_NAME, SDIST_VERSION)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        raise UserError(f"pip download of {SDIST_NAME}=={SDIST_VERSION} timed out after {PIP_TIMEOUT_S} s") from exc
    except OSError as exc:
        raise UserError(f"cannot run pip to fetch {SDIST_NAME}=={SDIST_VERSION}: {exc}") from exc
    if proc.returncode != 0:
        lines = [ln.strip() for ln in (proc.stderr or proc.stdout or "").splitlines() if ln.strip()]
        reason = lines[-1] if lines else f"exit status {proc.returncode}"
        raise UserError(f"pip download of {SDIST_NAME}=={SDIST_VERSION} failed: {reason}")
    tarballs = sorted(dest.glob("*.tar.gz"))
    if not tarballs:
        raise UserError(f"pip download of {SDIST_NAME}=={SDIST_VERSION} produced no .tar.gz sdist")
    return tarballs[0]


def _extract(tarball: Path, names: list[str], out_dir: Path) -> None:
    """Copy the wanted vocab members out of ``tarball`` (temp name, checked, then renamed)."""
    wanted = {f"ggml-vocab-{n}.gguf": n for n in names}
    found: set[str] = set()
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        with tarfile.open(tarball, "r:gz") as tar:
            for member in tar:
                base = member.name.rsplit("/", 1)[-1]
                if base not in wanted or not member.name.endswith(_MEMBER_DIR + base) or not member.isfile():
                    continue
                src = tar.extractfile(member)
                if src is None:
                    continue
                fd, tmp = tempfile.mkstemp(prefix=f".{base}.", dir=out_dir)
                try:
                    with os.fdopen(fd, "wb") as dst:
                        while block := src.read(1 << 20):
                            dst.write(block)
                    if _sha256(Path(tmp)) != KNOWN_VOCABS[wanted[base]]:
                        raise UserError(f"{base} in {tarball.name} does not match its pinned sha256")
                    os.replace(tmp, out_dir / base)
                except BaseException:
                    Path(tmp).unlink(missing_ok=True)
                    raise
                found.add(base)
                if len(found) == len(wanted):
                    break
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise UserError(f"cannot read {tarball.name}: {exc}") from exc
    missing = sorted(set(wanted) - found)
    if missing:
        raise UserError(f"{tarball.name} has no {_MEMBER_DIR}{missing[0]}")


def sdist_vocab_path(name: str) -> Path:
    """Path of ``ggml-vocab-<name>.gguf`` from the llama-cpp-python 0.3.36 sdist, fetched once.

    Raises :class:`UserError` (one line) if the file cannot be obtained.
    """
    if name not in KNOWN_VOCABS:
        raise UserError(f"unknown vocab {name!r} (known: {', '.join(sorted(KNOWN_VOCABS))})")
    path = _cached(name)
    if path is not None:
        return path
    out_dir = _vocab_dir()
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create cache directory {out_dir}: {exc}") from exc
    todo = [n for n in KNOWN_VOCABS if n == name or _cached(n) is None]
    with tempfile.TemporaryDirectory(prefix="p2pswarm-sdist-") as tmp:
        tarball = _download_sdist(Path(tmp))
        _extract(tarball, todo, out_dir)
    path = _cached(name)
    if path is None:
        raise UserError(f"could not obtain ggml-vocab-{name}.gguf from {SDIST_NAME} {SDIST_VERSION}")
    return path


def qwen35_vocab_path() -> Path:
    """The real Qwen3.5 vocab-only GGUF (151,936 tokens, ``tokenizer.ggml.pre = qwen35``)."""
    return sdist_vocab_path("qwen35")
