"""Seeded random-weight ``deepseek2`` GGUFs (DeepSeek-V2/V3/R1, Kimi K2): the shapes, the tensor
plan and the hyper-parameter keys, as llama.cpp's converter writes them (``conversion/deepseek.py``)
and its loader reads them (``src/models/deepseek2.cpp``).

What a deepseek2 layer holds (numpy shapes, ``(out, in)``)::

    attn_norm (E)
    attn_q_a (Rq, E), attn_q_a_norm (Rq), attn_q_b (H*(nope+rope), Rq)   or plain attn_q (H*(nope+rope), E)
    attn_kv_a_mqa (Rkv+rope, E), attn_kv_a_norm (Rkv)
    attn_k_b (H, Rkv, nope) + attn_v_b (H, v, Rkv)   (``mla_split``, what newer GGUFs carry)
                                                   or attn_kv_b (H*(nope+v), Rkv) (older GGUFs)
    attn_output (E, H*v), ffn_norm (E)
    the first ``n_dense_lead`` layers: ffn_gate/up (Fd, E), ffn_down (E, Fd)
    the others: ffn_gate_inp (D, E), exp_probs_b (D) [sigmoid], ffn_{gate,up,down}_exps, and the
    shared expert ffn_{gate,up}_shexp (S*F, E), ffn_down_shexp (E, S*F)
    the ``n_nextn`` MTP (NextN) blocks after the trunk (DeepSeek-V3/R1 carry one): a full MoE layer
    as above plus nextn.eh_proj (E, 2E), nextn.enorm, nextn.hnorm, nextn.shared_head_norm (E);
    block_count counts them, nextn_predict_layers says how many

The split form holds *exactly* the weights of the unsplit one (``attn_k_b`` is the transposed k part
of the same ``attn_kv_b``, ``attn_v_b`` its v part), so the two forms of one seed compute the same
function. Scaling follows :mod:`p2pswarm.model.synth` (std ``1/sqrt(in)``); the selection bias
``exp_probs_b`` is ``N(0, 0.1)`` (enough to change some top-k choices).

``--layers N`` on a preset keeps ``min(n_dense_lead, N - 1)`` dense layers, so a 2-layer
geometry-671b model has one dense layer and one MoE layer at the real sizes.
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import numpy as np

from p2pswarm.errors import UserError
from p2pswarm.model.synth_presets import LOGIT_STD, NORM_NOISE, ROUTER_NEAR_TIE_SCALE, Preset, _gguf, dense_types
from p2pswarm.model.synth_tensors import TensorPlan, _type_size, add_mtp_extras, add_output_head, plan_adder

ARCH = "deepseek2"
GATING = {"softmax": 1, "sigmoid": 2}  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_*
EXP_PROBS_B_STD = 0.1


@dataclasses.dataclass(frozen=True)
class DeepSeek2Preset(Preset):
    """A deepseek2 shape. ``n_head_kv``/``head_dim`` of :class:`Preset` are n_head and nope+rope."""

    MTP: ClassVar[bool] = True
    DESCRIPTION: ClassVar[str] = ("DeepSeek-V3/R1, Kimi K2: Multi-head Latent Attention, leading dense layers, "
                                  "group-limited routing, shared expert")

    q_lora_rank: int = 0  # 0: plain attn_q (DeepSeek-V2-Lite)
    kv_lora_rank: int = 64
    qk_rope: int = 32
    qk_nope: int = 64
    v_head_dim: int = 64
    n_dense_lead: int = 1
    n_ff_dense: int = 512
    n_expert_shared: int = 1
    gating: str = "sigmoid"
    n_group: int = 0
    n_group_used: int = 0
    weights_scale: float = 1.0
    weights_norm: bool = True
    exp_probs_b: bool = True
    yarn_factor: float = 0.0  # 0: no rope scaling
    yarn_orig_ctx: int = 4096
    yarn_mscale_all_dim: float = 1.0
    mla_split: bool = True  # attn_k_b + attn_v_b (newer GGUFs) instead of attn_kv_b
    rope_freq_base: float = 10000.0
    n_nextn: int = 0  # MTP (NextN) blocks after the trunk (nextn_predict_layers; llama.cpp runs 1)

    KEYWORDS: ClassVar[tuple[str, ...]] = ("options", "n_nextn")  # options: the dict of OPTIONS
    # the dense tensors quantised by llama.cpp from F32 and the Q4_K experts (45 GB per layer as F32 at
    # geometry-671b) kept, or requantised to Q6_K where Q4_K_M puts them (ffn_down of some layers)
    Q4_K_M_KEEPS_Q4_K: ClassVar[bool] = True

    def mtp_blocks(self) -> int:
        return self.n_nextn

    def refine(self, layers: int | None, keywords: dict[str, Any], options: dict[str, Any]) -> DeepSeek2Preset:
        """The preset with ``--layers`` (keeping at least one MoE layer) and the options applied
        (``n_nextn``, the one keyword, is one of them)."""
        options = {**options, **keywords}
        bad = sorted(set(options) - set(OPTIONS) - {"n_layer"})
        if bad:
            raise UserError(f"unknown deepseek2 option {bad[0]!r}; known: {', '.join(OPTIONS)}")
        if layers is not None:
            options = {"n_layer": layers, "n_dense_lead": min(self.n_dense_lead, max(0, layers - 1)), **options}
        p = dataclasses.replace(self, **options)
        return dataclasses.replace(p, n_head_kv=p.n_head, head_dim=p.qk_nope + p.qk_rope)

    def validate(self, qtype: str, expert_qtype: str | None) -> None:
        """The deepseek2-only constraints, each a one-line UserError (llama.cpp would abort on most)."""
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise UserError(msg)

        for name in ("kv_lora_rank", "qk_rope", "qk_nope", "v_head_dim", "n_ff_dense", "yarn_orig_ctx"):
            v = getattr(self, name)
            need(isinstance(v, int) and not isinstance(v, bool) and v > 0, f"{name} must be a positive integer, got {v!r}")
        for name in ("q_lora_rank", "n_dense_lead", "n_expert_shared", "n_group", "n_group_used", "n_nextn"):
            v = getattr(self, name)
            need(isinstance(v, int) and not isinstance(v, bool) and v >= 0, f"{name} must be a non-negative integer, got {v!r}")
        need(self.qk_rope % 2 == 0, f"qk_rope ({self.qk_rope}) must be even (RoPE pairs)")
        need(self.n_dense_lead < self.n_layer, f"n_dense_lead ({self.n_dense_lead}) must leave at least one MoE layer "
                                         f"of {self.n_layer}")
        need(self.n_nextn in (0, 1), f"--mtp-blocks (n_nextn) must be 0 or 1 (llama.cpp runs one deepseek2 MTP block), "
                                  f"got {self.n_nextn!r}")
        need(not self.n_nextn or (self.q_lora_rank > 0 and self.mla_split and self.n_expert_shared > 0),
             "an MTP block needs q_lora_rank > 0, the split MLA tensors and a shared expert (llama.cpp's deepseek2 "
             "MTP graph requires them)")
        need(self.gating in GATING, f"gating must be one of {', '.join(GATING)}, got {self.gating!r}")
        if self.n_group > 1:
            need(self.n_expert % self.n_group == 0, f"n_expert ({self.n_expert}) must be a multiple of n_group ({self.n_group})")
            need(0 < self.n_group_used < self.n_group, f"n_group_used ({self.n_group_used}) must be in 1..{self.n_group - 1}")
            need(self.n_expert // self.n_group >= 2, "each expert group needs at least 2 experts (llama.cpp sums the top 2)")
            need(self.n_group_used * (self.n_expert // self.n_group) >= self.n_expert_used,
                 f"n_group_used groups hold fewer than n_expert_used ({self.n_expert_used}) experts")
        need(self.yarn_factor == 0 or self.yarn_factor >= 1, f"yarn_factor must be 0 (none) or >= 1, got {self.yarn_factor}")
        if qtype in ("q8_0", "q4_k_m"):
            for name, v in (("n_ff_dense", self.n_ff_dense), ("kv_lora_rank", self.kv_lora_rank),
                            ("q_lora_rank", self.q_lora_rank), ("qk_nope", self.qk_nope), ("v_head_dim", self.v_head_dim)):
                need(v % 32 == 0, f"{name} ({v}) must be a multiple of 32 for this type")

    def write_keys(self, w: Any) -> None:
        """The ``deepseek2.*`` keys llama.cpp reads, as its converter writes them (the split MLA form
        also writes the MQA view of the cache: key_length kv_lora+rope, value_length kv_lora, 1 kv head)."""
        w.add_context_length(self.context_length)
        w.add_embedding_length(self.n_embd)
        w.add_block_count(self.n_layer + self.n_nextn)
        if self.n_nextn:
            w.add_nextn_predict_layers(self.n_nextn)
        w.add_feed_forward_length(self.n_ff_dense)
        w.add_head_count(self.n_head)
        w.add_layer_norm_rms_eps(self.rms_eps)
        w.add_rope_freq_base(self.rope_freq_base)
        w.add_rope_dimension_count(self.qk_rope)
        w.add_leading_dense_block_count(self.n_dense_lead)
        w.add_q_lora_rank(self.q_lora_rank)
        w.add_kv_lora_rank(self.kv_lora_rank)
        if self.mla_split:
            w.add_head_count_kv(1)
            w.add_key_length(self.kv_lora_rank + self.qk_rope)
            w.add_value_length(self.kv_lora_rank)
            w.add_key_length_mla(self.qk_nope + self.qk_rope)
            w.add_value_length_mla(self.v_head_dim)
        else:
            w.add_head_count_kv(self.n_head)
            w.add_key_length(self.qk_nope + self.qk_rope)
            w.add_value_length(self.v_head_dim)
        w.add_expert_count(self.n_expert)
        w.add_expert_used_count(self.n_expert_used)
        w.add_expert_feed_forward_length(self.n_ff_exp)
        w.add_expert_shared_count(self.n_expert_shared)
        w.add_expert_weights_scale(float(self.weights_scale))
        w.add_expert_weights_norm(bool(self.weights_norm))
        w.add_uint32(f"{ARCH}.expert_gating_func", GATING[self.gating])
        if self.n_group:
            w.add_expert_group_count(self.n_group)
            w.add_expert_group_used_count(self.n_group_used)
        if self.yarn_factor:
            g = _gguf()
            w.add_rope_scaling_type(g.RopeScalingType.YARN)
            w.add_rope_scaling_factor(float(self.yarn_factor))
            w.add_rope_scaling_orig_ctx_len(self.yarn_orig_ctx)
            w.add_rope_scaling_yarn_log_mul(0.1 * self.yarn_mscale_all_dim)  # the converter's legacy 0.1 factor
        w.add_bool("p2pswarm.synth.mla_split", self.mla_split)

    def plan(self, n_vocab: int, qtype: str, expert_qtype: str | None, tied: bool,
             router_near_tie: bool) -> list[TensorPlan]:
        """The tensors of a deepseek2 model, in file order (llama.cpp's names and shapes)."""
        Q = _gguf().GGMLQuantizationType
        dense, exp_t = dense_types(qtype, expert_qtype)
        E, D, F, V, H = self.n_embd, self.n_expert, self.n_ff_exp, n_vocab, self.n_head
        Rq, Rkv, rope, nope, v = self.q_lora_rank, self.kv_lora_rank, self.qk_rope, self.qk_nope, self.v_head_dim
        plans: list[TensorPlan] = []

        add = plan_adder(plans, dense, exp_t)

        add("token_embd.weight", (V, E), "embd", LOGIT_STD / np.sqrt(E) if tied else 1.0)
        router_std = (ROUTER_NEAR_TIE_SCALE if router_near_tie else 1.0) / np.sqrt(E)
        for i in range(self.n_layer + self.n_nextn):
            p = f"blk.{i}."
            add(p + "attn_norm.weight", (E,), "norm", NORM_NOISE)
            if Rq:
                add(p + "attn_q_a_norm.weight", (Rq,), "norm", NORM_NOISE)
            add(p + "attn_kv_a_norm.weight", (Rkv,), "norm", NORM_NOISE)
            if Rq:
                add(p + "attn_q_a.weight", (Rq, E), "matrix", 1 / np.sqrt(E))
                add(p + "attn_q_b.weight", (H * (nope + rope), Rq), "matrix", 1 / np.sqrt(Rq))
            else:
                add(p + "attn_q.weight", (H * (nope + rope), E), "matrix", 1 / np.sqrt(E))
            add(p + "attn_kv_a_mqa.weight", (Rkv + rope, E), "matrix", 1 / np.sqrt(E))
            kv_b = (p + "attn_kv_b.weight", (H * (nope + v), Rkv), "matrix", 1 / np.sqrt(Rkv))
            if self.mla_split:  # the same random attn_kv_b, cut as the converter cuts it
                whole = TensorPlan(*kv_b, Q.F32, _type_size(Q.F32, kv_b[1]))
                add(p + "attn_k_b.weight", (H, Rkv, nope), "kv_b_k", 1 / np.sqrt(Rkv), parts=(whole,), cut=kv_b_part)
                add(p + "attn_v_b.weight", (H, v, Rkv), "kv_b_v", 1 / np.sqrt(Rkv), parts=(whole,), cut=kv_b_part)
            else:
                add(*kv_b)
            add(p + "attn_output.weight", (E, H * v), "matrix", 1 / np.sqrt(H * v))
            add(p + "ffn_norm.weight", (E,), "norm", NORM_NOISE)
            if i < self.n_dense_lead:
                Fd = self.n_ff_dense
                add(p + "ffn_gate.weight", (Fd, E), "matrix", 1 / np.sqrt(E))
                add(p + "ffn_down.weight", (E, Fd), "matrix", 1 / np.sqrt(Fd))
                add(p + "ffn_up.weight", (Fd, E), "matrix", 1 / np.sqrt(E))
                continue
            add(p + "ffn_gate_inp.weight", (D, E), "router", router_std)
            if self.gating == "sigmoid" and self.exp_probs_b:
                add(p + "exp_probs_b.bias", (D,), "vector", EXP_PROBS_B_STD)
            add(p + "ffn_down_exps.weight", (D, E, F), "experts", 1 / np.sqrt(F))
            add(p + "ffn_gate_exps.weight", (D, F, E), "experts", 1 / np.sqrt(E))
            add(p + "ffn_up_exps.weight", (D, F, E), "experts", 1 / np.sqrt(E))
            S = F * self.n_expert_shared
            if S:
                add(p + "ffn_gate_shexp.weight", (S, E), "matrix", 1 / np.sqrt(E))
                add(p + "ffn_down_shexp.weight", (E, S), "matrix", 1 / np.sqrt(S))
                add(p + "ffn_up_shexp.weight", (S, E), "matrix", 1 / np.sqrt(E))
            if i >= self.n_layer:  # an MTP block: what llama.cpp's deepseek2 MTP graph reads besides the layer
                add_mtp_extras(add, p, E)
        add_output_head(add, E, V, tied)
        return plans


def _dims(n_embd, n_head, n_layer, n_expert, used, ff, ctx, qk_nope, qk_rope, **kw) -> DeepSeek2Preset:
    return DeepSeek2Preset(n_embd=n_embd, n_head=n_head, n_head_kv=n_head, head_dim=qk_nope + qk_rope,
                           n_layer=n_layer, n_expert=n_expert, n_expert_used=used, n_ff_exp=ff,
                           context_length=ctx, qk_nope=qk_nope, qk_rope=qk_rope, **kw)


PRESETS_DEEPSEEK2: dict[str, DeepSeek2Preset] = {
    # Makes in about a second: DeepSeek-V3's structure at toy size (q_lora, split MLA tensors,
    # 1 dense + 3 MoE layers, sigmoid + bias routing over 4 groups of which 2 are used, scale 2.5,
    # YaRN factor 40).
    "tiny": _dims(256, 4, 4, 16, 4, 256, 163840, 64, 32, q_lora_rank=128, kv_lora_rank=128, v_head_dim=64,
                  n_dense_lead=1, n_ff_dense=512, n_group=4, n_group_used=2, weights_scale=2.5,
                  yarn_factor=40.0),
    # DeepSeek-V3 / R1 (671B): every per-layer and per-expert size; --layers keeps it small.
    "geometry-671b": _dims(7168, 128, 61, 256, 8, 2048, 163840, 128, 64, q_lora_rank=1536, kv_lora_rank=512,
                           v_head_dim=128, n_dense_lead=3, n_ff_dense=18432, n_group=8, n_group_used=4,
                           weights_scale=2.5, yarn_factor=40.0, expert_qtype="q4_k"),
}

#: make_model's ``deepseek2`` options (dataclass fields beyond :class:`Preset`)
OPTIONS = tuple(f.name for f in dataclasses.fields(DeepSeek2Preset) if f.name not in
                {g.name for g in dataclasses.fields(Preset)})


def kv_b_part(plan: TensorPlan, whole: np.ndarray) -> np.ndarray:
    """``attn_k_b`` or ``attn_v_b`` (``plan.kind`` kv_b_k / kv_b_v) cut from ``whole``, the F32
    ``attn_kv_b`` (H*(nope+v), Rkv) the unsplit form holds, as llama.cpp's converter cuts it."""
    H = plan.shape[0]
    rows, Rkv = whole.shape
    kv_b = whole.reshape(H, rows // H, Rkv)
    if plan.kind == "kv_b_k":
        nope = plan.shape[2]
        return np.ascontiguousarray(kv_b[:, :nope, :].transpose(0, 2, 1))  # (H, Rkv, nope)
    return np.ascontiguousarray(kv_b[:, rows // H - plan.shape[1]:, :])  # (H, v, Rkv)
