"""glm4moe (GLM-4.5, GLM-4.5-Air, GLM-4.6): GQA attention with biases and partial RoPE,
leading dense FFN layers, a sigmoid router with selection bias and a shared expert; its NextN blocks
are the MTP drafter's (:mod:`p2pswarm.backbone.serving.mtp`). Its numpy dense path is :mod:`.model`; its
make-model presets are :mod:`p2pswarm.model.synth_glm4moe` (the model layer: make-model writes
files without the engine)."""
from p2pswarm.engine.arch.glm4moe.model import Glm4MoE

__all__ = ["Glm4MoE"]
