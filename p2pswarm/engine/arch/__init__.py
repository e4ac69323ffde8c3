"""Dense paths by GGUF architecture name: one package per architecture (``engine/arch/<name>/``),
one line each in :func:`architectures`. ``load_dense(layout, kernel)`` picks the right one and
gives it its backend (:class:`~p2pswarm.engine.backend.DenseBackend`), chosen once, here."""
from __future__ import annotations

import gc
from typing import Callable

from p2pswarm import settings
from p2pswarm.contracts import DenseModel, MtpModel
from p2pswarm.engine.backend import DenseBackend, open_backend
from p2pswarm.engine.kernels import resolve_kernel
from p2pswarm.errors import ModelFormatError
from p2pswarm.model.layout import ModelLayout


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


def architectures() -> dict[str, Callable[[ModelLayout, DenseBackend], DenseModel]]:
    """The registry: GGUF architecture name -> its dense path, one line per architecture, each the
    class its package under ``engine/arch/`` exports. Imported here, on first use: an architecture's
    package loads its graphs' code."""
    from p2pswarm.engine.arch import deepseek2, glm4moe, gptoss, qwen35moe, qwen3moe

    return {
        "qwen3moe": qwen3moe.Qwen3MoE,
        "qwen35moe": qwen35moe.Qwen35MoE,
        "gpt-oss": gptoss.GptOss,
        "glm4moe": glm4moe.Glm4MoE,
        "deepseek2": deepseek2.DeepSeek2,
    }



def mtp_architectures() -> list[str]:
    """The architectures whose dense path runs its file's MTP (NextN) block (``--speculate mtp``),
    in the registry's order: a capability the class declares by implementing
    :class:`~p2pswarm.contracts.MtpModel`, read off it here, not a list of names kept elsewhere."""
    return [name for name, cls in architectures().items() if isinstance(cls, type) and issubclass(cls, MtpModel)]

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
