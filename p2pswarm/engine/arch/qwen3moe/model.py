"""The dense path of ``qwen3moe``: everything of a layer except the routed experts.

The backbone's layer loop (``p2pswarm.backbone.serving.runner``) calls, per layer,
``lin = model.layer_in(il, h, segments)`` and, once the experts are combined,
``h = model.layer_out(il, lin, moe)``; here (:class:`~p2pswarm.engine.arch.common.LayerByPieces`)
those are the pieces::

    h   = model.pre_moe_batch(il, h, segs)    # x + attention(attn_norm(x)), KV caches updated
    cur = model.ffn_input(il, h)              # ffn_norm(h): the rows sent to the experts
    ids, w = model.route(il, cur)             # softmax -> top-k -> renormalise (authoritative)
    ... experts computed wherever they live, combined in top-k order ...
    h   = model.post_moe(il, h, cur, moe)     # residual (+ shared expert in other archs)

Any other architecture provides the same calls (its own package beside this one).
"""
from __future__ import annotations

import numpy as np

from p2pswarm.engine import ops
from p2pswarm.engine.arch.common import DenseWeights, LayerByPieces, TokenEnds
from p2pswarm.engine.backend import NUMPY, DenseBackend
from p2pswarm.engine.state import KVCache, SequenceState
from p2pswarm.errors import ModelFormatError
from p2pswarm.model.layout import ModelLayout

F32 = np.float32


class Qwen3MoE(TokenEnds, LayerByPieces):
    """qwen3moe: GQA attention with per-head q/k RMSNorm and NEOX RoPE; routed experts, no shared one."""

    arch = "qwen3moe"

    def __init__(self, layout: ModelLayout, backend: DenseBackend = NUMPY):
        self.backend = backend  # numpy's dense path, or ggml's graphs: chosen at load (engine.backend)
        self.layout = layout
        hp = lambda k, d=None: layout.hparam(k, d, required=d is None)
        self.n_layer = int(hp("block_count"))
        self.n_embd = int(hp("embedding_length"))
        self.n_head = int(hp("attention.head_count"))
        self.n_head_kv = int(hp("attention.head_count_kv", self.n_head))
        self.head_dim = int(hp("attention.key_length", self.n_embd // self.n_head))
        self.n_rot = int(hp("rope.dimension_count", self.head_dim))
        self.rope_base = float(hp("rope.freq_base", 10000.0))
        self.eps = float(hp("attention.layer_norm_rms_epsilon"))
        self.n_expert = int(hp("expert_count"))
        self.n_expert_used = int(hp("expert_used_count"))
        self.n_ctx_train = int(hp("context_length", 4096))
        self.w = DenseWeights(layout)
        tied = not self.w.has("output.weight")
        self.output_name = "token_embd.weight" if tied else "output.weight"
        self.n_vocab = int(layout.tensor("token_embd.weight").shape[1])
        self._check_tensors()

    def _check_tensors(self) -> None:
        need = ["token_embd.weight", "output_norm.weight"]
        for il in range(self.n_layer):
            need += [
                f"blk.{il}.{n}.weight"
                for n in ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm",
                          "ffn_norm", "ffn_gate_inp")
            ]
        for name in need:
            if not self.w.has(name):
                raise ModelFormatError(f"{self.layout.path}: required tensor {name!r} is missing")

    # ---- per sequence ---------------------------------------------------------------------
    def new_state(self) -> SequenceState:
        return SequenceState(kv={il: KVCache(self.n_head_kv, self.head_dim) for il in range(self.n_layer)})

    # ---- the layer pieces -----------------------------------------------------------------
    def pre_moe(self, il: int, h: np.ndarray, state: SequenceState, pos0: int) -> np.ndarray:
        return self.pre_moe_batch(il, h, [(state, pos0, h.shape[0])])

    def pre_moe_batch(self, il: int, h: np.ndarray, segments: list[tuple[SequenceState, int, int]]) -> np.ndarray:
        """:meth:`pre_moe` for the rows of several sequences at once (``h`` holds the ``n`` rows of
        each ``(state, pos0, n)`` segment, in order): norms, projections and RoPE over all rows,
        KV cache and attention per sequence. One segment is exactly :meth:`pre_moe`."""
        if sum(n for _, _, n in segments) != h.shape[0]:
            raise ValueError(f"segments cover {sum(n for _, _, n in segments)} rows, h has {h.shape[0]}")
        w = self.w
        p = f"blk.{il}."
        T = h.shape[0]
        x = ops.rms_norm(h, w[p + "attn_norm.weight"], self.eps)
        q, k, v = self._qkv(il, x)
        pos = np.concatenate([np.arange(pos0, pos0 + n) for _, pos0, n in segments])
        q = ops.rope_neox(q, pos, self.n_rot, self.rope_base)
        k = ops.rope_neox(k, pos, self.n_rot, self.rope_base)
        atts, at = [], 0
        for state, pos0, n in segments:
            keys, values = state.kv[il].append(k[at:at + n], v[at:at + n])
            atts.append(ops.attention(q[at:at + n], keys, values, pos0))
            at += n
        att = (atts[0] if len(atts) == 1 else np.concatenate(atts)).reshape(T, self.n_head * self.head_dim)
        return h + ops.matmul(np.ascontiguousarray(att), w[p + "attn_output.weight"])

    def _qkv(self, il: int, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """q (T, H, hd), k and v (T, Hkv, hd) of layer ``il`` from the normed rows ``x``, before
        RoPE: projections, then the per-head q/k RMSNorm (glm4moe adds its biases here)."""
        w, p, T = self.w, f"blk.{il}.", x.shape[0]
        q, k, v = ops.matmuls(x, [w[p + "attn_q.weight"], w[p + "attn_k.weight"], w[p + "attn_v.weight"]])
        q = q.reshape(T, self.n_head, self.head_dim)
        k = k.reshape(T, self.n_head_kv, self.head_dim)
        v = v.reshape(T, self.n_head_kv, self.head_dim)
        q = ops.rms_norm(q, w[p + "attn_q_norm.weight"], self.eps)
        k = ops.rms_norm(k, w[p + "attn_k_norm.weight"], self.eps)
        return q, k, v

    def ffn_input(self, il: int, h: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(ops.rms_norm(h, self.w[f"blk.{il}.ffn_norm.weight"], self.eps))

    def route(self, il: int, cur: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        logits = ops.matmul(cur, self.w[f"blk.{il}.ffn_gate_inp.weight"])
        return ops.route_topk(logits, self.n_expert_used)

    def post_moe(self, il: int, h: np.ndarray, cur: np.ndarray, moe: np.ndarray) -> np.ndarray:
        return h + moe
