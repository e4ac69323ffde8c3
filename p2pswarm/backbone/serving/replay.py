"""Replay on ban (docs/market.md): the one place that decides what a sequence keeps when a worker
whose unverified outputs it used is banned, and that counts and logs it.

Sampled verification catches a lying worker only after some of its unchecked rows were used. Each
sequence's state records, per remote worker, the first position computed from that worker's
unverified outputs (``SequenceState.taint``, filled by the runner). When such a worker is banned
the sequence is rewound to a fresh state and the positions before that one are fed again the way
they were fed the first time (the same bits), so the result ends equal to the monolithic run's.

Three paths rewind: the scheduler (every served request), :func:`p2pswarm.backbone.serving.generate.generate`
(one sequence, ``p2pswarm generate``) and :func:`p2pswarm.backbone.serving.generate.sequence_logits`. They
share :func:`banned_taint`, :func:`tokens_kept`, :class:`ReplayStats` and, for the two that sample
tokens, :class:`TokenReplay` (which tokens stand, which are re-derived and checked instead of
sent again, and the :class:`Rewind` a consumer gets).
"""
from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from p2pswarm.backbone.serving.items import Rewind

log = logging.getLogger("p2pswarm.backbone")


def banned_taint(state: Any, banned) -> tuple[int, str] | None:
    """``(position, peer)``: the first position of ``state`` computed from the unverified outputs of
    a peer in ``banned`` (the earliest over such peers), or None when the sequence is clean."""
    hit = None
    for peer, pos in state.taint.items():
        if peer in banned and (hit is None or pos < hit[0]):
            hit = (pos, peer)
    return hit


def tokens_kept(pos: int, n_prompt: int, n_tokens: int) -> int:
    """How many of a sequence's ``n_tokens`` generated tokens stand when its first tainted position
    is ``pos``: token k is sampled from the row of position ``n_prompt - 1 + k`` (the last prompt
    token's row gives token 0), so the tokens from rows before ``pos`` are kept."""
    return max(0, min(n_tokens, pos - n_prompt + 1))


@dataclass
class ReplayStats:
    """Sequences rewound because a worker whose unverified rows they used was banned, the rows fed
    again to get back to where their taint began, the tokens already handed to a client that the
    replay withdrew, and sequences that had *finished* before the ban (nothing left to rewind: their
    output may differ from monolithic; logged with request id)."""

    sequences: int = 0
    rows: int = 0
    tokens_withdrawn: int = 0
    finished_unfixable: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)

    def note(self, who: str, pos: int, peer: str, *, rows: int, kept: int | None = None, sent: int = 0) -> None:
        """Count one sequence rewound to ``pos`` (``rows`` fed again to get back there; of the
        ``sent`` tokens a client had, those from ``kept`` on withdrawn) and log it."""
        self.sequences += 1
        self.rows += rows
        tail = ""
        if kept is not None:
            self.tokens_withdrawn += max(0, sent - kept)
            tail = f" (keeping {kept} of its {sent} tokens)"
        log.warning("replaying %s from position %d%s: worker %s, whose unverified outputs it used, was banned",
                    who, pos, tail, peer)


class TokenReplay:
    """What a sampling sequence needs to be replayed: the tokens handed out so far, the sampler as
    it was before any draw (a replay restarts it, so it draws the same numbers), and while a replay
    runs, how many of the kept tokens are still to be re-derived (``forced``: checked against the
    kept ones, not handed out again)."""

    def __init__(self, sampler, n_prompt: int):
        self.sampler0 = copy.deepcopy(sampler)
        self.n_prompt = n_prompt
        self.tokens: list[int] = []
        self.forced = 0
        self.peer = ""  # the banned worker the last replay was for

    def rewind(self, state, banned, stats: ReplayStats, who: str) -> tuple[Any, Rewind | None] | None:
        """None when ``state`` is clean. Else the replay starts: ``(a fresh sampler, the Rewind to
        hand the consumer, or None when it had none of the withdrawn tokens)``; the caller feeds
        the prompt again on a fresh state."""
        hit = banned_taint(state, banned)
        if hit is None:
            return None
        pos, peer = hit
        sent = len(self.tokens)  # what the consumer has (a replay under way re-derives some of them)
        keep = tokens_kept(pos, self.n_prompt, sent)
        stats.note(who, pos, peer, rows=self.n_prompt + keep, kept=keep, sent=sent)
        self.peer = peer
        withdrawn = Rewind(keep, sent, peer) if sent > keep else None
        del self.tokens[keep:]
        self.forced = keep
        return copy.deepcopy(self.sampler0), withdrawn

    def rederive(self, index: int, token: int, stats: ReplayStats, who: str) -> tuple[bool, Rewind | None]:
        """Token ``index`` sampled again: ``(True, None)`` when it is a kept token re-derived equal
        (not handed out again); ``(False, None)`` when it is new; ``(False, Rewind)`` when the kept
        tokens were not what the clean run gives (never, with honest replicas): the new token
        stands, the consumer takes back the rest."""
        if index >= self.forced:
            return False, None
        if token == self.tokens[index]:
            return True, None
        log.warning("%s: replay re-derived token %d as %d, not %d", who, index, token, self.tokens[index])
        stats.tokens_withdrawn += len(self.tokens) - index
        back = Rewind(index, len(self.tokens), self.peer)
        del self.tokens[index:]
        self.forced = index
        return False, back


def fold_taint(taint: dict[str, np.ndarray], bounds: np.ndarray, states: list[Any],
               pos0: list[int]) -> None:
    """Record in each sequence's state the first position whose computation used a remote peer's
    unverified outputs (``SequenceState.taint``): from row masks over the step's rows (any
    layer) to positions of each sequence (its span of rows starts at ``bounds[i]``, position
    ``pos0[i]``). Positions before it never depended on those outputs (the model is causal)."""
    for peer, mask in taint.items():
        rows = np.flatnonzero(mask)
        if not len(rows):
            continue
        seq = np.searchsorted(bounds, rows, side="right") - 1
        first_seq, first_at = np.unique(seq, return_index=True)  # rows ascend: the first is the least
        for i, r in zip(first_seq.tolist(), rows[first_at].tolist()):
            st = states[i]
            pos = pos0[i] + r - int(bounds[i])
            if pos < st.taint.get(peer, pos + 1):
                st.taint[peer] = pos
