"""The backbone's layer loop: dense path here, routed experts wherever the dispatcher sends them.

    h = embed(tokens)
    for each layer:
        h   = pre_moe(h)                 attention + residual (KV cache)
        cur = ffn_input(h)               the rows the experts see
        ids, w = route(cur)              authoritative, once, here
        partials = await dispatcher.run(layer, cur, groups(ids))
        h   = post_moe(h, combine(ids, w, partials))
    logits = output(h)

``combine`` sums the weighted expert outputs in top-k order, never in arrival order: that is what
makes the split run bit-identical to the monolithic one whatever the timing. The numpy work runs in
a thread (``trio.to_thread``) so the event loop keeps streams flowing.
"""
from __future__ import annotations

from functools import partial

import numpy as np
import trio

from p2pswarm.backbone.dispatch import Dispatcher, Groups
from p2pswarm.engine.state import SequenceState

F32 = np.float32


def expert_groups(ids: np.ndarray) -> Groups:
    """(expert, token indices) for every expert chosen in a layer; experts ascending, tokens in order."""
    return [(int(e), np.nonzero((ids == e).any(axis=1))[0]) for e in np.unique(ids)]


def combine(ids: np.ndarray, weights: np.ndarray, groups: Groups, partials: dict[int, np.ndarray]) -> np.ndarray:
    """sum_j w[t, j] * out_{ids[t, j]}[t], summed ((y0 + y1) + y2) + ... in top-k order."""
    T, k = ids.shape
    n_embd = next(iter(partials.values())).shape[1]
    y = np.empty((k, T, n_embd), dtype=F32)
    for e, rows in groups:
        t_idx, j_idx = np.nonzero(ids == e)
        y[j_idx, t_idx] = partials[e][np.searchsorted(rows, t_idx)]
    y *= weights.T[:, :, None]
    acc = y[0].copy()
    for j in range(1, k):
        acc += y[j]
    return acc


class Backbone:
    """Runs a model's dense path and drives a dispatcher; one instance serves many sequences."""

    def __init__(self, model, dispatcher: Dispatcher):
        self.model = model
        self.dispatcher = dispatcher

    def new_state(self) -> SequenceState:
        return self.model.new_state()

    async def forward(self, tokens, state: SequenceState) -> np.ndarray:
        """Feed tokens (all at once) after what ``state`` has seen; logits (T, n_vocab) for each."""
        m = self.model
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        pos0 = state.n_past
        h = await trio.to_thread.run_sync(m.embed, tokens)
        for il in range(m.n_layer):
            h, cur, ids, w = await trio.to_thread.run_sync(partial(self._pre, il, h, state, pos0))
            groups = expert_groups(ids)
            partials = await self.dispatcher.run(il, cur, groups)
            h = await trio.to_thread.run_sync(partial(self._post, il, h, cur, ids, w, groups, partials))
        state.n_past += len(tokens)
        return await trio.to_thread.run_sync(m.output, h)

    def _pre(self, il, h, state, pos0):
        m = self.model
        h = m.pre_moe(il, h, state, pos0)
        cur = m.ffn_input(il, h)
        ids, w = m.route(il, cur)
        return h, cur, ids, w

    def _post(self, il, h, cur, ids, w, groups, partials):
        return self.model.post_moe(il, h, cur, combine(ids, w, groups, partials))

    async def logits(self, tokens, *, decode: bool = False, on_step=None) -> np.ndarray:
        """All-position logits of a fresh sequence: one prefill, or token by token (``decode``).
        ``on_step(done, total)`` is called after each decode step (progress, long runs)."""
        state = self.new_state()
        if not decode:
            return await self.forward(tokens, state)
        rows = []
        for i, t in enumerate(tokens):
            rows.append(await self.forward([t], state))
            if on_step is not None:
                on_step(i + 1, len(tokens))
        return np.concatenate(rows, axis=0)
