"""The glm4moe (GLM-4.5) part of ``make-model``: its tensor plan, its GGUF keys and its option checks.

Names and shapes are those llama.cpp's loader (``llama_model_glm4_moe::load_arch_tensors``) asks
for. Weights beyond the rule in :mod:`p2pswarm.model.synth`::

    attn_q/k/v.bias                  std 0.1
    ffn_gate / ffn_up (dense), shared gate/up
                                     std 1/sqrt(n_embd)
    ffn_down (dense), shared down    std 1/sqrt(in)
    exp_probs_b.bias                 std ``bias_std`` (0.1): sigmoid probabilities are ~0.5 +- 0.2,
                                     so the bias changes some choices and not most
    nextn.eh_proj                    std 1/sqrt(2 n_embd); nextn norms as every norm

The NextN blocks (``n_nextn`` after the trunk) hold what llama.cpp's MTP graph reads: a full MoE
block plus ``nextn.eh_proj``, ``nextn.enorm``, ``nextn.hnorm`` and ``nextn.shared_head_norm``; the
forward pass never runs them (see :mod:`p2pswarm.engine.arch.glm4moe`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import numpy as np

from p2pswarm.errors import UserError
from p2pswarm.model.synth_presets import LOGIT_STD, NORM_NOISE, ROUTER_NEAR_TIE_SCALE, Preset, _gguf, dense_types
from p2pswarm.model.synth_tensors import TensorPlan, add_mtp_extras, add_output_head, plan_adder

@dataclasses.dataclass(frozen=True)
class Glm4Preset(Preset):
    """A glm4moe shape (GLM-4.5): the qwen3moe fields plus partial NEOX RoPE, attention biases,
    leading dense FFN layers, a shared expert, the sigmoid router's scale and the NextN blocks.

    ``n_layer`` counts the trunk layers; ``n_nextn`` NextN/MTP blocks are written after them
    (block_count = n_layer + n_nextn). At most ``n_layer - 1`` of the trunk layers are dense, so a
    preset cut short with ``--layers`` keeps at least one layer with routed experts."""

    MTP: ClassVar[bool] = True
    DESCRIPTION: ClassVar[str] = "GLM-4.5: leading dense layers, sigmoid router with a selection bias, shared expert, a NextN block"

    n_rot: int = 32  # rotated dims per head (GLM-4.5: head_dim / 2)
    n_ff: int = 512  # the dense layers' FFN size (feed_forward_length)
    n_dense: int = 1  # leading dense FFN layers (leading_dense_block_count)
    n_expert_shared: int = 1  # the shared expert is n_ff_exp * n_expert_shared wide
    n_nextn: int = 1  # NextN / MTP blocks after the trunk (nextn_predict_layers)
    weights_scale: float = 2.5  # expert_weights_scale (routed_scaling_factor)
    bias_std: float = 0.1  # exp_probs_b: the router's selection bias

    def __post_init__(self) -> None:
        if isinstance(self.n_layer, int) and isinstance(self.n_dense, int) and self.n_dense >= self.n_layer:
            object.__setattr__(self, "n_dense", max(0, self.n_layer - 1))

    def mtp_blocks(self) -> int:
        return self.n_nextn

    def write_keys(self, w: Any) -> None:
        """The ``glm4moe.*`` keys (``w``: a gguf.GGUFWriter)."""
        self.write_trunk_keys(w, self.n_ff)
        w.add_rope_dimension_count(self.n_rot)
        w.add_leading_dense_block_count(self.n_dense)
        w.add_expert_shared_count(self.n_expert_shared)
        w.add_expert_weights_scale(self.weights_scale)
        w.add_expert_weights_norm(True)
        w.add_expert_gating_func(_gguf().ExpertGatingFuncType.SIGMOID)
        w.add_nextn_predict_layers(self.n_nextn)

    def validate(self, qtype: str, expert_qtype: str | None) -> None:
        """The glm4moe-only constraints, each a one-line UserError."""
        for name in ("n_rot", "n_ff"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise UserError(f"{name} must be a positive integer, got {v!r}")
        for name in ("n_dense", "n_expert_shared", "n_nextn"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise UserError(f"{name} must be a non-negative integer, got {v!r}")
        if self.n_rot % 2 or self.n_rot > self.head_dim:
            raise UserError(f"n_rot ({self.n_rot}) must be even and at most head_dim ({self.head_dim})")
        if qtype in ("q8_0", "q4_k_m"):
            for name, v in (("n_ff", self.n_ff), ("n_head * head_dim", self.n_head * self.head_dim)):
                if v % 32:
                    raise UserError(f"{name} ({v}) must be a multiple of 32 for this type")

    def plan(self, n_vocab: int, qtype: str, expert_qtype: str | None, tied: bool,
             router_near_tie: bool) -> list[TensorPlan]:
        """The tensors of a glm4moe model, in file order (llama.cpp's names and shapes)."""
        dense, exp_t = dense_types(qtype, expert_qtype)
        E, D, F, V = self.n_embd, self.n_expert, self.n_ff_exp, n_vocab
        H, Hkv, hd, Fd, Fs = self.n_head, self.n_head_kv, self.head_dim, self.n_ff, self.n_ff_exp * self.n_expert_shared
        plans: list[TensorPlan] = []

        add = plan_adder(plans, dense, exp_t)

        add("token_embd.weight", (V, E), "embd", LOGIT_STD / np.sqrt(E) if tied else 1.0)
        router_std = (ROUTER_NEAR_TIE_SCALE if router_near_tie else 1.0) / np.sqrt(E)
        for i in range(self.n_layer + self.n_nextn):
            p = f"blk.{i}."
            add(p + "attn_norm.weight", (E,), "norm", NORM_NOISE)
            add(p + "attn_q.weight", (H * hd, E), "matrix", 1 / np.sqrt(E))
            add(p + "attn_q.bias", (H * hd,), "vector", 0.1)
            add(p + "attn_k.weight", (Hkv * hd, E), "matrix", 1 / np.sqrt(E))
            add(p + "attn_k.bias", (Hkv * hd,), "vector", 0.1)
            add(p + "attn_v.weight", (Hkv * hd, E), "matrix", 1 / np.sqrt(E))
            add(p + "attn_v.bias", (Hkv * hd,), "vector", 0.1)
            add(p + "attn_output.weight", (E, H * hd), "matrix", 1 / np.sqrt(H * hd))
            add(p + "attn_q_norm.weight", (hd,), "norm", NORM_NOISE)
            add(p + "attn_k_norm.weight", (hd,), "norm", NORM_NOISE)
            add(p + "post_attention_norm.weight", (E,), "norm", NORM_NOISE)
            if i < self.n_dense:
                add(p + "ffn_gate.weight", (Fd, E), "matrix", 1 / np.sqrt(E))
                add(p + "ffn_up.weight", (Fd, E), "matrix", 1 / np.sqrt(E))
                add(p + "ffn_down.weight", (E, Fd), "matrix", 1 / np.sqrt(Fd))
            else:
                add(p + "ffn_gate_inp.weight", (D, E), "router", router_std)
                add(p + "exp_probs_b.bias", (D,), "vector", self.bias_std)
                add(p + "ffn_gate_exps.weight", (D, F, E), "experts", 1 / np.sqrt(E))
                add(p + "ffn_up_exps.weight", (D, F, E), "experts", 1 / np.sqrt(E))
                add(p + "ffn_down_exps.weight", (D, E, F), "experts", 1 / np.sqrt(F))
                if Fs:
                    add(p + "ffn_gate_shexp.weight", (Fs, E), "matrix", 1 / np.sqrt(E))
                    add(p + "ffn_up_shexp.weight", (Fs, E), "matrix", 1 / np.sqrt(E))
                    add(p + "ffn_down_shexp.weight", (E, Fs), "matrix", 1 / np.sqrt(Fs))
            if i >= self.n_layer:  # a NextN / MTP block: what llama.cpp's MTP graph reads besides the block
                add_mtp_extras(add, p, E)
        add_output_head(add, E, V, tied)
        return plans


PRESETS_GLM4: dict[str, Glm4Preset] = {
    # Makes in about a second: 1 dense + 3 MoE layers + 1 NextN block, 8 query heads of 64
    # (q 512 wide != n_embd 256), 2 KV heads, half the head rotated, q/k/v biases and q/k norms.
    "tiny": Glm4Preset(n_embd=256, n_head=8, n_head_kv=2, head_dim=64, n_layer=4, n_expert=16,
                       n_expert_used=4, n_ff_exp=256, context_length=512, rms_eps=1e-5),
    # GLM-4.5 (355B-A32B) per layer and per expert: n_embd 5120, 96 query / 8 KV heads of 128, 64
    # rotary dims, dense FFN 12288 on the first 3 layers, 160 routed experts (top-8, 1536, Q4_K) +
    # 1 shared, sigmoid router scaled 2.5. The real model has 92 layers + 1 NextN; this preset
    # writes 4 (3 dense + 1 MoE) + 1 NextN unless --layers says otherwise.
    "geometry-glm45": Glm4Preset(n_embd=5120, n_head=96, n_head_kv=8, head_dim=128, n_layer=4, n_expert=160,
                                 n_expert_used=8, n_ff_exp=1536, context_length=4096, rms_eps=1e-5,
                                 expert_qtype="q4_k", n_rot=64, n_ff=12288, n_dense=3),
}
