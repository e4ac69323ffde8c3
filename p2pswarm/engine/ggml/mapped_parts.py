"""ggml tensors on a model's memory maps, whether the model is one file or split into parts.

:class:`~p2pswarm.engine.ggml.runner.MappedWeights` wraps one file's map; a split model
(:mod:`p2pswarm.model.split_gguf`) has one map per part, and every offset the engine holds is an
offset of the merged file. :func:`map_layout` gives the engine one object either way, with
``MappedWeights``' ``tensor``/``close``, so no caller needs to know how the model is stored.
"""
from __future__ import annotations

from p2pswarm.engine.ggml.runner import MappedWeights


class MappedParts:
    """One :class:`MappedWeights` per part of a split model, addressed by merged-file offsets."""

    def __init__(self, lib, layout):
        self.layout = layout
        self.name = str(layout.path)
        self._maps = {str(p.path): MappedWeights(lib, p.data, str(p.path)) for p in layout.parts}

    def tensor(self, ggml_type: int, ne0: int, ne1: int, offset: int, what: str, ne2: int = 1):
        """As :meth:`MappedWeights.tensor`, ``offset`` being the merged file's: the first byte
        places the tensor in its part (a tensor never spans parts)."""
        part, part_offset = self.layout.locate(offset, 1)
        return self._maps[str(part.path)].tensor(ggml_type, ne0, ne1, part_offset, what, ne2)

    def close(self) -> None:
        for m in self._maps.values():
            m.close()


def map_layout(lib, layout) -> MappedWeights | MappedParts:
    """The model's bytes as ggml tensors: one file's map, or a split model's maps."""
    if len(layout.parts) == 1 and not layout.part_map.split:
        return MappedWeights(lib, layout.parts[0].data, str(layout.path))
    return MappedParts(lib, layout)
