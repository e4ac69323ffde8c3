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

import numpy as np

from p2pswarm.errors import UserError
from p2pswarm.model.synth_presets import LOGIT_STD, NORM_NOISE, ROUTER_NEAR_TIE_SCALE, Glm4Preset, _gguf
from p2pswarm.model.synth_tensors import TensorPlan, plan_adder

def plan_glm4(dims: Glm4Preset, n_vocab: int, qtype: str, expert_qtype: str | None, tied: bool,
              router_near_tie: bool) -> list[TensorPlan]:
    """The tensors of a glm4moe model, in file order (llama.cpp's names and shapes)."""
    Q = _gguf().GGMLQuantizationType
    dense = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0, "q4_k_m": Q.F32}[qtype]
    exp_t = Q.Q4_K if expert_qtype == "q4_k" else dense
    E, D, F, V = dims.n_embd, dims.n_expert, dims.n_ff_exp, n_vocab
    H, Hkv, hd, Fd, Fs = dims.n_head, dims.n_head_kv, dims.head_dim, dims.n_ff, dims.n_ff_exp * dims.n_expert_shared
    plans: list[TensorPlan] = []

    add = plan_adder(plans, dense, exp_t)

    add("token_embd.weight", (V, E), "embd", LOGIT_STD / np.sqrt(E) if tied else 1.0)
    router_std = (ROUTER_NEAR_TIE_SCALE if router_near_tie else 1.0) / np.sqrt(E)
    for i in range(dims.n_layer + dims.n_nextn):
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
        if i < dims.n_dense:
            add(p + "ffn_gate.weight", (Fd, E), "matrix", 1 / np.sqrt(E))
            add(p + "ffn_up.weight", (Fd, E), "matrix", 1 / np.sqrt(E))
            add(p + "ffn_down.weight", (E, Fd), "matrix", 1 / np.sqrt(Fd))
        else:
            add(p + "ffn_gate_inp.weight", (D, E), "router", router_std)
            add(p + "exp_probs_b.bias", (D,), "vector", dims.bias_std)
            add(p + "ffn_gate_exps.weight", (D, F, E), "experts", 1 / np.sqrt(E))
            add(p + "ffn_up_exps.weight", (D, F, E), "experts", 1 / np.sqrt(E))
            add(p + "ffn_down_exps.weight", (D, E, F), "experts", 1 / np.sqrt(F))
            if Fs:
                add(p + "ffn_gate_shexp.weight", (Fs, E), "matrix", 1 / np.sqrt(E))
                add(p + "ffn_up_shexp.weight", (Fs, E), "matrix", 1 / np.sqrt(E))
                add(p + "ffn_down_shexp.weight", (E, Fs), "matrix", 1 / np.sqrt(Fs))
        if i >= dims.n_layer:  # a NextN / MTP block: what llama.cpp's MTP graph reads besides the block
            add(p + "nextn.eh_proj.weight", (E, 2 * E), "matrix", 1 / np.sqrt(2 * E))
            add(p + "nextn.enorm.weight", (E,), "norm", NORM_NOISE)
            add(p + "nextn.hnorm.weight", (E,), "norm", NORM_NOISE)
            add(p + "nextn.shared_head_norm.weight", (E,), "norm", NORM_NOISE)
    add("output_norm.weight", (E,), "norm", NORM_NOISE)
    if not tied:
        add("output.weight", (V, E), "matrix", LOGIT_STD / np.sqrt(E))
    return plans


# qwen35moe's DeltaNet layers write through ssm_out (the same construction serves both architectures)
RESIDUAL_WRITERS = ("attn_output.weight", "ssm_out.weight", "ffn_down.weight", "ffn_down_exps.weight",
                    "ffn_down_shexp.weight")


def agreeing_mtp(plans: list[TensorPlan], agreement: float) -> list[TensorPlan]:
    """``make-model --mtp-agreement A``: a model whose MTP block predicts what the trunk will.

    The construction: every block's writes into the residual stream (attention output, dense,
    routed and shared expert down projections) are scaled by ``1 - A``, and the MTP block's
    ``eh_proj`` is ``[I, 0]``. At ``A = 1`` the trunk's hidden state at a position is its token's
    embedding, so its next token is a fixed function ``f`` of the current token (the output head of
    the normed embedding), and the block, fed ``embed(t_{p+1})``, computes the same head of the
    same normed embedding (up to the norms' weight noise): it predicts ``f(t_{p+1})``, the trunk's
    next token. Below 1 the blocks' own contributions make the two differ more and more often;
    the acceptance it gives is measured, not promised (docs/benchmarks.md)."""
    out = []
    for t in plans:
        if t.name.endswith(RESIDUAL_WRITERS):
            t = dataclasses.replace(t, std=t.std * (1.0 - agreement))
        elif t.name.endswith("nextn.eh_proj.weight"):
            t = dataclasses.replace(t, kind="eye_left")
        out.append(t)
    return out


def write_glm4_keys(w, dims: Glm4Preset) -> None:
    """The glm4moe keys beyond those every synthetic model has (``w``: a gguf.GGUFWriter)."""
    w.add_rope_dimension_count(dims.n_rot)
    w.add_leading_dense_block_count(dims.n_dense)
    w.add_expert_shared_count(dims.n_expert_shared)
    w.add_expert_weights_scale(dims.weights_scale)
    w.add_expert_weights_norm(True)
    w.add_expert_gating_func(_gguf().ExpertGatingFuncType.SIGMOID)
    w.add_nextn_predict_layers(dims.n_nextn)


def validate_glm4(p: Glm4Preset, qtype: str) -> None:
    """The glm4moe-only constraints, each a one-line UserError."""
    for name in ("n_rot", "n_ff"):
        v = getattr(p, name)
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise UserError(f"{name} must be a positive integer, got {v!r}")
    for name in ("n_dense", "n_expert_shared", "n_nextn"):
        v = getattr(p, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise UserError(f"{name} must be a non-negative integer, got {v!r}")
    if p.n_rot % 2 or p.n_rot > p.head_dim:
        raise UserError(f"n_rot ({p.n_rot}) must be even and at most head_dim ({p.head_dim})")
    if qtype in ("q8_0", "q4_k_m"):
        for name, v in (("n_ff", p.n_ff), ("n_head * head_dim", p.n_head * p.head_dim)):
            if v % 32:
                raise UserError(f"{name} ({v}) must be a multiple of 32 for this type")
