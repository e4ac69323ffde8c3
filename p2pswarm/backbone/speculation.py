"""Exact speculative decoding: draft a few tokens, verify them all in one step, keep the prefix the
model itself would have produced.

Why: a decoding sequence pays one network round trip per layer for every token. A step that feeds
a sequence's sampled token *and* k drafted guesses after it computes k+1 positions for the price
of one step's round trips (their experts ride in the same one request per owner per layer); every
draft that equals the token the model then samples at its position is a token gained.

Exact, always: each verified position is computed exactly as a one-token decode step computes it
(:meth:`~p2pswarm.backbone.runner.Backbone.forward_batch` with ``verify``), the token at each
position is sampled from that position's logits with the position's own random number
(:mod:`p2pswarm.backbone.sampling`), and a draft is accepted only when it *equals* that token.
The first mismatch ends the step: the positions after it are dropped from every layer's state
(:meth:`~p2pswarm.backbone.runner.Backbone.keep_positions`), bit-identical to never having fed
them. So greedy tokens and logits, and a seeded request's text, are the same with speculation on
or off.

``auto`` (the CLI's default) is ``mtp`` where the model has an MTP block, otherwise ``off``
(:func:`auto_mode`; the log says which and why).

Drafters: ``ngram`` (prompt lookup: the tokens that followed the latest earlier occurrence of the
sequence's last n tokens, n = 3, 2, 1: free, and good wherever the output repeats its input or
itself). ``mtp``: the model's own multi-token-prediction block (:mod:`p2pswarm.backbone.mtp`;
glm4moe, qwen35moe, deepseek2), refused with one line naming what the file has where the model has
none or its architecture's block is not implemented (:func:`check_mode`).

Adaptive length (:class:`Adaptive`): each sequence drafts up to ``draft_max`` tokens, one more
after a fully accepted draft and one more than it got accepted otherwise; when its recent
acceptance falls near zero it stops drafting and tries one token every :data:`PROBE_EVERY` steps.
A step of more than :data:`MAX_SPECULATING` decoding sequences drafts nothing: its dense work and
its bytes grow with the rows, and the round trip it would save is shared by the batch already.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from p2pswarm.errors import UserError

if TYPE_CHECKING:
    from p2pswarm.backbone.mtp import MtpBlock

MODES = ("off", "ngram", "mtp")
NGRAM_MAX = 3  # longest suffix looked up
MAX_SPECULATING = 8  # decoding sequences in a step above which nobody drafts
LOW_ACCEPTANCE = 0.1  # recent acceptance below which a sequence stops drafting ...
PROBE_EVERY = 8  # ... and drafts one token every so many steps to see whether it picked up
EWMA = 0.5  # weight of the latest verification in a sequence's recent acceptance


class SpeculationUnsupported(UserError):
    """``--speculate mtp`` on a model without MTP blocks (exit 2, one line)."""


def check_mode(mode: str, layout) -> None:
    """Refuse a mode the model cannot run, naming what its file has."""
    from p2pswarm.backbone.mtp import ARCHS

    if mode not in MODES:
        raise UserError(f"--speculate must be one of {', '.join(MODES)}, not {mode!r}")
    if mode == "mtp":
        arch = layout.arch
        n = int(layout.hparams.get("nextn_predict_layers", 0) or 0)
        if n and arch not in ARCHS:
            raise SpeculationUnsupported(
                f"--speculate mtp: {layout.path} has {n} MTP (NextN) block(s) ({arch}), but running them is "
                f"implemented for {', '.join(ARCHS)} only; use --speculate ngram")
        if not n:
            raise SpeculationUnsupported(
                f"--speculate mtp: {layout.path} ({arch}, {layout.n_layer} layers) has no MTP (NextN) block "
                f"(no {arch}.nextn_predict_layers); use --speculate ngram or off")


def auto_mode(layout) -> tuple[str, str]:
    """``--speculate auto`` (the default): ``mtp`` where the file has an MTP (NextN) block this
    code runs and holds the block's routed experts, else ``off``; with the reason, for the log.
    Why on by default: the block is in the file already, a draft costs no round trip (its experts
    run on the backbone's copy) and the verification is exact, so the only cost is a rejected
    draft's rows, which :class:`Adaptive` stops paying when the acceptance is low."""
    from p2pswarm.backbone.mtp import ARCHS

    n = int(layout.hparams.get("nextn_predict_layers", 0) or 0)
    name = getattr(layout.path, "name", layout.path)
    if not n:
        return "off", f"{name} ({layout.arch}) has no MTP (NextN) block"
    if layout.arch not in ARCHS:
        return "off", (f"{name} has {n} MTP block(s) ({layout.arch}), but running them is implemented for "
                       f"{', '.join(ARCHS)} only")
    if layout.n_layer - n not in layout.expert_tensors:
        return "off", f"{name} holds no routed experts of its MTP block (blk.{layout.n_layer - n}): a backbone file?"
    return "mtp", f"{name} has {n} MTP block(s) ({layout.arch})"


def ngram_draft(history: list[int], k: int, n_max: int = NGRAM_MAX) -> list[int]:
    """Up to ``k`` tokens: what followed the latest earlier occurrence of the last n tokens of
    ``history`` (the longest n <= ``n_max`` that occurred before), or none."""
    if k <= 0 or len(history) < 2:
        return []
    for n in range(min(n_max, len(history) - 1), 0, -1):
        tail = history[-n:]
        for start in range(len(history) - n - 1, -1, -1):
            if history[start:start + n] == tail:
                return list(history[start + n:start + n + k])
    return []


@dataclass
class Speculation:
    """A scheduler's speculation settings: ``mode`` (off, ngram, mtp) and ``draft_max`` (K).
    ``drafter(tokens, k)`` -> up to k drafted tokens replaces the mode's (tests drive the
    verification with drafts of a known acceptance)."""

    mode: str = "off"
    draft_max: int = 4
    drafter: Callable[[list[int], int], list[int]] | None = None
    mtp: "MtpBlock | None" = None  # mode mtp: the model's block, set by :meth:`attach`

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"speculate must be one of {MODES}")
        if self.draft_max < 1:
            raise ValueError("draft_max must be >= 1")

    @property
    def on(self) -> bool:
        return self.mode != "off"

    def attach(self, backbone) -> None:
        """Mode mtp: build the model's MTP block (its routed experts computed where the backbone's
        dispatcher puts them: :func:`~p2pswarm.backbone.mtp.block_for`) and have the backbone keep
        the hidden states it reads."""
        if self.mode != "mtp" or self.mtp is not None:
            return
        from p2pswarm.backbone.mtp import block_for

        self.mtp = block_for(backbone)
        backbone.keep_hidden = True


class Adaptive:
    """One sequence's draft length, from its recent acceptance (module doc)."""

    def __init__(self, draft_max: int):
        self.draft_max = draft_max
        self.k = draft_max
        self.rate = 1.0  # EWMA of accepted / drafted
        self.idle = 0  # steps without drafting since the acceptance fell low

    def length(self) -> int:
        if self.rate >= LOW_ACCEPTANCE:
            return self.k
        self.idle += 1
        return 1 if self.idle % PROBE_EVERY == 0 else 0

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        self.rate = (1 - EWMA) * self.rate + EWMA * accepted / drafted
        self.k = min(self.draft_max, drafted + 1) if accepted == drafted else max(1, accepted + 1)


@dataclass
class SpecStats:
    """Counts over a scheduler's life: verification steps, tokens drafted, drafts accepted."""

    verifications: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    def as_dict(self, spec: "Speculation | None") -> dict:
        """For /health and the status page."""
        return {"mode": spec.mode if spec is not None else "off",
                "draft_max": spec.draft_max if spec is not None else None,
                "verifications": self.verifications, "drafted": self.drafted, "accepted": self.accepted,
                "acceptance": None if self.acceptance is None else round(self.acceptance, 4)}


def history(s) -> list[int] | None:
    """A decoding sequence's tokens so far, for its drafter; None where it must not draft (a replay
    re-deriving kept tokens: it is fed them one by one, as the first time)."""
    return None if s.replay.forced > s.n_out else s.prompt + s.replay.tokens


def mtp_drafting(spec: Speculation | None, decoding: list) -> bool:
    """Whether :func:`plan_drafts` may run the MTP block this step (CPU work: the scheduler runs
    it off the event loop then, and skips the thread hop otherwise, e.g. in a step of many)."""
    return spec is not None and spec.mtp is not None and 0 < len(decoding) <= MAX_SPECULATING


def plan_drafts(spec: Speculation | None, decoding: list) -> dict[int, list[int]]:
    """This step's drafts: sequence id -> drafted tokens, for the scheduler's ``decoding``
    sequences that may draft (:func:`history`). Nothing when speculation is off or the step is
    large."""
    if spec is None or not spec.on or len(decoding) > MAX_SPECULATING:
        return {}
    out = {}
    for s in decoding:
        toks = history(s)
        if toks is None:
            continue
        if s.adaptive is None:
            s.adaptive = Adaptive(spec.draft_max)
        k = min(s.adaptive.length(), s.params.max_tokens - s.n_out - 1)
        if k <= 0:
            draft = []
        elif spec.drafter is None and spec.mtp is not None:
            draft = spec.mtp.draft(s.state, toks, k)
        else:
            draft = (spec.drafter or ngram_draft)(toks, k)
        if draft:
            out[s.sid] = draft
    return out


def accept(emit, s, logits, draft: list[int], stats: SpecStats, rows=None) -> int:
    """Sample the verified positions in order (``emit(s, row, drafted, expected)`` samples, hands
    out the token, marking it accepted when it equals ``expected``, and sets ``s.next_token``),
    while each sampled token equals the next draft; returns how many positions to keep (the fed
    token plus the drafts accepted). ``rows(i)``: called before position i's token is handed out
    (a request for every position's logits gets exactly the kept positions' rows)."""
    n = len(draft)
    i = 0
    while True:
        if rows is not None:
            rows(i)
        emit(s, logits[i], n if i == 0 else 0, draft[i] if i < n else None)
        if s.done or s.cancelled or i == n or s.next_token != draft[i]:
            break
        i += 1
    stats.verifications += 1
    stats.drafted += n
    stats.accepted += i
    s.adaptive.observe(n, i)
    return i + 1
