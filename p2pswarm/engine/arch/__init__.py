"""Dense paths by GGUF architecture name. ``load_dense(layout)`` picks the right one."""
from __future__ import annotations

from p2pswarm.errors import ModelFormatError
from p2pswarm.model.layout import ModelLayout


def load_dense(layout: ModelLayout):
    from p2pswarm.engine.arch.qwen3moe import Qwen3MoE
    from p2pswarm.engine.arch.qwen35moe import Qwen35MoE

    archs = {"qwen3moe": Qwen3MoE, "qwen35moe": Qwen35MoE}
    cls = archs.get(layout.arch)
    if cls is None:
        raise ModelFormatError(
            f"{layout.path}: no engine for architecture {layout.arch!r} yet (supported: {', '.join(archs)})"
        )
    return cls(layout)
