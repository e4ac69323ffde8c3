"""The dense path of ``deepseek2`` (DeepSeek-V2 / V2.5 / V3 / V3.1 / R1, Kimi K2).

Same contract as :mod:`p2pswarm.engine.arch.qwen3moe`; what differs (llama.cpp:
``src/models/deepseek2.cpp``, ``src/llama-graph.cpp`` build_moe_ffn):

* Attention is Multi-head Latent Attention (:mod:`p2pswarm.engine.arch.deepseek2.mla`): low-rank q (``attn_q_a`` +
  ``attn_q_a_norm`` + ``attn_q_b``, or plain ``attn_q`` in V2-Lite), one compressed KV row per
  position plus a decoupled RoPE key, YaRN RoPE (NORM pairing) and YaRN's attention scale. Both
  forms of the KV up-projection load: ``attn_kv_b`` (older files) and ``attn_k_b`` + ``attn_v_b``
  (what llama.cpp's converter writes now).
* The first ``leading_dense_block_count`` layers have a dense SwiGLU FFN and no routed experts:
  :meth:`route` gives (n, 0) ids and weights there and :meth:`post_moe` adds the dense FFN.
* MoE layers route by softmax (V2) or sigmoid with the ``exp_probs_b`` selection bias (V3), over
  ``expert_group_count`` groups of which ``expert_group_used_count`` are kept, then
  ``expert_weights_norm`` and ``expert_weights_scale``; a plain SwiGLU shared expert
  (``expert_shared_count`` of them, one tensor) is added to the routed sum.

The routed experts are plain SwiGLU (``ffn_{gate,up,down}_exps``): a worker computes them with the
kernels it already has, three mat-muls per expert.
"""
from __future__ import annotations

from typing import Any

import numpy as np

import p2pswarm.engine.arch.deepseek2.ggml_mla as ggml_mla  # (not ``from``: the package imports this module)
import p2pswarm.engine.arch.deepseek2.mla as mla
from p2pswarm.contracts import LayerIn, MtpEnds, Routed
from p2pswarm.engine.ggml import attention as ggml_attention
from p2pswarm.engine import ops
from p2pswarm.engine.arch.common import (DenseWeights, LayerByPieces, TokenEnds, check_tensors, dense_or_shared_ffn,
                                         model_error, nextn_head_norm, number_reader)
from p2pswarm.engine.routing import RouterSpec, no_experts, route
from p2pswarm.engine.backend import NUMPY, DenseBackend
from p2pswarm.engine.state import SequenceState
from p2pswarm.errors import ModelFormatError
from p2pswarm.model.layout import ModelLayout

F32 = np.float32


class DeepSeek2(TokenEnds, LayerByPieces):
    """deepseek2: MLA attention, leading dense layers, routed + shared experts."""

    arch = "deepseek2"
    #: the router when the file has no ``expert_gating_func``: files without it are DeepSeek-V2/V2.5's
    DEFAULT_GATING = "softmax"

    def __init__(self, layout: ModelLayout, backend: DenseBackend = NUMPY):
        self.backend = backend  # numpy's dense path, or ggml's graphs: chosen at load (engine.backend)
        self.layout = layout
        bad, num = model_error(layout), number_reader(layout, self.arch)

        # block_count includes any multi-token-prediction blocks appended at the end (GLM-4.7-Flash,
        # converters run without skipping MTP): the forward pass runs the blocks before them, as
        # llama.cpp does; their tensors stay in the file and in shards, never requested.
        self.n_block = num("block_count")
        self.n_layer_nextn = num("nextn_predict_layers", 0)
        self.n_layer = self.n_block - self.n_layer_nextn
        self.n_embd = num("embedding_length")
        self.n_head = num("attention.head_count")
        self.eps = num("attention.layer_norm_rms_epsilon", kind=float)
        self.n_ctx_train = num("context_length", 4096)
        self.n_dense_lead = num("leading_dense_block_count", 0)
        self.q_lora_rank = num("attention.q_lora_rank", 0)
        self.kv_lora_rank = num("attention.kv_lora_rank")
        self.n_rot = num("rope.dimension_count")
        # the split MLA form states the per-head sizes in *_mla keys (key_length is then the cache row)
        mla_split = "attention.key_length_mla" in layout.hparams
        k_key = "attention.key_length_mla" if mla_split else "attention.key_length"
        v_key = "attention.value_length_mla" if mla_split else "attention.value_length"
        self.head_k = num(k_key)
        self.head_v = num(v_key)
        self.n_nope = self.head_k - self.n_rot
        self.n_expert = num("expert_count")
        self.n_expert_used = num("expert_used_count")
        self.n_ff_exp = num("expert_feed_forward_length")
        self.n_expert_shared = num("expert_shared_count", 0)
        if not 0 <= self.n_layer_nextn < self.n_block:
            raise bad(f"key {self.arch}.nextn_predict_layers {self.n_layer_nextn} must be below block_count "
                      f"{self.n_block}")
        for key, v in (("block_count", self.n_layer), ("embedding_length", self.n_embd),
                       ("attention.head_count", self.n_head), ("attention.kv_lora_rank", self.kv_lora_rank),
                       ("rope.dimension_count", self.n_rot), (k_key, self.head_k), (v_key, self.head_v),
                       ("expert_count", self.n_expert), ("expert_used_count", self.n_expert_used)):
            if v <= 0:
                raise bad(f"key {self.arch}.{key} must be positive, got {v}")
        if self.n_rot % 2:
            raise bad(f"key {self.arch}.rope.dimension_count {self.n_rot} must be even")
        if self.n_nope < 1:
            raise bad(f"key {self.arch}.{k_key} {self.head_k} must exceed rope.dimension_count {self.n_rot}")
        if not 0 <= self.n_dense_lead < self.n_layer:
            raise bad(f"key {self.arch}.leading_dense_block_count {self.n_dense_lead} must be below "
                      f"block_count {self.n_layer}")
        self.router = RouterSpec.from_layout(layout, default_gating=self.DEFAULT_GATING)  # gating, groups, norm, scale: checked there
        self.yarn = mla.Yarn.from_hparams(lambda k, d=None: layout.hparam(k, d), self.n_rot, self.n_ctx_train)
        self.kq_scale = self.yarn.kq_scale(self.head_k)
        self.w = DenseWeights(layout)
        tied = not self.w.has("output.weight")
        self.output_name = "token_embd.weight" if tied else "output.weight"
        self.n_vocab = int(layout.tensor("token_embd.weight").shape[1])
        self._check_tensors()
        #: (k_b, v_b) per layer: ggml_mla.HeadMatrices under the ggml kernel, else float32 arrays
        self._kv_b: dict[int, tuple[Any, Any]] = {}

    # ---- model description ------------------------------------------------------------------
    def _check_tensors(self) -> None:
        """Every tensor the forward pass reads, present and of the right shape (one line naming the
        first that is not)."""
        E, V = self.n_embd, self.n_vocab
        need: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (V, E)), ("output_norm.weight", (E,))]
        if self.output_name == "output.weight":
            need.append(("output.weight", (V, E)))
        self.split_kv_b = self.w.has("blk.0.attn_k_b.weight")
        for il in range(self.n_layer):
            need += self.layer_tensors(il)
        check_tensors(self, need)

    def layer_tensors(self, il: int) -> list[tuple[str, tuple[int, ...]]]:
        """The tensors layer ``il`` reads, with their shapes (numpy order): the trunk's layers and
        the MTP block's (:mod:`p2pswarm.backbone.serving.mtp`) alike; a dense/MoE mismatch is one line."""
        E, H = self.n_embd, self.n_head
        Rq, Rkv, rope, nope, v = self.q_lora_rank, self.kv_lora_rank, self.n_rot, self.n_nope, self.head_v
        p = f"blk.{il}."
        need: list[tuple[str, tuple[int, ...]]] = [
            (p + "attn_norm.weight", (E,)), (p + "attn_kv_a_norm.weight", (Rkv,)),
            (p + "attn_kv_a_mqa.weight", (Rkv + rope, E)), (p + "attn_output.weight", (E, H * v)),
            (p + "ffn_norm.weight", (E,))]
        if Rq > 0:
            need += [(p + "attn_q_a.weight", (Rq, E)), (p + "attn_q_a_norm.weight", (Rq,)),
                     (p + "attn_q_b.weight", (H * (nope + rope), Rq))]
        else:
            need.append((p + "attn_q.weight", (H * (nope + rope), E)))
        if self.split_kv_b:
            need += [(p + "attn_k_b.weight", (H, Rkv, nope)), (p + "attn_v_b.weight", (H, v, Rkv))]
        else:
            need.append((p + "attn_kv_b.weight", (H * (nope + v), Rkv)))
        if il < self.n_dense_lead:
            if il in self.layout.expert_tensors:
                raise ModelFormatError(f"{self.layout.path}: layer {il} is a leading dense layer "
                                       f"(leading_dense_block_count {self.n_dense_lead}) but has routed experts")
            Fd = self.w.shape(p + "ffn_gate.weight")[0] if self.w.has(p + "ffn_gate.weight") else 0
            need += [(p + "ffn_gate.weight", (Fd, E)), (p + "ffn_up.weight", (Fd, E)),
                     (p + "ffn_down.weight", (E, Fd))]
            return need
        if il not in self.layout.expert_tensors:
            raise ModelFormatError(f"{self.layout.path}: layer {il} has no routed-expert tensors "
                                   f"(blk.{il}.ffn_*_exps.weight)")
        need.append((p + "ffn_gate_inp.weight", (self.n_expert, E)))
        if self.w.has(p + "exp_probs_b.bias"):
            need.append((p + "exp_probs_b.bias", (self.n_expert,)))
        if self.n_expert_shared:
            S = self.w.shape(p + "ffn_gate_shexp.weight")[0] if self.w.has(p + "ffn_gate_shexp.weight") else 0
            need += [(p + "ffn_gate_shexp.weight", (S, E)), (p + "ffn_up_shexp.weight", (S, E)),
                     (p + "ffn_down_shexp.weight", (E, S))]
        return need

    def is_dense_layer(self, il: int) -> bool:
        return il < self.n_dense_lead

    # ---- per sequence -----------------------------------------------------------------------
    def new_state(self) -> SequenceState:
        st = SequenceState()
        for il in range(self.n_layer):
            st.extra[il] = mla.LatentCache(self.kv_lora_rank + self.n_rot)
        return st

    def pre_moe(self, il: int, h: np.ndarray, state: SequenceState, pos0: int) -> np.ndarray:
        return self.pre_moe_batch(il, h, [(state, pos0, h.shape[0])])

    def _kv_b_halves(self, il: int):
        """(k_b (H, Rkv, nope), v_b (H, v, Rkv)) of layer ``il``, from either MLA form: the split
        tensors on their quantised bytes under the ggml kernel (llama.cpp's per-head mat-muls and
        their rounding, :mod:`~p2pswarm.engine.arch.deepseek2.ggml_mla`), else float32 arrays."""
        got = self._kv_b.get(il)
        if got is None:
            p, H = f"blk.{il}.", self.n_head
            if self.split_kv_b:
                k_b, v_b = (ggml_mla.head_matrices(self.backend.ggml, p + n) or np.asarray(self.w[p + n], dtype=F32)
                            for n in ("attn_k_b.weight", "attn_v_b.weight"))
            else:
                kv_b = np.asarray(self.w[p + "attn_kv_b.weight"], dtype=F32).reshape(H, self.n_nope + self.head_v, -1)
                k_b = np.ascontiguousarray(kv_b[:, : self.n_nope, :].transpose(0, 2, 1))
                v_b = np.ascontiguousarray(kv_b[:, self.n_nope :, :])
            got = self._kv_b[il] = (k_b, v_b)
        return got

    def pre_moe_batch(self, il: int, h: np.ndarray, segments: list[tuple[SequenceState, int, int]]) -> np.ndarray:
        """h + MLA(attn_norm(h)) for the rows of several sequences (``(state, pos0, n)`` each, in
        order): projections, norms and RoPE over all rows, the cache and attention per sequence."""
        if sum(n for _, _, n in segments) != h.shape[0]:
            raise ValueError(f"segments cover {sum(n for _, _, n in segments)} rows, h has {h.shape[0]}")
        caches = [(st.extra[il], pos0, n) for st, pos0, n in segments]
        if h.shape[0] and self._ggml_core():  # the whole layer as llama.cpp's one graph, for its bits (see ggml_mla)
            return ggml_mla.mla_layer(self, il, h, caches)
        return self.mla_rows(il, h, caches)

    def layer_in(self, il: int, h: np.ndarray, segments: list[tuple[SequenceState, int, int]]) -> LayerIn:
        """The layer up to its routed experts. On the ggml kernel one graph (llama.cpp's:
        src/models/deepseek2.cpp) computes the MLA, ffn_norm and then a leading dense layer's whole
        FFN and residual (``extras["out"]``, the layer's output), or a MoE layer's router logits and
        gating and its shared expert (``extras["shared"]``); numpy picks the experts from the
        gating. Why: per piece a decode step ran ~5 graphs a layer with Python between them."""
        if sum(n for _, _, n in segments) != h.shape[0]:
            raise ValueError(f"segments cover {sum(n for _, _, n in segments)} rows, h has {h.shape[0]}")
        if not (h.shape[0] and self._ggml_core() and self._ffn_fused(il)):
            return super().layer_in(il, h, segments)
        h, more = ggml_mla.mla_layer(self, il, h, [(st.extra[il], pos0, n) for st, pos0, n in segments], ffn=True)
        cur = more.pop("cur")
        if self.is_dense_layer(il):
            ids, w = no_experts(h.shape[0])
        else:
            p = f"blk.{il}."
            bias = self.w[p + "exp_probs_b.bias"].reshape(-1) if self.w.has(p + "exp_probs_b.bias") else None
            ids, w = route(more.pop("logits"), self.router, bias, probs=more.pop("probs"))
        return LayerIn(h, cur, ids, w, more)

    #: False keeps the FFN side as pieces under the ggml kernel (bench/deepseek2_fold_ab.py compares the two)
    ggml_ffn = True

    def _ffn_fused(self, il: int) -> bool:
        if not self.ggml_ffn:
            return False
        got = self.__dict__.setdefault("_ffn_fusable", {})
        if il not in got:
            got[il] = ggml_mla.ffn_fusable(self, il)
        return got[il]

    def layer_out(self, il: int, lin: LayerIn, moe: np.ndarray) -> np.ndarray:
        """The layer's output: from its graph where that computed it (a dense layer's ``out``, a
        shared expert's ``shared``: :meth:`layer_in`), else :meth:`post_moe`."""
        if "out" in lin.extras:
            return lin.extras["out"]
        shared = lin.extras.get("shared")
        if shared is not None:
            return lin.h + (moe + shared)
        return self.post_moe(il, lin.h, lin.cur, moe)

    def mla_rows(self, il: int, h: np.ndarray, caches: list[tuple[mla.LatentCache, int, int]]) -> np.ndarray:
        """h + MLA(attn_norm(h)) of layer ``il`` with numpy's ops, for ``(latent cache, pos0, n)``
        segments of rows: the trunk's path off the ggml kernel, and the MTP block's
        (:mod:`p2pswarm.backbone.serving.mtp`: its own cache, and a draft needs no bit-exactness)."""
        w, p = self.w, f"blk.{il}."
        T, H, Rkv, rope, nope = h.shape[0], self.n_head, self.kv_lora_rank, self.n_rot, self.n_nope
        x = self._rms_norm(p + "attn_norm.weight", h)
        if self.q_lora_rank > 0:
            qa, ckv = ops.matmuls(x, [w[p + "attn_q_a.weight"], w[p + "attn_kv_a_mqa.weight"]])
            q = ops.matmul(self._rms_norm(p + "attn_q_a_norm.weight", qa), w[p + "attn_q_b.weight"])
        else:
            q, ckv = ops.matmuls(x, [w[p + "attn_q.weight"], w[p + "attn_kv_a_mqa.weight"]])
        q = q.reshape(T, H, nope + rope)
        pos = np.concatenate([np.arange(pos0, pos0 + n) for _, pos0, n in caches])
        q_pe = self.yarn.rope_norm(q[..., nope:], pos)
        k_pe = self.yarn.rope_norm(ckv[:, None, Rkv:], pos)[:, 0]
        c = ops.rms_norm(ckv[:, :Rkv], w[p + "attn_kv_a_norm.weight"], self.eps)
        k_b, v_b = self._kv_b_halves(il)
        q_abs = np.empty((T, H, Rkv + rope), F32)
        q_abs[..., :Rkv] = ggml_mla.per_head_matmul(k_b, q[..., :nope].transpose(1, 0, 2)).transpose(1, 0, 2)
        q_abs[..., Rkv:] = q_pe
        rows = np.concatenate([c, k_pe], axis=1)
        lats, at = [], 0
        for latent, pos0, n in caches:  # per sequence: its cache
            cache = latent.append(rows[at:at + n])
            lats.append(mla.latent_attention(q_abs[at:at + n], cache, Rkv, self.kq_scale, pos0))
            at += n
        lat = lats[0] if len(lats) == 1 else np.concatenate(lats, axis=1)  # (H, T, Rkv)
        att = ggml_mla.per_head_matmul(v_b, lat).transpose(1, 0, 2).reshape(T, H * self.head_v)
        return h + ops.matmul(np.ascontiguousarray(att, dtype=F32), w[p + "attn_output.weight"])

    #: False keeps the numpy MLA core under the ggml kernel too (tests compare the two)
    ggml_core = True

    def _ggml_core(self) -> bool:
        if not self.ggml_core:
            return False
        got = self.__dict__.get("_core")
        if got is None:
            got = self._core = ggml_mla.core_available(self)
        return got

    def ffn_input(self, il: int, h: np.ndarray) -> np.ndarray:
        return self._rms_norm(f"blk.{il}.ffn_norm.weight", h)

    def _rms_norm(self, name: str, x: np.ndarray) -> np.ndarray:
        """``rms_norm(x) * w[name]``: ggml's op under the ggml kernel (numpy's is 1 ulp off in some
        rows, which moves the 8-bit rounding of what the next mat-mul reads), numpy's otherwise."""
        dense = self.backend.ggml
        if dense is not None and x.shape[0]:
            got = ggml_attention.rms_norm_rows(self, dense.runner, name, np.ascontiguousarray(x, dtype=F32))
            if got is not None:
                return got
        return np.ascontiguousarray(ops.rms_norm(x, self.w[name], self.eps))

    def route(self, il: int, cur: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The routed experts' ids and weights (n, k); (n, 0) on a leading dense layer."""
        if il < self.n_dense_lead:
            return no_experts(cur.shape[0])
        p = f"blk.{il}."
        W = self.w[p + "ffn_gate_inp.weight"]
        bias = self.w[p + "exp_probs_b.bias"].reshape(-1) if self.w.has(p + "exp_probs_b.bias") else None
        got = ggml_mla.gate_probs(W, cur, self.router.gating)  # llama.cpp's bits on the ggml kernel
        if got is not None:
            return route(got[0], self.router, bias, probs=got[1])
        return route(np.asarray(ops.matmul(cur, W), dtype=F32), self.router, bias)

    def post_moe(self, il: int, h: np.ndarray, cur: np.ndarray, moe: np.ndarray) -> np.ndarray:
        """h + dense FFN (leading layers), or h + (routed + shared), in llama.cpp's order."""
        return dense_or_shared_ffn(self.w, il, h, cur, moe, dense=il < self.n_dense_lead,
                                   shared=bool(self.n_expert_shared))

    # ---- the MTP (NextN) block, a drafter (contracts.MtpModel; p2pswarm.backbone.mtp) -------
    def mtp_blocks(self) -> int:
        return self.n_layer_nextn

    def mtp_ends(self, il: int) -> MtpEnds:
        """DeepSeek-V3/R1's block: one full deepseek2 layer, checked as the trunk's; its head norm
        may be left out (``output_norm`` then), and where the file has them ``nextn.embed_tokens``
        and ``nextn.shared_head_head`` replace the embedding and the head, as llama.cpp reads them."""
        p, E, V = f"blk.{il}.", self.n_embd, self.n_vocab
        head_norm, need = nextn_head_norm(self.w, il, E, optional=True)
        need = [*need, *self.layer_tensors(il)]
        ends = {"embed": "token_embd.weight", "head": self.output_name}
        for end, name in (("embed", "nextn.embed_tokens.weight"), ("head", "nextn.shared_head_head.weight")):
            if self.w.has(p + name):
                ends[end] = p + name
                need.append((p + name, (V, E)))
        return MtpEnds(ends["embed"], ends["head"], head_norm, need)

    def mtp_cache(self) -> mla.LatentCache:
        return mla.LatentCache(self.kv_lora_rank + self.n_rot)

    def mtp_layer(self, il: int, cache: mla.LatentCache, x: np.ndarray, pos0: int, routed: Routed, *,
                  last_only: bool = False) -> np.ndarray:
        """MLA on the block's latent cache with numpy's ops (a draft needs no bit-exactness), then the
        MoE (of the last row only with ``last_only``: contracts.MtpModel.mtp_layer)."""
        h = self.mla_rows(il, np.ascontiguousarray(x, dtype=F32), [(cache, pos0, x.shape[0])])
        return self.moe_rows(il, h[-1:] if last_only else h, routed)
