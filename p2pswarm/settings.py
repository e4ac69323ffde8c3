"""Every ``P2PSWARM_*`` environment variable, typed and documented, read in this one place.

Why one module: the variables used to be read with ``os.environ.get`` in a dozen modules, each
with its own parsing (or none: ``P2PSWARM_EXPERT_CACHE_MB=abc`` was a traceback at import time).
Here each variable is one :class:`Var` with its type, default and meaning; a bad value is a one-line
:class:`~p2pswarm.errors.UserError` naming the variable. Values are read when asked for, not at
import time, because the CLI and the tests set some of them (``--kernel`` sets
``P2PSWARM_KERNEL`` for the processes a command starts) after p2pswarm is imported.

``tests/test_lint.py`` checks that no other module reads a ``P2PSWARM_*`` variable from the
environment and that docs/configuration.md lists every variable defined here.
``native/build_ggml.py`` (``P2PSWARM_GGML_SOURCE``/``_BUILD``/``_CACHE``/``_COMMIT``) is not
covered: it runs at install time, before the package is importable.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Callable

from p2pswarm.errors import UserError

_OFF = ("0", "off", "no", "false", "disabled")

#: The expert kernels (``--kernel`` and ``P2PSWARM_KERNEL``); see docs/kernels.md.
KERNELS = ("auto", "numpy", "ggml", "portable")


def _int_at_least(lowest: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise ValueError("is not an integer") from None
        if n < lowest:
            raise ValueError(f"must be >= {lowest}")
        return n
    return parse


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)


def _non_negative_float(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise ValueError("is not a number") from None
    if not x >= 0:
        raise ValueError("must be >= 0")
    return x


def _kernel(text: str) -> str:
    k = text.strip().lower() or "auto"
    if k not in KERNELS:
        raise ValueError(f"unknown kernel (choose {', '.join(KERNELS)})")
    return k


def _switch(text: str) -> bool:
    """True unless the value says off (0/off/no/false/disabled); an unset variable is its default."""
    return text.strip().lower() not in _OFF


def _level(text: str) -> str:
    return text.strip().upper()


@dataclasses.dataclass(frozen=True)
class Var:
    """One environment variable: its name, how its text becomes a value, its default, its meaning."""

    name: str
    parse: Callable[[str], Any]
    default: Any
    doc: str

    @property
    def is_set(self) -> bool:
        return bool(os.environ.get(self.name))

    def get(self) -> Any:
        """The parsed value; the default when unset or empty; a one-line UserError when malformed."""
        text = os.environ.get(self.name)
        if not text:
            return self.default
        try:
            return self.parse(text)
        except ValueError as exc:
            raise UserError(f"{self.name}={text!r}: {exc}") from None

    def raw(self) -> str | None:
        """The text as set (None when unset or empty): for values that are paths or tokens."""
        return os.environ.get(self.name) or None


HOME = Var("P2PSWARM_HOME", Path, None, "node state: identity keys and downloaded slices (default ~/.p2pswarm)")
CACHE = Var("P2PSWARM_CACHE", Path, None,
            "cached shards and the demo model (default $XDG_CACHE_HOME/p2pswarm, "
            "else ~/.cache/p2pswarm)")
KERNEL = Var("P2PSWARM_KERNEL", _kernel, "auto", "expert kernel when --kernel is not given: auto, numpy, ggml, portable")
THREADS = Var("P2PSWARM_THREADS", _positive_int, None,
              "ggml/portable threads per process (default: the CPUs available, at most 8)")
ADAPT_THREADS = Var("P2PSWARM_ADAPT_THREADS", _switch, True,
                    "off: every ggml graph uses the configured threads, even when other processes keep CPUs busy "
                    "(on: at most the CPUs they left free over the last 0.5 s)")
GRAPH_CACHE_MB = Var("P2PSWARM_GRAPH_CACHE_MB", _non_negative_int, 256,
                     "the backbone's kept ggml graphs of decode steps (reused while a step's shape repeats), in MiB; 0: off")
SCRATCH_MB = Var("P2PSWARM_SCRATCH_MB", _non_negative_int, 2048,
                 "the most ggml scratch (one graph call's activations) the backbone keeps between calls, per "
                 "runner, in MiB; kept scratch unused for 10 s is freed (a worker keeps 64)")
WORKER_GRAPH_CACHE_MB = Var("P2PSWARM_WORKER_GRAPH_CACHE_MB", _non_negative_int, 16,
                            "a worker's kept ggml graphs of requests whose shape recurs (a decode step's few rows), "
                            "in MiB; 0: off")
INLINE_MS = Var("P2PSWARM_INLINE_MS", _non_negative_float, 1.5,
                "a compute call expected to take at most this many ms runs on the event loop, not in a thread "
                "(0: always a thread)")
EXPERT_CACHE_MB = Var("P2PSWARM_EXPERT_CACHE_MB", _positive_int, 2048,
                      "the numpy kernel's cache of dequantised experts, in MiB")
POPULATE = Var("P2PSWARM_POPULATE", _switch, True,
               "0: with ggml, fault the model's pages in lazily instead of mapping them all at load")
GC_FREEZE = Var("P2PSWARM_NO_GC_FREEZE", lambda t: not t, True,
                "any value: do not move the loaded model's objects out of the cyclic collector's reach")
GGML = Var("P2PSWARM_GGML", _switch, True, "off: behave as if libggml could not be loaded (auto falls back to numpy)")
GGML_LIB = Var("P2PSWARM_GGML_LIB", Path, None, "a directory holding libggml to load instead of the built one")
PORTABLE_NATIVE = Var("P2PSWARM_PORTABLE_NATIVE", _switch, True,
                      "off: the portable kernel uses its numpy implementation instead of C")
PORTABLE_LIB = Var("P2PSWARM_PORTABLE_LIB", Path, None,
                   "a prebuilt portable-kernel .so (e.g. cross-compiled for a phone) instead of building one")
WIRE_INPUTS = Var("P2PSWARM_WIRE_INPUTS", _switch, True,
                  "off: a backbone sends expert input rows as float32 even to workers that take them "
                  "pre-quantised in their kernel's own form (docs/protocol.md; same output bits either way)")
WIRE_CODEC = Var("P2PSWARM_WIRE_CODEC", _switch, True,
                 "off: no lossless coding of the expert RPC's rows (float32 outputs byte-plane split + zstd, "
                 "Q8_K inputs without their derivable sums; p2pswarm.net.wire.codec): a worker does not "
                 "offer it, a backbone does not ask for it")
WIRE_CODEC_FAST_MBPS = Var("P2PSWARM_WIRE_CODEC_FAST_MBPS", _non_negative_float, 400.0,
                           "a backbone asks a worker for coded outputs only while the link it reads the "
                           "worker's replies from is not measured at or above this many Mbit/s (coding "
                           "saves ~17% of the bytes for ~3 ms of CPU per MiB; p2pswarm.net.wire.link_rate)")
DIRECT_AEADS = ("chacha20-poly1305", "aes-256-gcm")  # the direct lane's AEADs (p2pswarm.net.wire.direct)


def _aead(text: str) -> str:
    a = text.strip().lower()
    if a not in DIRECT_AEADS:
        raise ValueError(f"not one of {', '.join(DIRECT_AEADS)}")
    return a


DIRECT_AEAD = Var("P2PSWARM_DIRECT_AEAD", _aead, None,
                  "the one AEAD this node seals a direct lane with: chacha20-poly1305 or aes-256-gcm (default: "
                  "AES-256-GCM first where the CPU has AES instructions, else ChaCha20-Poly1305; the backbone's "
                  "hello lists them and the worker picks)")
LOG_LEVEL = Var("P2PSWARM_LOG_LEVEL", _level, "INFO", "log level of p2pswarm's loggers when -v is not given")
LIBP2P_LOG = Var("P2PSWARM_LIBP2P_LOG", _level, "CRITICAL", "log level of py-libp2p's loggers")
PROGRESS_AFTER = Var("P2PSWARM_PROGRESS_AFTER", _non_negative_float, None,
                     "seconds before a progress bar appears (default: the command's own)")
WSS_CA = Var("P2PSWARM_WSS_CA", Path, None, "a PEM file of extra CA certificates trusted for /wss dials")
RELAY_TOKEN = Var("P2PSWARM_RELAY_TOKEN", str, None, "a node token, or a file holding one, shown to relays that ask for one")

ALL: tuple[Var, ...] = tuple(v for v in globals().values() if isinstance(v, Var))


def home_dir() -> Path:
    """``$P2PSWARM_HOME``, else ``~/.p2pswarm``."""
    return HOME.get() or Path.home() / ".p2pswarm"


def cache_dir(*parts: str, create: bool = True, per_user: bool = False) -> Path:
    """``$P2PSWARM_CACHE/<parts>``, else ``$XDG_CACHE_HOME/p2pswarm/<parts>``, else
    ``~/.cache/p2pswarm/<parts>``; made when missing (``create``).

    ``per_user``: skip ``$P2PSWARM_CACHE``, for build outputs keyed by their inputs (the portable
    kernel's .so), which every test's own ``P2PSWARM_CACHE`` would otherwise rebuild."""
    user = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "p2pswarm"
    base = user if per_user else (CACHE.get() or user)
    d = base.joinpath(*parts)
    if create:
        d.mkdir(parents=True, exist_ok=True)
    return d
