"""The qwen35moe (Qwen3.5 MoE) part of ``make-model``: its presets, its GGUF keys, its option checks
and its tensor plan (Gated DeltaNet layers with every ``full_attention_interval``-th layer gated full
attention, a sigmoid-gated shared expert, optionally fused gate/up experts and an MTP block; the
weights beyond the common rule are listed in :mod:`p2pswarm.model.synth`)."""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import numpy as np

from p2pswarm.errors import UserError
from p2pswarm.model.synth_presets import LOGIT_STD, NORM_NOISE, ROUTER_NEAR_TIE_SCALE, Preset, _gguf, dense_types
from p2pswarm.model.synth_tensors import TensorPlan, _type_size, add_mtp_extras, add_output_head


@dataclasses.dataclass(frozen=True)
class Qwen35Preset(Preset):
    """A qwen35moe shape: the qwen3moe fields plus partial IMROPE, the DeltaNet and the shared expert."""

    MTP: ClassVar[bool] = True
    DESCRIPTION: ClassVar[str] = "Qwen3.5 MoE: Gated DeltaNet + gated attention + shared expert, the seed's own model"

    n_rot: int = 16  # rotated dims per head (Qwen3.5: head_dim / 4)
    rope_sections: tuple[int, ...] = (3, 3, 2, 0)  # IMROPE (t, h, w, e) sections, in pairs
    ssm_state_size: int = 32  # d: DeltaNet head size (k and v)
    ssm_group_count: int = 2  # Hk: q/k heads
    ssm_time_step_rank: int = 4  # Hv: v heads (a multiple of Hk)
    ssm_conv_kernel: int = 4
    full_attention_interval: int = 4  # every 4th layer is full attention, the others DeltaNet
    n_ff_shexp: int = 256  # shared expert's hidden size
    fused_experts: bool = False  # one ffn_gate_up_exps tensor instead of ffn_gate_exps + ffn_up_exps
    n_nextn: int = 0  # MTP (NextN) blocks after the trunk (nextn_predict_layers; llama.cpp runs 1)

    KEYWORDS: ClassVar[tuple[str, ...]] = (
        "n_rot", "rope_sections", "ssm_state_size", "ssm_group_count", "ssm_time_step_rank", "ssm_conv_kernel",
        "full_attention_interval", "n_ff_shexp", "fused_experts", "n_nextn")

    def mtp_blocks(self) -> int:
        return self.n_nextn

    def write_keys(self, w: Any) -> None:
        """The ``qwen35moe.*`` keys (``w``: a gguf.GGUFWriter)."""
        self.write_trunk_keys(w, self.n_ff_exp * self.n_expert_used)
        w.add_expert_shared_feed_forward_length(self.n_ff_shexp)
        w.add_rope_dimension_count(self.n_rot)
        w.add_rope_dimension_sections(list(self.rope_sections))
        w.add_ssm_conv_kernel(self.ssm_conv_kernel)
        w.add_ssm_inner_size(self.ssm_time_step_rank * self.ssm_state_size)
        w.add_ssm_state_size(self.ssm_state_size)
        w.add_ssm_time_step_rank(self.ssm_time_step_rank)
        w.add_ssm_group_count(self.ssm_group_count)
        w.add_full_attention_interval(self.full_attention_interval)
        if self.n_nextn:
            w.add_nextn_predict_layers(self.n_nextn)

    def write_synth_keys(self, w: Any) -> None:
        w.add_bool("p2pswarm.synth.fused_experts", self.fused_experts)

    def validate(self, qtype: str, expert_qtype: str | None) -> None:
        """The qwen35moe-only constraints, each a one-line UserError (llama.cpp would abort on most)."""
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise UserError(msg)

        for name in ("n_rot", "ssm_state_size", "ssm_group_count", "ssm_time_step_rank", "ssm_conv_kernel",
                     "full_attention_interval", "n_ff_shexp"):
            v = getattr(self, name)
            need(isinstance(v, int) and not isinstance(v, bool) and v > 0,
                 f"{name} must be a positive integer, got {v!r}")
        need(self.n_nextn in (0, 1) and not isinstance(self.n_nextn, bool),
             f"--mtp-blocks (n_nextn) must be 0 or 1 (llama.cpp runs one qwen35moe MTP block), got {self.n_nextn!r}")
        need(self.n_rot % 2 == 0 and self.n_rot <= self.head_dim,
             f"n_rot ({self.n_rot}) must be even and at most head_dim ({self.head_dim})")
        sec = self.rope_sections
        need(isinstance(sec, tuple) and len(sec) == 4
             and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in sec) and sum(sec) > 0,
             f"rope sections must be 4 non-negative integers with a positive sum, got {sec!r}")
        need(self.ssm_time_step_rank % self.ssm_group_count == 0,
             f"ssm_time_step_rank (Hv {self.ssm_time_step_rank}) must be a multiple of ssm_group_count "
             f"(Hk {self.ssm_group_count})")
        need(self.ssm_conv_kernel >= 2, f"ssm_conv_kernel must be at least 2, got {self.ssm_conv_kernel}")
        need(self.ssm_conv_kernel <= 16, f"ssm_conv_kernel must be at most 16, got {self.ssm_conv_kernel}")
        if qtype in ("q8_0", "q4_k_m"):
            for name, v in (("n_ff_shexp", self.n_ff_shexp), ("n_head * head_dim", self.n_head * self.head_dim),
                            ("ssm_time_step_rank * ssm_state_size", self.ssm_time_step_rank * self.ssm_state_size)):
                need(v % 32 == 0, f"{name} ({v}) must be a multiple of 32 for this type")

    def plan(self, n_vocab: int, qtype: str, expert_qtype: str | None, tied: bool,
             router_near_tie: bool) -> list[TensorPlan]:
        """The tensors of a qwen35moe model, in file order (llama.cpp's names and shapes)."""
        Q = _gguf().GGMLQuantizationType
        dense, exp_t = dense_types(qtype, expert_qtype)
        E, D, F, V = self.n_embd, self.n_expert, self.n_ff_exp, n_vocab
        H, Hkv, hd = self.n_head, self.n_head_kv, self.head_dim
        d, Hk, Hv, K = self.ssm_state_size, self.ssm_group_count, self.ssm_time_step_rank, self.ssm_conv_kernel
        C = 2 * Hk * d + Hv * d
        plans: list[TensorPlan] = []

        def plan(name: str, shape: tuple[int, ...], kind: str, std: float) -> TensorPlan:
            if kind in ("norm", "router", "vector", "conv", "ssm_a"):
                t = Q.F32  # llama.cpp keeps these F32 (its quantiser too)
            elif kind == "experts":
                t = exp_t
            else:
                t = dense
            return TensorPlan(name, shape, kind, std, t, _type_size(t, shape))

        def add(name: str, shape: tuple[int, ...], kind: str, std: float) -> None:
            plans.append(plan(name, shape, kind, std))

        add("token_embd.weight", (V, E), "embd", LOGIT_STD / np.sqrt(E) if tied else 1.0)
        router_std = (ROUTER_NEAR_TIE_SCALE if router_near_tie else 1.0) / np.sqrt(E)
        for i in range(self.n_layer + self.n_nextn):
            p = f"blk.{i}."
            add(p + "attn_norm.weight", (E,), "norm", NORM_NOISE)
            # an MTP block (i >= n_layer) is gated full attention whatever the interval says: llama.cpp's
            # loader marks only trunk layers recurrent (``is_recr_impl[i] = i < n_layer() && ...``)
            if i < self.n_layer and (i + 1) % self.full_attention_interval != 0:  # Gated DeltaNet
                add(p + "attn_qkv.weight", (C, E), "matrix", 1 / np.sqrt(E))
                add(p + "attn_gate.weight", (Hv * d, E), "matrix", 1 / np.sqrt(E))
                add(p + "ssm_conv1d.weight", (C, K), "conv", 1 / np.sqrt(K))
                add(p + "ssm_dt.bias", (Hv,), "vector", 0.5)
                add(p + "ssm_a", (Hv,), "ssm_a", 0.0)
                add(p + "ssm_beta.weight", (Hv, E), "matrix", 1 / np.sqrt(E))
                add(p + "ssm_alpha.weight", (Hv, E), "matrix", 1 / np.sqrt(E))
                add(p + "ssm_norm.weight", (d,), "norm", NORM_NOISE)
                add(p + "ssm_out.weight", (E, Hv * d), "matrix", 1 / np.sqrt(Hv * d))
            else:  # gated full attention: attn_q holds q and its gate, interleaved head by head
                add(p + "attn_q.weight", (2 * H * hd, E), "matrix", 1 / np.sqrt(E))
                add(p + "attn_k.weight", (Hkv * hd, E), "matrix", 1 / np.sqrt(E))
                add(p + "attn_v.weight", (Hkv * hd, E), "matrix", 1 / np.sqrt(E))
                add(p + "attn_output.weight", (E, H * hd), "matrix", 1 / np.sqrt(H * hd))
                add(p + "attn_q_norm.weight", (hd,), "norm", NORM_NOISE)
                add(p + "attn_k_norm.weight", (hd,), "norm", NORM_NOISE)
            add(p + "post_attention_norm.weight", (E,), "norm", NORM_NOISE)
            add(p + "ffn_gate_inp.weight", (D, E), "router", router_std)
            gate = plan(p + "ffn_gate_exps.weight", (D, F, E), "experts", 1 / np.sqrt(E))
            up = plan(p + "ffn_up_exps.weight", (D, F, E), "experts", 1 / np.sqrt(E))
            if self.fused_experts:
                plans.append(TensorPlan(p + "ffn_gate_up_exps.weight", (D, 2 * F, E), "experts", gate.std,
                                        gate.gtype, gate.nbytes + up.nbytes, parts=(gate, up)))
            else:
                plans += [gate, up]
            add(p + "ffn_down_exps.weight", (D, E, F), "experts", 1 / np.sqrt(F))
            Fs = self.n_ff_shexp
            add(p + "ffn_gate_inp_shexp.weight", (E,), "vector", 1 / np.sqrt(E))
            add(p + "ffn_gate_shexp.weight", (Fs, E), "matrix", 1 / np.sqrt(E))
            add(p + "ffn_up_shexp.weight", (Fs, E), "matrix", 1 / np.sqrt(E))
            add(p + "ffn_down_shexp.weight", (E, Fs), "matrix", 1 / np.sqrt(Fs))
            if i >= self.n_layer:  # the NextN / MTP block: what llama.cpp's qwen35moe MTP graph reads besides it
                add_mtp_extras(add, p, E)
        add_output_head(add, E, V, tied)
        return plans


PRESETS_QWEN35: dict[str, Qwen35Preset] = {
    # Makes in about a second: 3 DeltaNet layers + 1 full-attention layer, Hk 2 != Hv 4 like the
    # real model (16 != 64), sections covering all 8 rotary pairs like the real [11, 11, 10, 0].
    "tiny": Qwen35Preset(n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_layer=4, n_expert=16,
                         n_expert_used=4, n_ff_exp=256, context_length=512,
                         rope_freq_base=10_000_000.0),
    # Qwen3.5-122B-A10B's geometry, every part of a layer: experts (3072, 256 top-8, 1024, Q4_K),
    # shared expert 1024, gated attention 32/2 heads of 256 with 64 rotary dims, DeltaNet 16 q/k
    # and 64 v heads of 128, conv 4. Two layers: one DeltaNet, one full attention.
    "geometry-122b": Qwen35Preset(n_embd=3072, n_head=32, n_head_kv=2, head_dim=256, n_layer=2,
                                  n_expert=256, n_expert_used=8, n_ff_exp=1024, context_length=4096,
                                  rope_freq_base=10_000_000.0, expert_qtype="q4_k", n_rot=64,
                                  rope_sections=(11, 11, 10, 0), ssm_state_size=128,
                                  ssm_group_count=16, ssm_time_step_rank=64, full_attention_interval=2,
                                  n_ff_shexp=1024),
}
