"""Synthetic ``gpt-oss`` models (OpenAI's gpt-oss MoE, llama.cpp's ``LLM_ARCH_OPENAI_MOE``): the
presets, the tensor plan and random but valid MXFP4 expert blocks.

Kept apart from the qwen modules (:mod:`~p2pswarm.model.synth_tensors`, ``synth_presets``) so this
architecture is added, not woven in. What a gpt-oss file holds beyond a qwen3moe one (names and
shapes as llama.cpp's ``llama_model_openai_moe::load_arch_tensors`` creates them)::

    blk.N.attn_{q,k,v}.bias, attn_output.bias      std 0.1 (F32)
    blk.N.attn_sinks.weight (n_head)               std 1   (F32: one extra softmax logit per head)
    blk.N.post_attention_norm.weight               the experts' input norm (there is no ffn_norm)
    blk.N.ffn_gate_inp.bias (n_expert)             std 0.5 (F32)
    blk.N.ffn_{gate,up}_exps.bias (n_expert, ff)   std 0.1 (F32: one row per expert)
    blk.N.ffn_down_exps.bias (n_expert, n_embd)    std 0.1 (F32)
    output.weight                                  always (llama.cpp requires it: never tied)

No q/k norms. Keys: ``attention.sliding_window`` (every even layer slides, llama.cpp's pattern 2)
and YaRN rope scaling (``rope.scaling.type`` yarn, ``factor``, ``original_context_length``).

MXFP4 (``expert_qtype="mxfp4"``): blocks of 32 weights in 17 bytes, one E8M0 exponent byte ``e``
then 16 bytes of 4-bit E2M1 codes (low nibbles are weights 0..15, high nibbles 16..31); a weight is
``2^(e-128) * k`` with ``k`` in (0, 1, 2, 3, 4, 6, 8, 12) and their negatives (ggml-common.h's
``block_mxfp4``, ``kvalues_mxfp4``; gguf-py's ``quants.MXFP4`` reads the same). Written here
directly from a seeded generator (uniform codes, ``e`` chosen per block for the wanted std:
:func:`~p2pswarm.model.synth_tensors.random_mxfp4_blocks`), as ``random_q4_k_blocks`` does for Q4_K: quantising 6e9 float32
weights of the 120b geometry would take far longer than writing them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import numpy as np

from p2pswarm.errors import UserError
from p2pswarm.model.synth_presets import NORM_NOISE, ROUTER_NEAR_TIE_SCALE, Preset, _gguf, dense_types
from p2pswarm.model.synth_tensors import MXFP4_BLOCK, TensorPlan, add_output_head, plan_adder

ARCH_GPTOSS = "gpt-oss"

BIAS_STD = 0.1
ROUTER_BIAS_STD = 0.5
SINK_STD = 1.0


@dataclasses.dataclass(frozen=True)
class GptOssPreset(Preset):
    """A gpt-oss shape: the qwen3moe fields plus the sliding window and YaRN."""

    DESCRIPTION: ClassVar[str] = "attention sinks, alternating sliding window, biased experts with a clamped SwiGLU"

    sliding_window: int = 128
    rope_scaling_factor: float = 32.0
    rope_original_context: int = 4096

    KEYWORDS: ClassVar[tuple[str, ...]] = ("sliding_window",)

    def default_tied(self, n_vocab: int) -> bool:
        return False  # llama.cpp requires output.weight

    def write_keys(self, w: Any) -> None:
        """The ``gpt-oss.*`` keys (``w``: a gguf.GGUFWriter)."""
        self.write_trunk_keys(w, self.n_ff_exp * self.n_expert_used)
        g = _gguf()
        w.add_sliding_window(self.sliding_window)
        w.add_rope_scaling_type(g.RopeScalingType.YARN)
        w.add_rope_scaling_factor(self.rope_scaling_factor)
        w.add_rope_scaling_orig_ctx_len(self.rope_original_context)

    def validate(self, qtype: str, expert_qtype: str | None) -> None:
        """The gpt-oss-only constraints, each a one-line UserError."""
        if not (isinstance(self.sliding_window, int) and not isinstance(self.sliding_window, bool) and self.sliding_window > 0):
            raise UserError(f"sliding_window must be a positive integer, got {self.sliding_window!r}")
        if expert_qtype == "mxfp4":
            for name in ("n_embd", "n_ff_exp"):
                if getattr(self, name) % MXFP4_BLOCK:
                    raise UserError(f"{name} ({getattr(self, name)}) must be a multiple of {MXFP4_BLOCK} for MXFP4 experts")
        if expert_qtype == "q4_k":
            raise UserError("gpt-oss experts are MXFP4 (--expert-type mxfp4) or follow --type")
        if qtype == "q4_k_m":
            raise UserError("--type q4_k_m is not offered for gpt-oss (its experts are MXFP4: use "
                            "--expert-type mxfp4 with --type f32, f16 or q8_0)")

    def plan(self, n_vocab: int, qtype: str, expert_qtype: str | None, tied: bool,
             router_near_tie: bool) -> list[TensorPlan]:
        """The tensors of a gpt-oss model, in file order (llama.cpp's names and shapes)."""
        if tied:
            raise UserError("gpt-oss has no tied output (llama.cpp requires output.weight): drop --tied")
        dense, exp_t = dense_types(qtype, expert_qtype, expert_types=("mxfp4",))
        E, D, F, V = self.n_embd, self.n_expert, self.n_ff_exp, n_vocab
        H, Hkv, hd = self.n_head, self.n_head_kv, self.head_dim
        plans: list[TensorPlan] = []
        add = plan_adder(plans, dense, exp_t)

        add("token_embd.weight", (V, E), "embd", 1.0)
        router_std = (ROUTER_NEAR_TIE_SCALE if router_near_tie else 1.0) / np.sqrt(E)
        for i in range(self.n_layer):
            p = f"blk.{i}."
            add(p + "attn_norm.weight", (E,), "norm", NORM_NOISE)
            add(p + "attn_q.weight", (H * hd, E), "matrix", 1 / np.sqrt(E))
            add(p + "attn_q.bias", (H * hd,), "vector", BIAS_STD)
            add(p + "attn_k.weight", (Hkv * hd, E), "matrix", 1 / np.sqrt(E))
            add(p + "attn_k.bias", (Hkv * hd,), "vector", BIAS_STD)
            add(p + "attn_v.weight", (Hkv * hd, E), "matrix", 1 / np.sqrt(E))
            add(p + "attn_v.bias", (Hkv * hd,), "vector", BIAS_STD)
            add(p + "attn_output.weight", (E, H * hd), "matrix", 1 / np.sqrt(H * hd))
            add(p + "attn_output.bias", (E,), "vector", BIAS_STD)
            add(p + "attn_sinks.weight", (H,), "vector", SINK_STD)
            add(p + "post_attention_norm.weight", (E,), "norm", NORM_NOISE)
            add(p + "ffn_gate_inp.weight", (D, E), "router", router_std)
            add(p + "ffn_gate_inp.bias", (D,), "vector", ROUTER_BIAS_STD * router_std * np.sqrt(E))
            add(p + "ffn_gate_exps.weight", (D, F, E), "experts", 1 / np.sqrt(E))
            add(p + "ffn_gate_exps.bias", (D, F), "vector", BIAS_STD)
            add(p + "ffn_up_exps.weight", (D, F, E), "experts", 1 / np.sqrt(E))
            add(p + "ffn_up_exps.bias", (D, F), "vector", BIAS_STD)
            add(p + "ffn_down_exps.weight", (D, E, F), "experts", 1 / np.sqrt(F))
            add(p + "ffn_down_exps.bias", (D, E), "vector", BIAS_STD)
        add_output_head(add, E, V, tied)  # tied is refused above
        return plans


PRESETS_GPTOSS: dict[str, GptOssPreset] = {
    # Makes in about a second. The window is 8 positions so a 32-token test really slides;
    # YaRN's factor and original context as the real model's.
    "tiny": GptOssPreset(n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_layer=4, n_expert=16,
                         n_expert_used=4, n_ff_exp=256, context_length=512, rope_freq_base=150000.0,
                         rms_eps=1e-5, sliding_window=8, rope_original_context=64),
    # gpt-oss-120b as its GGUF says (llama.cpp's loader, LLM_TYPE_120B at 36 layers): n_embd 2880,
    # 64 heads of 64 (q 4096 wide, wider than n_embd), 8 KV heads, 128 experts top-4 of ff 2880,
    # MXFP4 experts, window 128 on the even layers, YaRN x32 over 4096 positions, base 150000.
    "geometry-gpt-oss-120b": GptOssPreset(
        n_embd=2880, n_head=64, n_head_kv=8, head_dim=64, n_layer=36, n_expert=128, n_expert_used=4,
        n_ff_exp=2880, context_length=131072, rope_freq_base=150000.0, rms_eps=1e-5,
        expert_qtype="mxfp4", sliding_window=128),
}
