"""Dense paths by GGUF architecture name: one package per architecture (``engine/arch/<name>/``),
one line each in the registry (:func:`~p2pswarm.engine.arch.registry.architectures`, re-exported
here with what it reads off the classes). ``load_dense(layout, kernel)`` picks the right one and
gives it its backend (:class:`~p2pswarm.engine.backend.DenseBackend`), chosen once, here."""
from __future__ import annotations

import gc

from p2pswarm import settings
from p2pswarm.contracts import DenseModel
from p2pswarm.engine.arch.registry import architectures, mtp_architectures
from p2pswarm.engine.backend import open_backend
from p2pswarm.engine.kernels import resolve_kernel
from p2pswarm.errors import ModelFormatError
from p2pswarm.model.layout import ModelLayout

__all__ = ["architectures", "load_dense", "mtp_architectures"]


def load_dense(layout: ModelLayout, kernel: str | None = "numpy", *, threads: int | None = None) -> DenseModel:
    """The dense path of ``layout``'s architecture on ``kernel``'s backend (``numpy``: the reference,
    also the ``portable`` kernel's; ``ggml``; ``auto``/None: as :func:`~p2pswarm.engine.kernels.resolve_kernel`
    says). ``threads``: the ggml runner's. Its ``backend.tensors`` says how many quantised dense
    tensors ggml took (0: an all-float file, whose numpy dense path stays whole)."""
    archs = architectures()
    cls = archs.get(layout.arch)
    if cls is None:
        raise ModelFormatError(
            f"{layout.path}: no engine for architecture {layout.arch!r} yet (supported: {', '.join(archs)})"
        )
    backend = open_backend(layout, resolve_kernel(kernel), threads=threads)
    model = cls(layout, backend)
    backend.take(layout, model.w)
    if settings.GC_FREEZE.get():
        _freeze_loaded_objects()
    return model


def _freeze_loaded_objects() -> None:
    """Move everything loaded so far (above all the GGUF reader's metadata: the 151,936-token
    vocabulary of a Qwen3.5 model is lists of ~150k arrays each) out of the cyclic collector's
    reach, for good: a serving process keeps them as long as it lives.

    Why: every full collection traverses those lists, 0.2 s each on the geometry-122b model, and a
    decode step allocates enough containers (ctypes, trio) to trigger them: 10% of a decode
    step's samples were ``gc_collect_main`` (bench/profile_decode.py). Garbage made later is still
    collected as usual. The cost: a model caught in a reference cycle is never freed, nor its memory
    maps. Nothing in p2pswarm makes one, and a test that wraps a model's method must undo it (a
    5 GB model a test had deleted stayed mapped, on disk, for the rest of the run). Unfreezing when
    a backbone closes was tried: the next load's full collection then walks every object the
    process holds, 11 s more over the quick test subset's ~100 backbones."""
    gc.collect()
    gc.freeze()
