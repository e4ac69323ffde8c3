"""The real Qwen3.5 vocabulary, shipped with the package: nothing is downloaded at run time.

Why shipped: the demo's tiny model and the tokenizer checks use the real Qwen3.5 vocabulary
(151,936 tokens). llama.cpp keeps a 5.9 MB vocab-only GGUF of it for its own tokenizer tests
(``models/ggml-vocab-qwen35.gguf``, MIT); we ship that file as package data
(``p2pswarm/data/``, with its licence and source in ``p2pswarm/data/README.md``). Earlier versions
fetched the 76.6 MB llama-cpp-python sdist to extract it on first use (~100 s, and a network
dependency for an offline demo).

The file is checked against a pinned SHA-256 once per process, so a damaged install is a clear
one-line error instead of a tokenizer that silently differs.

Also here, below both of its users: :func:`bytes_to_unicode`, the alphabet byte-level BPE tokens
are written in (make-model writes vocabularies in it; the engine's tokenizer reads them back).
"""
from __future__ import annotations

import functools
import hashlib
from importlib import resources
from pathlib import Path

from p2pswarm.errors import UserError

QWEN35_VOCAB_NAME = "ggml-vocab-qwen35.gguf"
#: sha256 of llama.cpp's ``models/ggml-vocab-qwen35.gguf`` (as vendored in llama-cpp-python 0.3.36).
QWEN35_VOCAB_SHA256 = "63ed952ff338996cf0bdf24a7b10015124273f75c6dc9bb427356aa3f67ec62c"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def shipped_data_path(name: str) -> Path:
    """Where the package's data file ``name`` lives (``p2pswarm/data/<name>``)."""
    return Path(str(resources.files("p2pswarm") / "data" / name))


@functools.cache
def qwen35_vocab_path() -> Path:
    """The shipped Qwen3.5 vocab-only GGUF (``tokenizer.ggml.pre = qwen35``), sha256-checked.

    Raises :class:`UserError` (one line) if the install lacks it or it does not match the pin.
    """
    path = shipped_data_path(QWEN35_VOCAB_NAME)
    if not path.is_file():
        raise UserError(f"the shipped vocabulary {path} is missing: the p2pswarm install is incomplete "
                        f"(reinstall it)")
    digest = sha256_file(path)
    if digest != QWEN35_VOCAB_SHA256:
        raise UserError(f"the shipped vocabulary {path} has sha256 {digest}, expected {QWEN35_VOCAB_SHA256}: "
                        f"the p2pswarm install is damaged (reinstall it)")
    return path


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable-character map (the alphabet byte-level BPE tokens are written in)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}
