"""The registry of architectures: GGUF architecture name -> the class of its package under
``engine/arch/<name>/``, one line each in :func:`architectures`; what a part of p2pswarm needs to
know of an architecture it reads off that class, as a declared attribute or a Protocol it
implements, never by comparing names:

- ``expert_activation``: what its routed experts compute (:mod:`p2pswarm.engine.expert_fn`; a
  worker's bank reads it by the file's architecture name, having no dense path);
- ``DEFAULT_GATING`` (where the file may leave ``expert_gating_func`` out): passed to
  :meth:`p2pswarm.engine.routing.RouterSpec.from_layout` by the class itself;
- the MTP (NextN) block as a drafter: the class implements :class:`~p2pswarm.contracts.MtpModel`
  (:func:`mtp_architectures`);
- recurrent layers: ``recurrent_layer(il)`` (qwen35moe's DeltaNet layers; none by default).

Why a module apart from :mod:`p2pswarm.engine.arch` (which loads a model on a backend, and so
imports the kernels): the expert kernels read it, and may not import what imports them. Its
make-model presets are the one other line an architecture adds
(:data:`p2pswarm.model.synth_arches.PRESETS_BY_ARCH`: make-model writes files in the ``model``
layer, below ``engine``); ``tests/test_lint.py`` checks that the two registries name the same
architectures in the same order and that no other module names one.
"""
from __future__ import annotations

from p2pswarm.contracts import SWIGLU, DenseModel, MtpModel


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


def expert_activation(arch: str) -> str:
    """What the routed experts of ``arch`` compute (``swiglu`` or ``swiglu_oai``): its class's
    declared ``expert_activation``; ``swiglu`` for an architecture with no dense path here (the
    layout's other MoE architectures, whose experts a worker may still serve)."""
    cls = architectures().get(arch)
    return SWIGLU if cls is None else cls.expert_activation
