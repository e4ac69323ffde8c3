"""The shapes :mod:`p2pswarm.model.synth` can write: presets for both architectures, the option
checks (each a one-line :class:`~p2pswarm.errors.UserError`) and the file-type key.

Split from ``synth.py`` so that adding a preset or a constraint touches only this file.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from p2pswarm.errors import UserError


def _gguf():
    import gguf  # import cost only when a model is made

    return gguf


ARCH = "qwen3moe"
ARCHES = ("qwen3moe", "qwen35moe", "gpt-oss", "glm4moe")
SYNTH_VERSION = 1  # bump when the bytes a given set of options produces change

#: ``progress(done_bytes, total_bytes, what)``; called after every tensor and between chunks.
Progress = Callable[[int, int, str], None]

QTYPES = ("f32", "f16", "bf16", "q8_0", "q4_k_m")
EXPERT_QTYPES = ("q4_k", "mxfp4")

ROUTER_NEAR_TIE_SCALE = 0.01
NORM_NOISE = 0.02
LOGIT_STD = 2.0

@dataclasses.dataclass(frozen=True)
class Preset:
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_layer: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    context_length: int
    rope_freq_base: float = 1_000_000.0
    rms_eps: float = 1e-6
    expert_qtype: str | None = None  # None: the experts follow ``qtype``


PRESETS: dict[str, Preset] = {
    # Makes in about a second; every dim a multiple of 256 so K-quants apply.
    "tiny": Preset(n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_layer=4, n_expert=16,
                   n_expert_used=4, n_ff_exp=256, context_length=512),
    # The routed-expert geometry of Qwen3.5-122B-A10B; attention is plain qwen3moe attention.
    "geometry-122b": Preset(n_embd=3072, n_head=32, n_head_kv=2, head_dim=128, n_layer=2,
                            n_expert=256, n_expert_used=8, n_ff_exp=1024, context_length=4096,
                            expert_qtype="q4_k"),
}



@dataclasses.dataclass(frozen=True)
class Qwen35Preset(Preset):
    """A qwen35moe shape: the qwen3moe fields plus partial IMROPE, the DeltaNet and the shared expert."""

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



@dataclasses.dataclass(frozen=True)
class Glm4Preset(Preset):
    """A glm4moe shape (GLM-4.5): the qwen3moe fields plus partial NEOX RoPE, attention biases,
    leading dense FFN layers, a shared expert, the sigmoid router's scale and the NextN blocks.

    ``n_layer`` counts the trunk layers; ``n_nextn`` NextN/MTP blocks are written after them
    (block_count = n_layer + n_nextn). At most ``n_layer - 1`` of the trunk layers are dense, so a
    preset cut short with ``--layers`` keeps at least one layer with routed experts."""

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

PRESETS_BY_ARCH: dict[str, dict[str, Preset]] = {"qwen3moe": PRESETS, "qwen35moe": PRESETS_QWEN35,
                                                 "glm4moe": PRESETS_GLM4}
# gpt-oss's presets (p2pswarm.model.synth_gptoss) are added by p2pswarm.model.synth, which imports both

# make_model keywords that only a qwen35moe shape has.
QWEN35_OPTIONS = ("n_rot", "rope_sections", "ssm_state_size", "ssm_group_count", "ssm_time_step_rank",
                  "ssm_conv_kernel", "full_attention_interval", "n_ff_shexp", "fused_experts", "n_nextn")

def _resolve(preset: str, layers: int | None, overrides: dict[str, Any],
             presets: dict[str, Preset] = PRESETS) -> Preset:
    if preset not in presets:
        raise UserError(f"unknown preset {preset!r}; choose one of: {', '.join(presets)}")
    p = presets[preset]
    if layers is not None:
        overrides = {**overrides, "n_layer": layers}
    overrides = {k: v for k, v in overrides.items() if v is not None}
    return dataclasses.replace(p, **overrides)


def _validate(p: Preset, qtype: str, expert_qtype: str | None) -> None:
    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise UserError(msg)

    need(qtype in QTYPES, f"unknown type {qtype!r}; choose one of: {', '.join(QTYPES)}")
    need(expert_qtype in (None, *EXPERT_QTYPES),
         f"unknown expert type {expert_qtype!r}; choose one of: {', '.join(EXPERT_QTYPES)}")
    for name in ("n_embd", "n_head", "n_head_kv", "head_dim", "n_layer", "n_expert",
                 "n_expert_used", "n_ff_exp", "context_length"):
        v = getattr(p, name)
        need(isinstance(v, int) and not isinstance(v, bool) and v > 0,
             f"{name.replace('n_layer', 'layers')} must be a positive integer, got {v!r}")
    need(p.n_layer <= 512, f"layers must be at most 512, got {p.n_layer}")
    need(p.n_expert <= 1024, f"n_expert must be at most 1024 (llama.cpp's limit), got {p.n_expert}")
    need(p.n_expert_used <= p.n_expert,
         f"n_expert_used ({p.n_expert_used}) must not exceed n_expert ({p.n_expert})")
    need(p.n_head % p.n_head_kv == 0,
         f"n_head ({p.n_head}) must be a multiple of n_head_kv ({p.n_head_kv})")
    need(p.head_dim % 2 == 0, f"head_dim must be even (RoPE), got {p.head_dim}")
    block = 32
    if qtype == "q4_k_m" or expert_qtype == "q4_k":
        block = 256
    elif expert_qtype == "mxfp4" and qtype in ("f32", "f16", "bf16"):
        block = 32
    elif qtype in ("f32", "f16", "bf16"):
        block = 1
    for name in ("n_embd", "n_ff_exp"):
        v = getattr(p, name)
        need(v % block == 0, f"{name} ({v}) must be a multiple of {block} for this type")
    if qtype == "q4_k_m":
        need(expert_qtype is None,
             "--type q4_k_m quantises every tensor with llama.cpp; it cannot be combined with "
             "directly written Q4_K experts (use --type f32, f16 or q8_0 for the dense tensors)")


def _validate_qwen35(p: Qwen35Preset, qtype: str) -> None:
    """The qwen35moe-only constraints, each a one-line UserError (llama.cpp would abort on most)."""
    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise UserError(msg)

    for name in ("n_rot", "ssm_state_size", "ssm_group_count", "ssm_time_step_rank", "ssm_conv_kernel",
                 "full_attention_interval", "n_ff_shexp"):
        v = getattr(p, name)
        need(isinstance(v, int) and not isinstance(v, bool) and v > 0,
             f"{name} must be a positive integer, got {v!r}")
    need(p.n_nextn in (0, 1) and not isinstance(p.n_nextn, bool),
         f"--mtp-blocks (n_nextn) must be 0 or 1 (llama.cpp runs one qwen35moe MTP block), got {p.n_nextn!r}")
    need(p.n_rot % 2 == 0 and p.n_rot <= p.head_dim,
         f"n_rot ({p.n_rot}) must be even and at most head_dim ({p.head_dim})")
    sec = p.rope_sections
    need(isinstance(sec, tuple) and len(sec) == 4
         and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in sec) and sum(sec) > 0,
         f"rope sections must be 4 non-negative integers with a positive sum, got {sec!r}")
    need(p.ssm_time_step_rank % p.ssm_group_count == 0,
         f"ssm_time_step_rank (Hv {p.ssm_time_step_rank}) must be a multiple of ssm_group_count "
         f"(Hk {p.ssm_group_count})")
    need(p.ssm_conv_kernel >= 2, f"ssm_conv_kernel must be at least 2, got {p.ssm_conv_kernel}")
    need(p.ssm_conv_kernel <= 16, f"ssm_conv_kernel must be at most 16, got {p.ssm_conv_kernel}")
    if qtype in ("q8_0", "q4_k_m"):
        for name, v in (("n_ff_shexp", p.n_ff_shexp), ("n_head * head_dim", p.n_head * p.head_dim),
                        ("ssm_time_step_rank * ssm_state_size", p.ssm_time_step_rank * p.ssm_state_size)):
            need(v % 32 == 0, f"{name} ({v}) must be a multiple of 32 for this type")


def _file_type(qtype: str, expert_qtype: str | None) -> int:
    g = _gguf()
    F = g.LlamaFileType
    if expert_qtype == "q4_k":
        return int(F.MOSTLY_Q4_K_M)
    if expert_qtype == "mxfp4":
        return int(F.MOSTLY_MXFP4_MOE)  # by bytes the file is almost all Q4_K experts
    return int({"f32": F.ALL_F32, "f16": F.MOSTLY_F16, "bf16": F.MOSTLY_BF16, "q8_0": F.MOSTLY_Q8_0,
                "q4_k_m": F.ALL_F32}[qtype])


# deepseek2's shapes live in their own module, which imports from this one: registered last.
from p2pswarm.model.synth_deepseek2 import PRESETS_DEEPSEEK2

ARCHES = (*ARCHES, "deepseek2")
PRESETS_BY_ARCH["deepseek2"] = PRESETS_DEEPSEEK2
