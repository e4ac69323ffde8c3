"""Which code computes the experts: one switch, one interface.

    bank = make_bank(layout, kernel="auto")      # "auto" | "numpy" | "ggml" | "portable"
    bank.forward(layer, expert, rows); bank.forward_groups(layer, rows, groups); bank.holds(l, e)
    bank.kernel                                  # "numpy", "ggml-0.25.3-0c1e570/x86_64+avx2+..." or "portable-1/aarch64"

``numpy`` is the reference (:class:`p2pswarm.engine.experts.numpy_bank.ExpertBank`: dequantise to float32,
cache, multiply). ``ggml`` computes on the quantised bytes in the memory map with llama.cpp's libggml
(:mod:`p2pswarm.engine.ggml.lib`): no dequantised copy, memory-bandwidth speed, llama.cpp's
numerics. ``portable`` (:mod:`p2pswarm.engine.experts.portable_kernel`) also computes on the mapped bytes,
with a fixed order of operations, so its results are the same bits on every ISA: the kernel an
aarch64 phone and an x86-64 backbone can share. ``auto`` is ggml where libggml loads (``pip install`` builds
it into the package), else numpy with one log line saying why and how to get ggml (never portable:
it is chosen, as it costs speed).

``bank.kernel`` goes into the handshake, and :func:`compatible` decides whether two nodes may work
together: bit-equality of the split run needs the same arithmetic on both sides. ``ggml-...`` ids
name a library and an ISA and match only themselves; ``portable-<version>/<isa>`` ids match every
ISA of the same version (the ISA is there for display).

The default kernel is ``$P2PSWARM_KERNEL`` when set (the CLI's ``--kernel`` sets it), else ``auto``.
"""
from __future__ import annotations

import logging

from p2pswarm import settings
from p2pswarm.contracts import ExpertBank as ExpertBankProtocol
from p2pswarm.engine.experts.numpy_bank import ExpertBank, default_cache_bytes
from p2pswarm.errors import UserError

log = logging.getLogger("p2pswarm.engine")

KERNELS = settings.KERNELS
ENV_KERNEL = settings.KERNEL.name
ENV_POPULATE = settings.POPULATE.name  # "0": the backbone maps the model's pages lazily, on first use

_warned_fallback = False


def default_kernel() -> str:
    return settings.KERNEL.get()


def resolve_kernel(kernel: str | None = None) -> str:
    """``auto``/None -> ``ggml`` or ``numpy``; ``ggml`` -> ``ggml`` or a UserError saying why not;
    ``numpy`` and ``portable`` -> themselves (portable runs anywhere: C if it builds, else numpy)."""
    global _warned_fallback
    from p2pswarm.engine.ggml.lib import GgmlUnavailable, load_libggml

    kernel = default_kernel() if kernel is None else str(kernel).strip().lower()
    if kernel not in KERNELS:
        raise UserError(f"unknown kernel {kernel!r} (choose {', '.join(KERNELS)})")
    if kernel in ("numpy", "portable"):
        return kernel
    try:
        load_libggml()
        return "ggml"
    except GgmlUnavailable as exc:
        if kernel == "ggml":
            raise UserError(f"ggml kernel unavailable ({exc})") from None
        if not _warned_fallback:
            log.warning("ggml kernel unavailable (%s); using numpy", exc)
            _warned_fallback = True
        return "numpy"


def kernel_id(kernel: str | None = None) -> str:
    """The string a bank of this kernel puts in the handshake, without building a bank."""
    from p2pswarm.engine.ggml.lib import load_libggml

    resolved = resolve_kernel(kernel)
    if resolved == "portable":
        from p2pswarm.engine.experts import portable_kernel

        return portable_kernel.kernel_id()
    return ExpertBank.kernel if resolved == "numpy" else load_libggml().kernel_id


def family(kernel_id: str) -> str:
    """The part of a kernel id that decides the bits: ``portable-1/aarch64`` -> ``portable-1``;
    any other id (``numpy``, ``ggml-<ver>/<isa+features>``) is its own family."""
    kernel_id = str(kernel_id)
    if kernel_id.startswith("portable-"):
        return kernel_id.split("/", 1)[0]
    return kernel_id


def portable_family() -> str:
    """The portable kernel's family (``portable-<version>``), which every worker can answer in."""
    from p2pswarm.engine.experts.portable_kernel import FAMILY

    return FAMILY


def answer_families(kernel_id: str) -> tuple[str, ...]:
    """The families a worker computing with ``kernel_id`` answers requests in: its own first, then
    the portable one (every worker can build the portable kernel, or run its numpy implementation).

    Why: a backbone verifies a worker bit for bit by recomputing sampled requests. A ggml backbone
    can do that for a worker of its own ggml family, but not for one of another ISA; asking such a
    worker for portable answers and recomputing them with its own portable replica works for any.
    """
    own = family(kernel_id)
    portable = portable_family()
    return (own,) if own == portable else (own, portable)


def compatible(a: str | None, b: str | None) -> bool:
    """Whether nodes advertising kernel ids ``a`` and ``b`` compute the same bits (the handshake's
    and the DHT filter's one test). Portable ids of one version match across ISAs; nothing else
    matches anything but itself."""
    if not isinstance(a, str) or not isinstance(b, str):
        return False
    return family(a) == family(b)


def make_bank(layout, kernel: str | None = "auto", *, cache_bytes: int | None = None,
              threads: int | None = None, graph_cache_bytes: int = 0,
              scratch_keep_bytes: int | None = None) -> ExpertBankProtocol:
    """An expert bank over ``layout`` computed by ``kernel``.

    Options belong to one kernel and are ignored by the other (so a caller can pass both):
    ``cache_bytes`` bounds the numpy kernel's dequantised cache; ``threads`` is ggml's thread count
    (default ``$P2PSWARM_THREADS`` or the CPUs available, at most 8), also the portable kernel's;
    ``graph_cache_bytes`` lets the ggml kernel keep its graphs across calls (the backbone's replica;
    :meth:`~p2pswarm.engine.ggml.runner.GgmlRunner.graph`), ``scratch_keep_bytes`` keep a large
    call's scratch memory between calls (:class:`~p2pswarm.engine.ggml.runner.GgmlRunner`).
    """
    resolved = resolve_kernel(kernel)
    if resolved == "portable":
        from p2pswarm.engine.experts.portable_kernel import PortableExpertBank

        return PortableExpertBank(layout, threads=threads)
    if resolved == "numpy":
        return ExpertBank(layout, cache_bytes=default_cache_bytes() if cache_bytes is None else cache_bytes)
    from p2pswarm.engine.experts.ggml_bank import GgmlExpertBank

    return GgmlExpertBank(layout, threads=threads, graph_cache_bytes=graph_cache_bytes,
                          scratch_keep_bytes=scratch_keep_bytes)
