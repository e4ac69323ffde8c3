"""The model's own multi-token-prediction (MTP / NextN) block as the speculative drafter
(``--speculate mtp``), as llama.cpp's ``graph_mtp`` of each architecture computes it, for the
architectures whose dense path implements :class:`~p2pswarm.contracts.MtpModel`
(:func:`p2pswarm.engine.arch.mtp_architectures`).

Per position ``p`` (the trunk's hidden state ``h_p`` after the final ``output_norm``, as llama.cpp's
``t_h_nextn``, and the token ``t_{p+1}`` that followed it)::

    x      = eh_proj(concat(enorm(embed(t_{p+1})), hnorm(h_p)))   (embedding first)
    x      = x + attn_output(attention(q, k, v of attn_norm(x)))  (the block's own KV cache, position p)
    cur    = post_attention_norm(x)
    x      = x + (routed(cur) + shared_expert(cur))               (sigmoid router, as every MoE layer)
    h'     = shared_head_norm(x)
    logits = output(h')                                           (the trunk's output head, no output_norm)

The layer between the fusion and the head is the architecture's own
(:class:`~p2pswarm.contracts.MtpModel`, in its package under ``engine/arch/``: glm4moe's is the
above; deepseek2's is one full deepseek2 layer on the block's own MLA latent cache, with
``nextn.embed_tokens`` / ``nextn.shared_head_head`` where the file has them; qwen35moe's is its
gated full-attention layer with the sigmoid-gated shared expert). This module names none of them:
a model whose class implements the protocol has a block that runs.

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
from p2pswarm.contracts import MtpModel
from p2pswarm.engine import ops
from p2pswarm.engine.arch import mtp_architectures
from p2pswarm.errors import ModelFormatError, UnitsUnavailable, UserError, WorkerError

log = logging.getLogger("p2pswarm.backbone")

F32 = np.float32


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
    """One sequence's block state: its attention cache (the architecture's: a KV cache, deepseek2's
    MLA latent cache) and how many positions it holds (settled ones)."""

    def __init__(self, model: MtpModel):
        self.kv = model.mtp_cache()
        self.fed = 0


class MtpBlock:
    """The NextN block of a model whose dense path implements :class:`~p2pswarm.contracts.MtpModel`
    (module doc); ``bank``: where its routed experts run (``forward_groups``)."""

    def __init__(self, model, bank):
        if not isinstance(model, MtpModel):
            raise UserError(f"--speculate mtp: running the MTP block of {model.arch} is not implemented "
                            f"(implemented: {', '.join(mtp_architectures())}); use --speculate ngram")
        if not model.mtp_blocks():
            raise UserError(f"--speculate mtp: {model.layout.path} has no MTP (NextN) block")
        self.model, self.bank = model, bank
        self.il = il = model.n_layer
        self.p = p = f"blk.{il}."
        E = model.n_embd
        ends = model.mtp_ends(il)
        self.embed_name, self.head_name, self.head_norm = ends.embed, ends.head, ends.head_norm
        need: list[tuple[str, tuple[int, ...] | None]] = [
            (p + "nextn.eh_proj.weight", (E, 2 * E)), (p + "nextn.enorm.weight", (E,)),
            (p + "nextn.hnorm.weight", (E,)), *ends.need]
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

    def forward(self, st: MtpState, tokens, hidden: np.ndarray, *,
                last_only: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Feed positions ``st.fed ..`` (the tokens that followed them, and the trunk's normed hidden
        states there, or the block's own for a chained draft): (logits, h') per row, or of the last
        row only with ``last_only`` (what :meth:`draft` reads: the earlier rows then go through the
        block's attention, which their cache entries need, and no further: no MoE, no head norm,
        no lm head, whose 248k-row vocabulary at the 122B is the block's largest mat-mul)."""
        m, w, p, il = self.model, self.model.w, self.p, self.il
        emb = np.ascontiguousarray(w[self.embed_name][np.asarray(tokens, dtype=np.int64)], dtype=F32)
        e = ops.rms_norm(emb, w[p + "nextn.enorm.weight"], m.eps)
        hn = ops.rms_norm(hidden, w[p + "nextn.hnorm.weight"], m.eps)
        x = ops.matmul(np.ascontiguousarray(np.concatenate([e, hn], axis=1), dtype=F32), w[p + "nextn.eh_proj.weight"])
        x = m.mtp_layer(il, st.kv, x, st.fed, self._routed, last_only=last_only)
        st.fed += hidden.shape[0]
        h = ops.rms_norm(x, w[self.head_norm], m.eps).astype(F32, copy=False)
        return ops.matmul(np.ascontiguousarray(h), w[self.head_name]).astype(F32, copy=False), h

    def _routed(self, cur: np.ndarray, ids: np.ndarray, wts: np.ndarray) -> np.ndarray:
        """The block's routed experts on :attr:`bank`, combined in top-k order."""
        groups = expert_groups(ids)
        return combine_outputs(ids, wts, groups, self.bank.forward_groups(self.il, cur, groups))

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
            logits, h = self.forward(st, history[st.fed + 1:n + 1], self.trunk_hidden(rows), last_only=True)
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
                logits, h = self.forward(st, out[-1:], h[-1:], last_only=True)
                out.append(int(np.argmax(logits[-1])))
        except (UnitsUnavailable, WorkerError) as exc:  # the chain ends here; what it has stands
            log.info("MTP chained draft cut short: %s", exc)
        st.kv.restore(mark)
        st.fed = n
        return out
