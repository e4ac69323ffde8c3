"""The model's own multi-token-prediction (MTP / NextN) block as the speculative drafter
(``--speculate mtp``): glm4moe and qwen35moe, as llama.cpp's ``llama_model_glm4_moe::graph_mtp`` and
``llama_model_qwen35moe::graph_mtp`` compute it.

Per position ``p`` (the trunk's hidden state ``h_p`` after the final ``output_norm``, as llama.cpp's
``t_h_nextn``, and the token ``t_{p+1}`` that followed it)::

    x      = eh_proj(concat(enorm(embed(t_{p+1})), hnorm(h_p)))   (embedding first)
    x      = x + attn_output(attention(q, k, v of attn_norm(x)))  (the block's own KV cache, position p)
    cur    = post_attention_norm(x)
    x      = x + (routed(cur) + shared_expert(cur))               (sigmoid router, as every MoE layer)
    h'     = shared_head_norm(x)
    logits = output(h')                                           (the trunk's output head, no output_norm)

qwen35moe's block is the same fusion and head around its own gated full-attention layer (whatever
``full_attention_interval`` says of its index: llama.cpp marks only trunk layers recurrent): q and
its sigmoid gate interleaved in ``attn_q``, q/k norms, IMROPE; softmax-routed experts plus the
sigmoid-gated shared expert; ``shared_head_norm`` (else ``output_norm``) before the output head.

Chained as llama.cpp chains it: draft 1 is the argmax of the logits at the sequence's last fed
position ``n-1`` (fed the just-sampled token ``t_n``); draft j+1 feeds draft j with the block's own
``h'`` at position ``n-1+j``.

Why it is exact anyway: a draft is a guess the verification step checks
(:mod:`p2pswarm.backbone.speculation`); the block never touches the trunk's state. Its own KV
cache holds one entry per trunk position whose next token is settled (``t_{p+1}`` sampled and
kept); the chained entries are dropped after drafting, so a rejected draft leaves nothing here
either. A replay starts from a fresh :class:`~p2pswarm.engine.state.SequenceState`, and so from an
empty block cache.

Where its routed experts run: on the backbone's local copy of the block's experts (the file's
``blk.{n_layer}.ffn_*_exps``), so a draft costs no round trip, in a bank of the replica's kernel
(:meth:`~p2pswarm.backbone.speculation.Speculation.attach`). A backbone file without them is
refused at start with one line.
"""
from __future__ import annotations

import numpy as np

from p2pswarm.engine import ops
from p2pswarm.engine.state import KVCache
from p2pswarm.errors import ModelFormatError, UserError

F32 = np.float32
ARCHS = ("glm4moe", "qwen35moe")  # where running the block is implemented


class HiddenRows:
    """A sequence's trunk hidden states (before the final norm) for the positions the block has
    not consumed yet: ``put`` at a step's first position overwrites what a rejected verification
    left after it."""

    def __init__(self):
        self.start = 0
        self.rows: np.ndarray | None = None

    def put(self, pos0: int, rows: np.ndarray) -> None:
        if self.rows is None or pos0 < self.start:
            self.start, self.rows = pos0, np.array(rows, dtype=F32)
            return
        keep = self.rows[:pos0 - self.start]
        self.rows = np.concatenate([keep, np.asarray(rows, dtype=F32)])

    def take(self, a: int, b: int) -> np.ndarray | None:
        """Rows of positions [a, b), or None if not all held."""
        if self.rows is None or a < self.start or b > self.start + len(self.rows):
            return None
        return self.rows[a - self.start:b - self.start]

    def drop_before(self, a: int) -> None:
        if self.rows is not None and a > self.start:
            self.rows = self.rows[a - self.start:]
            self.start = a


class MtpState:
    """One sequence's block state: its KV cache and how many positions it holds (settled ones)."""

    def __init__(self, model):
        self.kv = KVCache(model.n_head_kv, model.head_dim)
        self.fed = 0


class MtpBlock:
    """The NextN block of a glm4moe or qwen35moe model (module doc); ``bank``: where its routed
    experts run."""

    def __init__(self, model, bank):
        if model.arch not in ARCHS:
            raise UserError(f"--speculate mtp: running the MTP block of {model.arch} is not implemented "
                            f"(implemented: {', '.join(ARCHS)}); use --speculate ngram")
        if not getattr(model, "n_layer_nextn", 0):
            raise UserError(f"--speculate mtp: {model.layout.path} has no MTP (NextN) block")
        self.model, self.bank = model, bank
        self.il = il = model.n_layer
        self.p = p = f"blk.{il}."
        E, H, Hkv, hd, D = model.n_embd, model.n_head, model.n_head_kv, model.head_dim, model.n_expert
        self.qwen35 = model.arch == "qwen35moe"
        need = [("nextn.eh_proj.weight", (E, 2 * E)), ("nextn.enorm.weight", (E,)), ("nextn.hnorm.weight", (E,)),
                ("attn_norm.weight", (E,)), ("attn_q.weight", ((2 if self.qwen35 else 1) * H * hd, E)),
                ("attn_k.weight", (Hkv * hd, E)), ("attn_v.weight", (Hkv * hd, E)),
                ("attn_output.weight", (E, H * hd)), ("post_attention_norm.weight", (E,)),
                ("ffn_gate_inp.weight", (D, E))]
        # llama.cpp's qwen35moe block may leave out shared_head_norm (output_norm then); glm4moe's not
        self.head_norm = p + "nextn.shared_head_norm.weight"
        if self.qwen35:
            need += [("attn_q_norm.weight", (hd,)), ("attn_k_norm.weight", (hd,)), ("ffn_gate_inp_shexp.weight", (E,)),
                     ("ffn_gate_shexp.weight", None), ("ffn_up_shexp.weight", None), ("ffn_down_shexp.weight", None)]
            if not model.w.has(self.head_norm):
                self.head_norm = "output_norm.weight"
            else:
                need.append(("nextn.shared_head_norm.weight", (E,)))
        else:
            need += [("nextn.shared_head_norm.weight", (E,)), ("exp_probs_b.bias", (D,))]
        if not self.qwen35 and model.qkv_bias:
            need += [("attn_q.bias", (H * hd,)), ("attn_k.bias", (Hkv * hd,)), ("attn_v.bias", (Hkv * hd,))]
        if not self.qwen35 and model.qk_norm:
            need += [("attn_q_norm.weight", (hd,)), ("attn_k_norm.weight", (hd,))]
        if not self.qwen35 and model.n_expert_shared:
            need += [("ffn_gate_shexp.weight", None), ("ffn_up_shexp.weight", None), ("ffn_down_shexp.weight", None)]
        for name, shape in need:
            if not model.w.has(p + name):
                raise ModelFormatError(f"{model.layout.path}: MTP block tensor {p + name!r} is missing")
            got = tuple(model.w.shape(p + name))
            if shape is not None and got != shape and not (len(shape) == 1 and int(np.prod(got)) == shape[0]):
                raise ModelFormatError(f"{model.layout.path}: MTP block tensor {p + name!r} has shape {got}, "
                                       f"expected {shape}")
        if il not in model.layout.expert_tensors:
            raise ModelFormatError(f"{model.layout.path}: the MTP block has no routed-expert tensors "
                                   f"({p}ffn_*_exps.weight)")

    def forward(self, st: MtpState, tokens, hidden: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Feed positions ``st.fed ..`` (the tokens that followed them, and the trunk's normed hidden
        states there, or the block's own for a chained draft): (logits, h') per row."""
        from p2pswarm.backbone.runner import combine_outputs, expert_groups

        m, w, p, il = self.model, self.model.w, self.p, self.il
        T, pos0 = hidden.shape[0], st.fed
        e = ops.rms_norm(m.embed(np.asarray(tokens, dtype=np.int64)), w[p + "nextn.enorm.weight"], m.eps)
        hn = ops.rms_norm(hidden, w[p + "nextn.hnorm.weight"], m.eps)
        x = ops.matmul(np.ascontiguousarray(np.concatenate([e, hn], axis=1), dtype=F32), w[p + "nextn.eh_proj.weight"])
        a = ops.rms_norm(x, w[p + "attn_norm.weight"], m.eps)
        if self.qwen35:
            h = self._qwen35_layer(st, x, a, pos0)
            return ops.matmul(np.ascontiguousarray(h), w[m.output_name]).astype(F32, copy=False), h
        q, k, v = m._qkv(il, a)
        pos = np.arange(pos0, pos0 + T)
        q = ops.rope_neox(q, pos, m.n_rot, m.rope_base)
        k = ops.rope_neox(k, pos, m.n_rot, m.rope_base)
        keys, values = st.kv.append(k, v)
        st.fed += T
        att = ops.attention(q, keys, values, pos0).reshape(T, m.n_head * m.head_dim)
        x = x + ops.matmul(np.ascontiguousarray(att), w[p + "attn_output.weight"])
        cur = m.ffn_input(il, x)
        ids, wts = m.route(il, cur)
        groups = expert_groups(ids)
        moe = combine_outputs(ids, wts, groups, self.bank.forward_groups(il, cur, groups))
        x = m.post_moe(il, x, cur, moe)
        h = ops.rms_norm(x, w[p + "nextn.shared_head_norm.weight"], m.eps).astype(F32, copy=False)
        return ops.matmul(np.ascontiguousarray(h), w[m.output_name]).astype(F32, copy=False), h

    def _qwen35_layer(self, st: MtpState, x: np.ndarray, a: np.ndarray, pos0: int) -> np.ndarray:
        """qwen35moe's block after the fusion (``x``; ``a`` = attn_norm(x)): gated full attention on
        the block's KV cache, post_attention_norm, softmax-routed + sigmoid-gated shared expert, the
        head norm; returns h' (numpy's ops: a draft needs no bit-exactness, only llama.cpp's math)."""
        from p2pswarm.backbone.runner import combine_outputs, expert_groups
        from p2pswarm.engine.arch.qwen3moe import Qwen3MoE

        m, w, p, il = self.model, self.model.w, self.p, self.il
        T = x.shape[0]
        x = x + m._full_attention_rows(il, a, [(st.kv, pos0, T)])
        st.fed += T
        cur = np.ascontiguousarray(ops.rms_norm(x, w[p + "post_attention_norm.weight"], m.eps), dtype=F32)
        ids, wts = Qwen3MoE.route(m, il, cur)
        groups = expert_groups(ids)
        moe = combine_outputs(ids, wts, groups, self.bank.forward_groups(il, cur, groups))
        s = ops.swiglu_expert(cur, w[p + "ffn_gate_shexp.weight"], w[p + "ffn_up_shexp.weight"],
                              w[p + "ffn_down_shexp.weight"])
        wg = np.asarray(w[p + "ffn_gate_inp_shexp.weight"], dtype=F32).reshape(-1)
        s = s * ops.sigmoid(np.sum(cur * wg, axis=-1, keepdims=True))
        x = x + (moe + s)
        return ops.rms_norm(x, w[self.head_norm], m.eps).astype(F32, copy=False)

    def trunk_hidden(self, rows: np.ndarray) -> np.ndarray:
        """What the block reads of the trunk: its last hidden states after the final norm."""
        return ops.rms_norm(rows, self.model.w["output_norm.weight"], self.model.eps).astype(F32, copy=False)

    def draft(self, state, history: list[int], k: int) -> list[int]:
        """Up to ``k`` greedy drafts for a decoding sequence whose ``history`` is its fed tokens and
        the token just sampled (module doc): first the positions the block has not seen, then the
        chained drafts, whose cache entries are dropped after."""
        n = state.n_past
        if k <= 0 or len(history) != n + 1 or state.hidden is None:
            return []
        if state.mtp is None:
            state.mtp = MtpState(self.model)
        st = state.mtp
        rows = state.hidden.take(st.fed, n)
        if rows is None or st.fed >= n:
            return []
        logits, h = self.forward(st, history[st.fed + 1:n + 1], self.trunk_hidden(rows))
        state.hidden.drop_before(n)
        mark = st.kv.checkpoint()
        out = [int(np.argmax(logits[-1]))]
        while len(out) < k:
            logits, h = self.forward(st, out[-1:], h[-1:])
            out.append(int(np.argmax(logits[-1])))
        st.kv.restore(mark)
        st.fed = n
        return out
