"""The model's own multi-token-prediction (MTP / NextN) block as the speculative drafter
(``--speculate mtp``): glm4moe, qwen35moe and deepseek2, as llama.cpp's
``llama_model_glm4_moe::graph_mtp``, ``llama_model_qwen35moe::graph_mtp`` and
``llama_model_deepseek2::graph_mtp`` compute it.

Per position ``p`` (the trunk's hidden state ``h_p`` after the final ``output_norm``, as llama.cpp's
``t_h_nextn``, and the token ``t_{p+1}`` that followed it)::

    x      = eh_proj(concat(enorm(embed(t_{p+1})), hnorm(h_p)))   (embedding first)
    x      = x + attn_output(attention(q, k, v of attn_norm(x)))  (the block's own KV cache, position p)
    cur    = post_attention_norm(x)
    x      = x + (routed(cur) + shared_expert(cur))               (sigmoid router, as every MoE layer)
    h'     = shared_head_norm(x)
    logits = output(h')                                           (the trunk's output head, no output_norm)

deepseek2's block (DeepSeek-V3/R1 carry one) is the same fusion and head around one full deepseek2
layer: Multi-head Latent Attention on the block's own latent cache (``attn_q_a``/``attn_q_b``, the
compressed KV row and its decoupled YaRN-roped key, ``attn_k_b``/``attn_v_b``), ``ffn_norm``, the
sigmoid (or softmax) group-limited router with ``exp_probs_b``, routed + shared experts. Where the
file has them, ``nextn.embed_tokens`` replaces the token embedding and ``nextn.shared_head_head``
the output head, and a missing ``nextn.shared_head_norm`` is ``output_norm``, as llama.cpp reads
them.

qwen35moe's block is the same fusion and head around its own gated full-attention layer (whatever
``full_attention_interval`` says of its index: llama.cpp marks only trunk layers recurrent): q and
its sigmoid gate interleaved in ``attn_q``, q/k norms, IMROPE; softmax-routed experts plus the
sigmoid-gated shared expert; ``shared_head_norm`` (else ``output_norm``) before the output head.

Chained as llama.cpp chains it: draft 1 is the argmax of the logits at the sequence's last fed
position ``n-1`` (fed the just-sampled token ``t_n``); draft j+1 feeds draft j with the block's own
``h'`` at position ``n-1+j``.

Why it is exact anyway: a draft is a guess the verification step checks
(:mod:`p2pswarm.backbone.serving.speculation`); the block never touches the trunk's state. Its own KV
cache holds one entry per trunk position whose next token is settled (``t_{p+1}`` sampled and
kept); the chained entries are dropped after drafting, so a rejected draft leaves nothing here
either. A replay starts from a fresh :class:`~p2pswarm.engine.state.SequenceState`, and so from an
empty block cache.

Where its routed experts run: :attr:`MtpBlock.bank` (anything with ``forward_groups``), which
:func:`block_for` makes a :class:`DispatchedExperts`: per unit as the dispatcher routes any layer's,
with its hot-expert rule (``Dispatcher.run_groups_from_thread``): on the backbone's own copy (its
full file, or its expert cache) when that is faster than the owner's round trip, so a draft then
costs no round trip; else on the worker that owns it (shards and workers hold and advertise the
block's layer like any other). A draft whose units no live owner holds is skipped, never an error.
"""
from __future__ import annotations

import logging

import numpy as np

from p2pswarm.backbone.serving.combine import combine_outputs, expert_groups
from p2pswarm.engine import ops
from p2pswarm.engine.arch.deepseek2.mla import LatentCache
from p2pswarm.engine.state import KVCache
from p2pswarm.errors import ModelFormatError, UnitsUnavailable, UserError, WorkerError

log = logging.getLogger("p2pswarm.backbone")

F32 = np.float32
ARCHS = ("glm4moe", "qwen35moe", "deepseek2")  # where running the block is implemented


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


class DispatchedExperts:
    """The MTP block's routed experts through the backbone's dispatcher, from the drafting thread
    (the scheduler drafts in a worker thread: :meth:`~p2pswarm.backbone.dispatch.dispatcher.Dispatcher.
    run_groups_from_thread` routes on its event loop and computes local plans in the thread):
    per unit, the backbone's own copy when it holds the unit and is not slower than the owner's
    round trip (the dispatcher's hot-expert rule, for this layer whatever ``--hot-experts`` says:
    every draft waits for the round trips it makes), else the worker that owns it. A monolithic
    backbone computes them in the calling thread. ``groups``: how many it was asked for (tests
    compare it with the dispatcher's counts)."""

    def __init__(self, dispatcher):
        self.dispatcher = dispatcher
        self.groups = 0

    def forward_groups(self, layer: int, cur: np.ndarray, groups) -> list[np.ndarray]:
        if not groups:
            return []
        self.groups += len(groups)
        d = self.dispatcher
        return d.run_groups_local(layer, cur, groups) if d.all_local else d.run_groups_from_thread(layer, cur, groups)


def block_for(backbone) -> "MtpBlock":
    """``backbone``'s MTP block, its routed experts where the dispatcher puts them
    (:class:`DispatchedExperts`); one line if the model has none or its block cannot run."""
    return MtpBlock(backbone.model, DispatchedExperts(backbone.dispatcher))


class MtpState:
    """One sequence's block state: its KV cache (deepseek2: its MLA latent cache) and how many
    positions it holds (settled ones)."""

    def __init__(self, model):
        self.kv: KVCache | LatentCache = (LatentCache(model.kv_lora_rank + model.n_rot) if model.arch == "deepseek2"
                                          else KVCache(model.n_head_kv, model.head_dim))
        self.fed = 0


class MtpBlock:
    """The NextN block of a glm4moe, qwen35moe or deepseek2 model (module doc); ``bank``: where its
    routed experts run (``forward_groups``)."""

    def __init__(self, model, bank):
        if model.arch not in ARCHS:
            raise UserError(f"--speculate mtp: running the MTP block of {model.arch} is not implemented "
                            f"(implemented: {', '.join(ARCHS)}); use --speculate ngram")
        if not getattr(model, "n_layer_nextn", 0):
            raise UserError(f"--speculate mtp: {model.layout.path} has no MTP (NextN) block")
        self.model, self.bank = model, bank
        self.il = il = model.n_layer
        self.p = p = f"blk.{il}."
        E, V = model.n_embd, model.n_vocab
        self.qwen35 = model.arch == "qwen35moe"
        self.mla = model.arch == "deepseek2"
        need: list[tuple[str, tuple[int, ...] | None]] = [
            (p + "nextn.eh_proj.weight", (E, 2 * E)), (p + "nextn.enorm.weight", (E,)),
            (p + "nextn.hnorm.weight", (E,))]
        # llama.cpp's qwen35moe and deepseek2 blocks may leave out shared_head_norm (output_norm then)
        self.head_norm = p + "nextn.shared_head_norm.weight"
        if (self.qwen35 or self.mla) and not model.w.has(self.head_norm):
            self.head_norm = "output_norm.weight"
        else:
            need.append((self.head_norm, (E,)))
        self.embed_name, self.head_name = "token_embd.weight", model.output_name
        if self.mla:  # deepseek2: the whole layer as the trunk's are checked, and the optional head tensors
            need += model.layer_tensors(il)
            if model.w.has(p + "nextn.embed_tokens.weight"):
                self.embed_name = p + "nextn.embed_tokens.weight"
                need.append((self.embed_name, (V, E)))
            if model.w.has(p + "nextn.shared_head_head.weight"):
                self.head_name = p + "nextn.shared_head_head.weight"
                need.append((self.head_name, (V, E)))
        else:
            need += [(p + n, shape) for n, shape in self._attention_moe_tensors()]
        for name, shape in need:
            if not model.w.has(name):
                raise ModelFormatError(f"{model.layout.path}: MTP block tensor {name!r} is missing")
            got = tuple(model.w.shape(name))
            if shape is not None and got != shape and not (len(shape) == 1 and int(np.prod(got)) == shape[0]):
                raise ModelFormatError(f"{model.layout.path}: MTP block tensor {name!r} has shape {got}, "
                                       f"expected {shape}")
        if il not in model.layout.expert_tensors:
            raise ModelFormatError(f"{model.layout.path}: the MTP block has no routed-expert tensors "
                                   f"({p}ffn_*_exps.weight)")

    def _attention_moe_tensors(self) -> list[tuple[str, tuple[int, ...] | None]]:
        """glm4moe's and qwen35moe's block layer: its tensors (without the ``blk.N.`` prefix)."""
        model = self.model
        E, H, Hkv, hd, D = model.n_embd, model.n_head, model.n_head_kv, model.head_dim, model.n_expert
        need: list[tuple[str, tuple[int, ...] | None]] = [
            ("attn_norm.weight", (E,)), ("attn_q.weight", ((2 if self.qwen35 else 1) * H * hd, E)),
            ("attn_k.weight", (Hkv * hd, E)), ("attn_v.weight", (Hkv * hd, E)),
            ("attn_output.weight", (E, H * hd)), ("post_attention_norm.weight", (E,)),
            ("ffn_gate_inp.weight", (D, E))]
        if self.qwen35:
            return need + [("attn_q_norm.weight", (hd,)), ("attn_k_norm.weight", (hd,)),
                           ("ffn_gate_inp_shexp.weight", (E,)), ("ffn_gate_shexp.weight", None),
                           ("ffn_up_shexp.weight", None), ("ffn_down_shexp.weight", None)]
        need.append(("exp_probs_b.bias", (D,)))
        if model.qkv_bias:
            need += [("attn_q.bias", (H * hd,)), ("attn_k.bias", (Hkv * hd,)), ("attn_v.bias", (Hkv * hd,))]
        if model.qk_norm:
            need += [("attn_q_norm.weight", (hd,)), ("attn_k_norm.weight", (hd,))]
        if model.n_expert_shared:
            need += [("ffn_gate_shexp.weight", None), ("ffn_up_shexp.weight", None), ("ffn_down_shexp.weight", None)]
        return need

    def forward(self, st: MtpState, tokens, hidden: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Feed positions ``st.fed ..`` (the tokens that followed them, and the trunk's normed hidden
        states there, or the block's own for a chained draft): (logits, h') per row."""
        m, w, p, il = self.model, self.model.w, self.p, self.il
        T, pos0 = hidden.shape[0], st.fed
        emb = np.ascontiguousarray(w[self.embed_name][np.asarray(tokens, dtype=np.int64)], dtype=F32)
        e = ops.rms_norm(emb, w[p + "nextn.enorm.weight"], m.eps)
        hn = ops.rms_norm(hidden, w[p + "nextn.hnorm.weight"], m.eps)
        x = ops.matmul(np.ascontiguousarray(np.concatenate([e, hn], axis=1), dtype=F32), w[p + "nextn.eh_proj.weight"])
        if self.qwen35:
            h = self._qwen35_layer(st, x, pos0)
        else:
            if self.mla:  # x + MLA(attn_norm(x)) on the block's latent cache
                x = m.mla_rows(il, np.ascontiguousarray(x, dtype=F32), [(st.kv, pos0, T)])
            else:
                x = x + self._attention(st, ops.rms_norm(x, w[p + "attn_norm.weight"], m.eps), pos0)
            st.fed += T
            cur = m.ffn_input(il, x)
            ids, wts = m.route(il, cur)
            groups = expert_groups(ids)
            moe = combine_outputs(ids, wts, groups, self.bank.forward_groups(il, cur, groups))
            x = m.post_moe(il, x, cur, moe)
            h = ops.rms_norm(x, w[self.head_norm], m.eps).astype(F32, copy=False)
        return ops.matmul(np.ascontiguousarray(h), w[self.head_name]).astype(F32, copy=False), h

    def _attention(self, st: MtpState, a: np.ndarray, pos0: int) -> np.ndarray:
        """glm4moe's block attention (``a`` = attn_norm(x)) on the block's KV cache: its output."""
        m, T = self.model, a.shape[0]
        q, k, v = m._qkv(self.il, a)
        pos = np.arange(pos0, pos0 + T)
        q = ops.rope_neox(q, pos, m.n_rot, m.rope_base)
        k = ops.rope_neox(k, pos, m.n_rot, m.rope_base)
        assert isinstance(st.kv, KVCache)  # (deepseek2's is a latent cache: mla_rows)
        keys, values = st.kv.append(k, v)
        att = ops.attention(q, keys, values, pos0).reshape(T, m.n_head * m.head_dim)
        return ops.matmul(np.ascontiguousarray(att), m.w[self.p + "attn_output.weight"])

    def _qwen35_layer(self, st: MtpState, x: np.ndarray, pos0: int) -> np.ndarray:
        """qwen35moe's block after the fusion (``x``): gated full attention on the block's KV
        cache, post_attention_norm, softmax-routed + sigmoid-gated shared expert, the
        head norm; returns h' (numpy's ops: a draft needs no bit-exactness, only llama.cpp's math)."""
        from p2pswarm.engine.arch.qwen3moe import Qwen3MoE

        m, w, p, il = self.model, self.model.w, self.p, self.il
        T = x.shape[0]
        a = ops.rms_norm(x, w[p + "attn_norm.weight"], m.eps)
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
        fed, settled = st.fed, st.kv.checkpoint()
        try:
            logits, h = self.forward(st, history[st.fed + 1:n + 1], self.trunk_hidden(rows))
        except (UnitsUnavailable, WorkerError) as exc:  # a draft is optional: none this step, the block as it was
            st.kv.restore(settled)
            st.fed = fed
            log.info("MTP draft skipped: %s", exc)
            return []
        state.hidden.drop_before(n)
        mark = st.kv.checkpoint()
        out = [int(np.argmax(logits[-1]))]
        try:
            while len(out) < k:
                logits, h = self.forward(st, out[-1:], h[-1:])
                out.append(int(np.argmax(logits[-1])))
        except (UnitsUnavailable, WorkerError) as exc:  # the chain ends here; what it has stands
            log.info("MTP chained draft cut short: %s", exc)
        st.kv.restore(mark)
        st.fed = n
        return out
