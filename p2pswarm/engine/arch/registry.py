"""The registry of architectures: GGUF architecture name -> the class of its package under
``engine/arch/<name>/``, one line each in :func:`architectures`; what a part of p2pswarm needs to
know of an architecture it reads off that class, as a declared attribute or a Protocol it
implements, never by comparing names:

- ``DEFAULT_GATING`` (where the file may leave ``expert_gating_func`` out): passed to
  :meth:`p2pswarm.engine.routing.RouterSpec.from_layout` by the class itself;
- the MTP (NextN) block as a drafter: the class implements :class:`~p2pswarm.contracts.MtpModel`
  (:func:`mtp_architectures`);
- recurrent layers: ``recurrent_layer(il)`` (qwen35moe's DeltaNet layers; none by default).

What its routed experts compute is not here: the expert banks, below ``arch`` in the engine's
layer picture, read it from the file format's table (:data:`p2pswarm.model.layout.MOE_ARCHITECTURES`,
beside where the experts' bytes are). Its make-model presets are the one other line an architecture adds
(:data:`p2pswarm.model.synth_arches.PRESETS_BY_ARCH`: make-model writes files in the ``model``
layer, below ``engine``); ``tests/test_lint.py`` checks that the two registries name the same
architectures in the same order and that no other module names one.
"""
from __future__ import annotations

from p2pswarm.contracts import DenseModel, MtpModel


def architectures() -> dict[str, type[DenseModel]]:
    """GGUF architecture name -> its dense path, one line per architecture, each the class its
    package under ``engine/arch/`` exports. Imported here, on first use: an architecture's package
    loads its graphs' code."""
    import p2pswarm.engine.arch.deepseek2 as deepseek2  # (not ``from``: that names engine.arch, which imports this)
    import p2pswarm.engine.arch.glm4moe as glm4moe
    import p2pswarm.engine.arch.gptoss as gptoss
    import p2pswarm.engine.arch.qwen35moe as qwen35moe
    import p2pswarm.engine.arch.qwen3moe as qwen3moe

    return {
        "qwen3moe": qwen3moe.Qwen3MoE,
        "qwen35moe": qwen35moe.Qwen35MoE,
        "gpt-oss": gptoss.GptOss,
        "glm4moe": glm4moe.Glm4MoE,
        "deepseek2": deepseek2.DeepSeek2,
    }


def mtp_architectures() -> list[str]:
    """The architectures whose dense path runs its file's MTP (NextN) block (``--speculate mtp``),
    in the registry's order: those whose class implements :class:`~p2pswarm.contracts.MtpModel`."""
    return [name for name, cls in architectures().items() if issubclass(cls, MtpModel)]

