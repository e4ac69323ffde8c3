"""The dense path of ``glm4moe`` (GLM-4.5, GLM-4.5-Air, GLM-4.6): what llama.cpp's
``src/models/glm4-moe.cpp`` computes, everything but the routed experts.

Per layer ``il`` (of the ``block_count - nextn_predict_layers`` trunk layers)::

    x    = attn_norm(h)
    q, k, v = attn_q/k/v(x) (+ their biases when the file has them: GLM-4.5 does)
    q, k = per-head RMSNorm (attn_q_norm / attn_k_norm, when present: GLM-4.5 yes, Air no)
    q, k = NEOX RoPE on the first rope.dimension_count dims of each head (partial rotary: 64 of 128)
    h    = h + attn_output(attention(q, k, v))          (GQA, scale 1/sqrt(head_dim))
    cur  = post_attention_norm(h)                        (the rows the router and experts see)
    il <  leading_dense_block_count:  h = h + ffn_down(silu(ffn_gate cur) * ffn_up cur)
    else: h = h + (routed(cur) + shared_expert(cur))     (sigmoid router + exp_probs_b bias,
                                                          expert_weights_norm / _scale)

The first ``leading_dense_block_count`` layers have no routed experts: :meth:`route` gives them
none (ids of shape (n, 0)), so the backbone sends no request for them and ``post_moe`` adds their
dense FFN. The router is :func:`p2pswarm.engine.routing.route` with the file's
:class:`~p2pswarm.engine.routing.RouterSpec`.

NextN / MTP: GLM-4.5 files carry ``nextn_predict_layers`` (1) extra blocks after the trunk,
``blk.{n_layer}.*``, with ``nextn.eh_proj``, ``nextn.enorm``, ``nextn.hnorm``, ``nextn.shared_head_norm``
and a full MoE block. They serve speculative decoding (llama.cpp builds them in a separate MTP
graph, never in the forward pass); the forward pass never runs them, ``--speculate mtp`` does
(:mod:`p2pswarm.backbone.serving.mtp`, on this model's weights, loaded when first read). Their routed-expert
tensors are still listed by the layout, so a worker slicing "all layers" holds them (1/90 of the
experts at GLM-4.5's geometry) though no request ever asks for them.
"""
from __future__ import annotations

import numpy as np

from p2pswarm.contracts import MtpEnds, Routed
from p2pswarm.engine import ops, routing
from p2pswarm.engine.arch.common import (DenseWeights, LayerByPieces, TokenEnds, check_tensors, dense_or_shared_ffn,
                                         model_error, neox_attention, nextn_head_norm, number_reader)
from p2pswarm.engine.backend import NUMPY, DenseBackend
from p2pswarm.engine.state import KVCache, SequenceState
from p2pswarm.errors import ModelFormatError
from p2pswarm.model.layout import ModelLayout

F32 = np.float32


class Glm4MoE(TokenEnds, LayerByPieces):
    """glm4moe: GQA with q/k/v biases, optional q/k norms and partial NEOX RoPE; leading dense FFN
    layers; sigmoid-routed experts with a selection bias; one shared expert. Its attention layer is
    qwen3moe's but for the biases and optional norms: both call
    :func:`~p2pswarm.engine.arch.common.neox_attention` with their own ``_qkv`` (it used to subclass
    qwen3moe's class for it, and so inherit whatever that class did next)."""

    arch = "glm4moe"
    #: the router when the file has no ``expert_gating_func``: what llama.cpp's loader assumes (GLM-4.5's)
    DEFAULT_GATING = "sigmoid"

    def __init__(self, layout: ModelLayout, backend: DenseBackend = NUMPY):  # one check per key, in order
        self.backend = backend  # numpy's dense path, or ggml's graphs: chosen at load (engine.backend)
        self.layout = layout
        bad, num = model_error(layout), number_reader(layout, self.arch)

        self.n_block = num("block_count")
        self.n_layer_nextn = num("nextn_predict_layers", 0)
        self.n_layer = self.n_block - self.n_layer_nextn
        self.n_dense = num("leading_dense_block_count", 0)
        self.n_embd = num("embedding_length")
        self.n_head = num("attention.head_count")
        self.n_head_kv = num("attention.head_count_kv", self.n_head)
        self.head_dim = num("attention.key_length", self.n_embd // max(self.n_head, 1))
        v_len = num("attention.value_length", self.head_dim)
        self.n_rot = num("rope.dimension_count", self.head_dim)
        self.rope_base = num("rope.freq_base", 10000.0, kind=float)
        self.eps = num("attention.layer_norm_rms_epsilon", kind=float)
        self.n_ctx_train = num("context_length", 4096)
        self.n_expert_shared = num("expert_shared_count")
        self.router = routing.RouterSpec.from_layout(layout, default_gating=self.DEFAULT_GATING)
        self.n_expert = self.router.n_expert
        self.n_expert_used = self.router.n_expert_used
        for key, v in (("embedding_length", self.n_embd), ("attention.head_count", self.n_head),
                       ("attention.head_count_kv", self.n_head_kv), ("attention.key_length", self.head_dim)):
            if v <= 0:
                raise bad(f"key {self.arch}.{key} must be positive, got {v}")
        if not 0 <= self.n_layer_nextn < self.n_block:
            raise bad(f"key {self.arch}.nextn_predict_layers {self.n_layer_nextn} must be below block_count "
                      f"{self.n_block}")
        if not 0 <= self.n_dense < self.n_layer:
            raise bad(f"key {self.arch}.leading_dense_block_count {self.n_dense} must be below the "
                      f"{self.n_layer} trunk layers (block_count - nextn_predict_layers)")
        if self.n_expert_shared < 0:
            raise bad(f"key {self.arch}.expert_shared_count must not be negative, got {self.n_expert_shared}")
        if v_len != self.head_dim:
            raise bad(f"key {self.arch}.attention.value_length {v_len} != attention.key_length {self.head_dim} "
                      "(llama.cpp requires them equal)")
        if self.n_head % self.n_head_kv:
            raise bad(f"key {self.arch}.attention.head_count {self.n_head} is not a multiple of head_count_kv "
                      f"{self.n_head_kv}")
        if not 0 < self.n_rot <= self.head_dim or self.n_rot % 2:
            raise bad(f"key {self.arch}.rope.dimension_count {self.n_rot} must be even and at most the head "
                      f"size {self.head_dim}")
        sections = layout.hparam("rope.dimension_sections")
        if isinstance(sections, list) and len(sections) >= 2 and sections[0] and sections[1]:
            raise bad(f"key {self.arch}.rope.dimension_sections {sections!r}: multimodal M-RoPE is not supported")
        scaling = layout.hparam("rope.scaling.type", "none")
        if scaling not in ("none", None):
            raise bad(f"key {self.arch}.rope.scaling.type {scaling!r}: RoPE scaling is not supported")

        self.w = DenseWeights(layout)
        tied = not self.w.has("output.weight")
        self.output_name = "token_embd.weight" if tied else "output.weight"
        self.n_vocab = int(layout.tensor("token_embd.weight").shape[1])
        self.qk_norm = self.w.has("blk.0.attn_q_norm.weight")
        self.qkv_bias = self.w.has("blk.0.attn_q.bias")
        self._check_tensors()

    def _check_tensors(self) -> None:
        """Every tensor the forward pass reads, present and of the right shape (one line naming the
        first that is not), and routed experts exactly on the MoE layers."""
        E, V = self.n_embd, self.n_vocab
        H, Hkv, hd, D = self.n_head, self.n_head_kv, self.head_dim, self.n_expert
        need: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (V, E)), ("output_norm.weight", (E,))]
        if self.output_name == "output.weight":
            need.append(("output.weight", (V, E)))
        for il in range(self.n_layer):
            p = f"blk.{il}."
            need += [(p + "attn_norm.weight", (E,)), (p + "attn_q.weight", (H * hd, E)),
                     (p + "attn_k.weight", (Hkv * hd, E)), (p + "attn_v.weight", (Hkv * hd, E)),
                     (p + "attn_output.weight", (E, H * hd)), (p + "post_attention_norm.weight", (E,))]
            if self.qkv_bias:
                need += [(p + "attn_q.bias", (H * hd,)), (p + "attn_k.bias", (Hkv * hd,)),
                         (p + "attn_v.bias", (Hkv * hd,))]
            if self.qk_norm:
                need += [(p + "attn_q_norm.weight", (hd,)), (p + "attn_k_norm.weight", (hd,))]
            has_experts = il in self.layout.expert_tensors
            if il < self.n_dense:
                if has_experts:
                    raise ModelFormatError(f"{self.layout.path}: layer {il} has routed-expert tensors but "
                                           f"{self.arch}.leading_dense_block_count {self.n_dense} makes it dense")
                if not self.w.has(p + "ffn_gate.weight"):
                    raise ModelFormatError(f"{self.layout.path}: required tensor {p + 'ffn_gate.weight'!r} is missing")
                ff = self.w.shape(p + "ffn_gate.weight")[0]
                need += [(p + "ffn_gate.weight", (ff, E)), (p + "ffn_up.weight", (ff, E)),
                         (p + "ffn_down.weight", (E, ff))]
                continue
            if not has_experts:
                raise ModelFormatError(f"{self.layout.path}: layer {il} has no routed-expert tensors "
                                       f"(blk.{il}.ffn_*_exps.weight)")
            need += [(p + "ffn_gate_inp.weight", (D, E)), (p + "exp_probs_b.bias", (D,))]
            if self.n_expert_shared:
                ffs = self.layout.expert_tensors[il]["down"].shape[2] * self.n_expert_shared
                need += [(p + "ffn_gate_shexp.weight", (ffs, E)), (p + "ffn_up_shexp.weight", (ffs, E)),
                         (p + "ffn_down_shexp.weight", (E, ffs))]
        check_tensors(self, need)

    # ---- per sequence -----------------------------------------------------------------------
    def new_state(self) -> SequenceState:
        return SequenceState(kv={il: KVCache(self.n_head_kv, self.head_dim) for il in range(self.n_layer)})

    # ---- the layer pieces -------------------------------------------------------------------
    def pre_moe(self, il: int, h: np.ndarray, state: SequenceState, pos0: int) -> np.ndarray:
        return self.pre_moe_batch(il, h, [(state, pos0, h.shape[0])])

    def pre_moe_batch(self, il: int, h: np.ndarray, segments: list[tuple[SequenceState, int, int]]) -> np.ndarray:
        """h + the attention of the rows of several sequences (``(state, pos0, n)`` each, in order)."""
        return self._attention(il, h, [(state.kv[il], pos0, n) for state, pos0, n in segments])

    def _attention(self, il: int, h: np.ndarray, caches: list[tuple[KVCache, int, int]]) -> np.ndarray:
        return neox_attention(self.w, il, h, caches, self._qkv, eps=self.eps, n_rot=self.n_rot,
                              rope_base=self.rope_base, n_head=self.n_head, head_dim=self.head_dim)

    def _qkv(self, il: int, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """q, k, v before RoPE: projections, + biases (added as ggml_add does, after the mat-mul),
        then the per-head RMSNorms where the model has them."""
        w, p, T = self.w, f"blk.{il}.", x.shape[0]
        q, k, v = ops.matmuls(x, [w[p + "attn_q.weight"], w[p + "attn_k.weight"], w[p + "attn_v.weight"]])
        if self.qkv_bias:
            q = q + w[p + "attn_q.bias"].reshape(-1)
            k = k + w[p + "attn_k.bias"].reshape(-1)
            v = v + w[p + "attn_v.bias"].reshape(-1)
        q = q.reshape(T, self.n_head, self.head_dim)
        k = k.reshape(T, self.n_head_kv, self.head_dim)
        v = v.reshape(T, self.n_head_kv, self.head_dim)
        if self.qk_norm:
            q = ops.rms_norm(q, w[p + "attn_q_norm.weight"], self.eps)
            k = ops.rms_norm(k, w[p + "attn_k_norm.weight"], self.eps)
        return q, k, v

    def ffn_input(self, il: int, h: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(ops.rms_norm(h, self.w[f"blk.{il}.post_attention_norm.weight"], self.eps))

    def route(self, il: int, cur: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """No experts on a leading dense layer; else the sigmoid router with its selection bias."""
        if il < self.n_dense:
            return routing.no_experts(cur.shape[0])
        p = f"blk.{il}."
        logits = ops.matmul(cur, self.w[p + "ffn_gate_inp.weight"])
        return routing.route(logits, self.router, self.w[p + "exp_probs_b.bias"])

    def post_moe(self, il: int, h: np.ndarray, cur: np.ndarray, moe: np.ndarray) -> np.ndarray:
        """A dense layer: h + its FFN (``moe`` is empty work, ignored). A MoE layer: h + (routed +
        shared), added in llama.cpp's order."""
        return dense_or_shared_ffn(self.w, il, h, cur, moe, dense=il < self.n_dense, shared=bool(self.n_expert_shared))

    # ---- the MTP (NextN) block, a drafter (contracts.MtpModel; p2pswarm.backbone.mtp) -------
    def mtp_blocks(self) -> int:
        return self.n_layer_nextn

    def mtp_ends(self, il: int) -> MtpEnds:
        """The block's own head norm (required) and its layer: attention as the trunk's (biases and
        q/k norms as the file has them), post_attention_norm, the biased router, the shared expert."""
        E, H, Hkv, hd, D = self.n_embd, self.n_head, self.n_head_kv, self.head_dim, self.n_expert
        head_norm, need = nextn_head_norm(self.w, il, E, optional=False)
        layer: list[tuple[str, tuple[int, ...] | None]] = [
            ("attn_norm.weight", (E,)), ("attn_q.weight", (H * hd, E)), ("attn_k.weight", (Hkv * hd, E)),
            ("attn_v.weight", (Hkv * hd, E)), ("attn_output.weight", (E, H * hd)),
            ("post_attention_norm.weight", (E,)), ("ffn_gate_inp.weight", (D, E)), ("exp_probs_b.bias", (D,))]
        if self.qkv_bias:
            layer += [("attn_q.bias", (H * hd,)), ("attn_k.bias", (Hkv * hd,)), ("attn_v.bias", (Hkv * hd,))]
        if self.qk_norm:
            layer += [("attn_q_norm.weight", (hd,)), ("attn_k_norm.weight", (hd,))]
        if self.n_expert_shared:
            layer += [("ffn_gate_shexp.weight", None), ("ffn_up_shexp.weight", None), ("ffn_down_shexp.weight", None)]
        return MtpEnds("token_embd.weight", self.output_name, head_norm,
                       need + [(f"blk.{il}.{name}", shape) for name, shape in layer])

    def mtp_cache(self) -> KVCache:
        return KVCache(self.n_head_kv, self.head_dim)

    def mtp_layer(self, il: int, cache: KVCache, x: np.ndarray, pos0: int, routed: Routed, *,
                  last_only: bool = False) -> np.ndarray:
        h = self._attention(il, x, [(cache, pos0, x.shape[0])])
        return self.moe_rows(il, h[-1:] if last_only else h, routed)
