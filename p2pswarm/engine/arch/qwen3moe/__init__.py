"""qwen3moe (Qwen3-30B-A3B, Qwen3-235B-A22B): GQA attention with per-head q/k RMSNorm and NEOX
RoPE, routed experts, no shared one. Its numpy dense path is :mod:`.model`; it has no ggml graph of
its own (ggml's quantised mat-muls come through :class:`~p2pswarm.engine.arch.common.DenseWeights`),
and its make-model presets are :mod:`p2pswarm.model.synth_qwen3moe` (the model layer: make-model
writes files without the engine)."""
from p2pswarm.engine.arch.qwen3moe.model import Qwen3MoE

__all__ = ["Qwen3MoE"]
