"""What a one-graph layer computed beyond its ``h``, kept for the calls that follow it.

Why: under the ggml kernel a layer's graph (:mod:`p2pswarm.engine.ggml_attention`,
:mod:`p2pswarm.engine.ggml_layers`) also computes ``post_attention_norm(h)`` (the experts' input)
and what that feeds besides the routed experts (the router's logits, a shared expert), so a
decode step runs one graph per layer instead of three. The backbone then asks ``ffn_input(il,
h)`` and ``route(il, cur)`` for that ``h`` / ``cur``, or, where the router is not row-invariant,
for each sequence's slice of them: both are served from what was kept, with the bits the graph
gave them. Shared by the architectures with layer graphs (qwen35moe, gpt-oss).
"""
from __future__ import annotations

import numpy as np

from p2pswarm.engine import ggml_attention

F32 = np.float32


class KeptLayerCalls:
    """Mixin: the last ``KEPT_CALLS`` layer calls' ``(il, h, cur, extras)``, newest first."""

    #: how many layer calls' results are kept (pipelined micro-batches interleave their layers)
    KEPT_CALLS = 4
    _kept: list | tuple = ()

    def _keep(self, il: int, h: np.ndarray, cur: np.ndarray, extras: dict) -> None:
        self._kept = [(il, h, cur, extras), *self._kept[: self.KEPT_CALLS - 1]]

    def keep_rounds(self, il: int, before: list, calls: list[tuple[np.ndarray, np.ndarray]], h: np.ndarray) -> None:
        """One layer's ``pre_moe_batch`` ran as several calls (a verification step's rounds,
        :meth:`p2pswarm.backbone.runner.Backbone.forward_batch`): ``calls`` = (rows of ``h`` the call
        computed, the ``h`` it returned). Keep their kept results as ONE call over ``h`` (each op
        row-wise: the same bits), so ``ffn_input`` / ``route`` / the shared expert find them; the
        rounds' own entries are dropped and the entries kept ``before`` them stay."""
        parts = []
        for idx, out in calls:
            got = next((k for k in self._kept if k[0] == il and k[1] is out), None)
            if got is None:
                return  # a call without a layer graph (numpy): nothing to serve
            parts.append((idx, got))
        cur = np.empty(h.shape, F32)
        names = set.intersection(*(set(k[3]) for _, k in parts))
        extras = {n: None for n in names}
        for idx, k in parts:
            cur[idx] = k[2]
            for n in names:
                v = k[3][n]
                if extras[n] is None:
                    extras[n] = np.empty((h.shape[0], *v.shape[1:]), v.dtype)
                extras[n][idx] = v
        mine = {id(k) for _, k in parts}
        rest = [k for k in [*self._kept, *before] if id(k) not in mine]
        seen: set[int] = set()
        rest = [k for k in rest if not (id(k) in seen or seen.add(id(k)))]
        self._kept = [(il, h, cur, extras), *rest[: self.KEPT_CALLS - 1]]

    def _kept_for(self, il: int, x: np.ndarray, which: int):
        """The kept layer call of layer ``il`` whose ``h`` (``which`` 1) or ``cur`` (2) ``x`` is, or
        holds whole rows of; None if there is none (then the caller computes it alone)."""
        for kept in self._kept:
            if kept[0] == il and rows_of(x, kept[which]):
                return kept
        return None

    def _kept_extra(self, il: int, cur: np.ndarray, name: str) -> np.ndarray | None:
        """``extras[name]`` (``"logits"``, ``"shared"``) the layer graph computed for these rows of
        ``cur``; None where none was kept for them."""
        kept = self._kept_for(il, cur, 2) if self._kept else None
        if kept is None or name not in kept[3]:
            return None
        return rows_in(cur, kept[2], kept[3][name])

    def _graph_ffn_input(self, il: int, runner, h: np.ndarray) -> np.ndarray | None:
        """ggml's post_attention_norm of ``h``, computed once per layer call for all its rows.

        The layer's graph computes it with the layer (``pre_moe_batch`` keeps the pair); the
        backbone then asks for it for that ``h``, or for each sequence's slice of it: both are
        served from what was kept. Rows of any other array (e.g. the per-sequence pre_moe results
        concatenated) are normed by one graph over the whole array they are a slice of, kept in
        turn. The op is row-wise, so a row's bits do not depend on which rows were normed with it.
        None where the norm's weight is not F32 (then numpy's)."""
        kept = self._kept_for(il, h, 1)
        if kept is None:
            base = h.base if isinstance(h.base, np.ndarray) and rows_of(h, h.base) else h
            normed = ggml_attention.post_attention_norm(self, runner, il, base)
            if normed is None:
                return None
            self._keep(il, base, normed, {})
            kept = self._kept[0]
        return rows_in(h, kept[1], kept[2], copy=True)


def rows_in(x: np.ndarray, full: np.ndarray, values: np.ndarray, copy: bool = False) -> np.ndarray:
    """The rows of ``values`` (one per row of ``full``) that belong to ``x``, a run of rows of
    ``full`` (see :func:`rows_of`)."""
    if x is full:
        return values
    start = (x.ctypes.data - full.ctypes.data) // (4 * full.shape[1])
    got = values[start:start + x.shape[0]]
    return got.copy() if copy else got


def rows_of(h: np.ndarray, full: np.ndarray) -> bool:
    """Whether ``h`` is ``full`` or a run of whole rows of it (both C-contiguous float32 (T, E))."""
    if h is full:
        return True
    if (full.ndim != 2 or h.ndim != 2 or full.dtype != F32 or h.dtype != F32 or h.shape[1] != full.shape[1]
            or not (h.flags.c_contiguous and full.flags.c_contiguous)):
        return False
    row = 4 * full.shape[1]
    off = h.ctypes.data - full.ctypes.data
    return off >= 0 and off % row == 0 and off // row + h.shape[0] <= full.shape[0]
