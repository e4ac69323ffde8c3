"""The dense path's backend, chosen once where the model is loaded and handed to the architecture.

Why a value passed in: the architectures run llama.cpp's ops as ggml graphs where the ggml kernel
holds the dense path, and numpy's otherwise. That choice used to be an attribute the kernel
attached to the weights after the model was built (``w.ggml_dense``), probed with ``getattr`` in
eleven places; now :func:`p2pswarm.engine.arch.load_dense` makes one :class:`DenseBackend` and
gives it to the model's constructor, so every architecture reads ``self.backend.ggml`` (None: the
numpy path) and a type checker sees what it holds.

``numpy`` (the reference; also the ``portable`` kernel's dense path: the dense path runs only on
the backbone, outside what must agree across ISAs) holds nothing. ``ggml`` holds the
:class:`~p2pswarm.engine.ggml.dense.GgmlDense` engine: its graph runner, the model file's tensors
on the memory map, and the caches of ggml tensors made from them.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from p2pswarm import settings
from p2pswarm.contracts import DenseWeights
from p2pswarm.engine.blas import single_threaded_blas

if TYPE_CHECKING:
    from p2pswarm.engine.ggml.dense import GgmlDense
    from p2pswarm.engine.ggml.runner import GgmlRunner
    from p2pswarm.model.layout import ModelLayout

log = logging.getLogger("p2pswarm.engine")


@dataclass
class DenseBackend:
    """What computes a model's dense path: ``kind`` ``"numpy"`` or ``"ggml"``; ``ggml`` the engine
    when ``kind`` is ggml; ``tensors`` how many quantised dense tensors it took from the file
    (0 for an all-float file: numpy's dense path stays whole, its layer graphs still run)."""

    kind: str = "numpy"
    ggml: GgmlDense | None = None
    tensors: int = field(default=0)

    @property
    def runner(self) -> GgmlRunner | None:
        """The ggml engine's graph runner; None on the numpy path."""
        return self.ggml.runner if self.ggml is not None else None

    def take(self, layout: ModelLayout, w: DenseWeights) -> int:
        """Hand ``w`` the engine's matrices (:meth:`DenseWeights.provide`) for every quantised 2-D
        dense tensor (attention, shared expert, embedding, lm head) and, in a quantised model, the
        float32 routers (``ffn_gate_inp``: llama.cpp's F32 mat-mul, one kernel for any row count, so
        the batch-invariant mode can route all sequences' rows in one call). Returns how many
        quantised tensors it took (kept in ``tensors``); nothing on the numpy path."""
        dense = self.ggml
        if dense is None:
            return 0
        if not isinstance(w, DenseWeights):
            log.warning("dense weights %s cannot take kernel matrices; dense path stays on numpy", type(w).__name__)
            return 0
        n = 0
        for t in layout.reader.tensors:
            if dense.eligible(t) and not w.is_loaded(t.name) and w.provide(t.name, dense.matrix(t)):
                n += 1
        if n:  # a quantised model: its F32 routers too (an all-F32 file keeps numpy's dense path whole)
            for t in layout.reader.tensors:
                if dense.router(t) and not w.is_loaded(t.name):
                    w.provide(t.name, dense.matrix(t))
        self.tensors = n
        return n


NUMPY = DenseBackend()


def open_backend(layout: ModelLayout, kind: str, *, threads: int | None = None) -> DenseBackend:
    """The backend of resolved kernel ``kind`` (``numpy``, ``portable`` or ``ggml``) for ``layout``.

    With ``ggml`` numpy's BLAS is also limited to one thread (see :mod:`p2pswarm.engine.blas`), and
    every page of the model file is mapped now, as llama.cpp's loader does
    (:func:`~p2pswarm.engine.ggml.runner.populate`; ``P2PSWARM_POPULATE=0`` leaves them to fault in):
    a strong node holds the model at its quantised size, and its dense mat-muls get llama.cpp's
    numerics too."""
    if kind in ("numpy", "portable"):
        return DenseBackend()
    from p2pswarm.engine.ggml.dense import GgmlDense  # loads libggml: only where it is asked for
    from p2pswarm.engine.ggml.runner import populate

    dense = GgmlDense(layout, threads=threads)
    single_threaded_blas()
    if settings.POPULATE.get():
        for part in layout.parts:
            populate(part.data)
    return DenseBackend("ggml", dense)
