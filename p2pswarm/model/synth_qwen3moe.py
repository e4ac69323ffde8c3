"""The qwen3moe part of ``make-model`` (the default architecture): its presets, its GGUF keys and its
tensor plan (names and shapes as llama.cpp's loader asks for them; scaling as in
:mod:`p2pswarm.model.synth`)."""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from p2pswarm.model.synth_presets import LOGIT_STD, NORM_NOISE, ROUTER_NEAR_TIE_SCALE, Preset, dense_types
from p2pswarm.model.synth_tensors import TensorPlan, add_output_head, plan_adder


@dataclasses.dataclass(frozen=True)
class Qwen3Preset(Preset):
    """A qwen3moe shape: the trunk's fields, nothing more (attention with q/k norms, routed experts)."""

    def write_keys(self, w: Any) -> None:
        """The ``qwen3moe.*`` keys (``w``: a gguf.GGUFWriter)."""
        self.write_trunk_keys(w, self.n_ff_exp * self.n_expert_used)

    def plan(self, n_vocab: int, qtype: str, expert_qtype: str | None, tied: bool,
             router_near_tie: bool) -> list[TensorPlan]:
        """The tensors of a qwen3moe model, in file order."""
        dense, exp_t = dense_types(qtype, expert_qtype)
        E, D, F, V = self.n_embd, self.n_expert, self.n_ff_exp, n_vocab
        H, Hkv, hd = self.n_head, self.n_head_kv, self.head_dim
        plans: list[TensorPlan] = []
        add = plan_adder(plans, dense, exp_t)

        add("token_embd.weight", (V, E), "embd", LOGIT_STD / np.sqrt(E) if tied else 1.0)
        router_std = (ROUTER_NEAR_TIE_SCALE if router_near_tie else 1.0) / np.sqrt(E)
        for i in range(self.n_layer):
            p = f"blk.{i}."
            add(p + "attn_norm.weight", (E,), "norm", NORM_NOISE)
            add(p + "attn_q.weight", (H * hd, E), "matrix", 1 / np.sqrt(E))
            add(p + "attn_k.weight", (Hkv * hd, E), "matrix", 1 / np.sqrt(E))
            add(p + "attn_v.weight", (Hkv * hd, E), "matrix", 1 / np.sqrt(E))
            add(p + "attn_output.weight", (E, H * hd), "matrix", 1 / np.sqrt(H * hd))
            add(p + "attn_q_norm.weight", (hd,), "norm", NORM_NOISE)
            add(p + "attn_k_norm.weight", (hd,), "norm", NORM_NOISE)
            add(p + "ffn_norm.weight", (E,), "norm", NORM_NOISE)
            add(p + "ffn_gate_inp.weight", (D, E), "router", router_std)
            add(p + "ffn_gate_exps.weight", (D, F, E), "experts", 1 / np.sqrt(E))
            add(p + "ffn_up_exps.weight", (D, F, E), "experts", 1 / np.sqrt(E))
            add(p + "ffn_down_exps.weight", (D, E, F), "experts", 1 / np.sqrt(F))
        add_output_head(add, E, V, tied)
        return plans


PRESETS: dict[str, Qwen3Preset] = {
    # Makes in about a second; every dim a multiple of 256 so K-quants apply.
    "tiny": Qwen3Preset(n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_layer=4, n_expert=16,
                        n_expert_used=4, n_ff_exp=256, context_length=512),
    # The routed-expert geometry of Qwen3.5-122B-A10B; attention is plain qwen3moe attention.
    "geometry-122b": Qwen3Preset(n_embd=3072, n_head=32, n_head_kv=2, head_dim=128, n_layer=2,
                                 n_expert=256, n_expert_used=8, n_ff_exp=1024, context_length=4096,
                                 expert_qtype="q4_k"),
}
