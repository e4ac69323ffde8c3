"""ExpertBank: the routed experts a node holds, and the one function that computes them.

``ExpertBank.forward(layer, expert, rows)`` is the same code in the monolithic run, in a worker
process and in the backbone's fallback replica. Bit-equality of the split run follows from calling
it on the same row groups (the backbone decides the groups, in token order) with the same weights.

A bank is built from any GGUF the model map understands: the full model (all experts) or an expert
shard (a contiguous block of experts of some layers). Expert ids are always *global* ids of the
source model; a shard translates them to its local slabs.
"""
from __future__ import annotations

import os
from typing import cast

import numpy as np

from p2pswarm import settings
from p2pswarm.engine.experts import expert_fn
from p2pswarm.engine import ops
from p2pswarm.engine.blas import single_threaded_blas
from p2pswarm.engine.weights import ByteBoundedCache, to_float32
from p2pswarm.errors import UserError
from p2pswarm.model.layout import ModelLayout

DEFAULT_CACHE_BYTES = settings.EXPERT_CACHE_MB.default << 20  # $P2PSWARM_EXPERT_CACHE_MB unset


def default_cache_bytes() -> int:
    """``$P2PSWARM_EXPERT_CACHE_MB`` MiB (default 2048), read when a bank is made."""
    return settings.EXPERT_CACHE_MB.get() << 20



def check_held(bank, layer: int, expert: int) -> None:
    """The one error every expert bank gives for an expert outside its slice (a caller's bug or a
    peer asking the wrong worker): names what is held, so the mismatch is visible in one line."""
    if not bank.holds(layer, expert):
        raise UserError(f"expert {expert} of layer {layer} is not held here "
                        f"(layers {sorted(bank.layers)}, experts {bank.expert_begin}-{bank.expert_end - 1})")

class ExpertBank:
    """Routed experts of some layers and an expert range, computed in numpy on float32."""

    kernel = "numpy"

    def __init__(self, layout: ModelLayout, *, cache_bytes: int | None = None):
        single_threaded_blas()  # the bits of numpy's products must not depend on a node's cores
        self.layout = layout
        self.cache = ByteBoundedCache(default_cache_bytes() if cache_bytes is None else cache_bytes)
        self.layers = frozenset(layout.expert_layers)
        self.expert_begin = layout.expert_begin
        self.expert_end = layout.expert_end
        self.activation = expert_fn.activation(layout)  # gpt-oss: biases and swiglu_oai

    @classmethod
    def open(cls, path: str | os.PathLike[str], **kw) -> "ExpertBank":
        return cls(ModelLayout.open(path), **kw)

    def holds(self, layer: int, expert: int) -> bool:
        return layer in self.layers and self.expert_begin <= expert < self.expert_end

    def _weights(self, layer: int, expert: int) -> tuple[np.ndarray, ...]:
        """(gate, up, down), and gpt-oss's three biases after them."""
        check_held(self, layer, expert)
        return cast(tuple[np.ndarray, ...], self.cache.get((layer, expert), lambda: self._load(layer, expert), _cost))

    def _load(self, layer: int, expert: int):
        tensors = self.layout.expert_tensors[layer]
        local = expert - self.expert_begin

        def slab(kind: str) -> np.ndarray:
            t = tensors[kind]
            off, n = t.slab(local)
            return to_float32(self.layout.view(off, n), t.ggml_type, t.shape[1:], t.name)

        if "gate_up" in tensors:
            gu = slab("gate_up")
            ff = gu.shape[0] // 2
            gate, up = gu[:ff], gu[ff:]
        else:
            gate, up = slab("gate"), slab("up")
        if "down_bias" in tensors:  # gpt-oss: one bias row per expert and projection
            return gate, up, slab("down"), slab("gate_bias"), slab("up_bias"), slab("down_bias")
        return gate, up, slab("down")

    def forward(self, layer: int, expert: int, rows: np.ndarray) -> np.ndarray:
        """down(silu(gate x) * (up x)) for rows (n, n_embd) float32 -> (n, n_embd) float32 (gpt-oss:
        the biased, clamped form of :mod:`p2pswarm.engine.experts.expert_fn`)."""
        weights = self._weights(layer, expert)
        if self.activation == expert_fn.SWIGLU_OAI:
            return expert_fn.oai_expert(rows, *weights)
        if len(weights) != 3:
            raise UserError(f"the experts of layer {layer} have biases, which {self.layout.arch} experts do not use")
        return ops.swiglu_expert(rows, *weights)

    def forward_groups(self, layer: int, rows: np.ndarray, groups: list[tuple[int, np.ndarray]]) -> list[np.ndarray]:
        """Every (expert, row indices) group of one layer: rows[idx] through that expert, in order."""
        return [self.forward(layer, e, np.ascontiguousarray(rows[idx])) for e, idx in groups]


def _cost(value) -> int:
    # F32 weights are views of the memory map: no private memory.
    return sum(0 if _is_mmap_view(a) else a.nbytes for a in value)


def _is_mmap_view(a: np.ndarray) -> bool:
    base = a
    while isinstance(base, np.ndarray) and base.base is not None:
        if isinstance(base, np.memmap):
            return True
        base = base.base
    return isinstance(base, np.memmap) or type(base).__name__ == "mmap"

