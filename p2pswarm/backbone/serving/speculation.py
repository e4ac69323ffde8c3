"""Exact speculative decoding: draft a few tokens, verify them all in one step, keep the prefix the
model itself would have produced.

Why: a decoding sequence pays one network round trip per layer for every token. A step that feeds
a sequence's sampled token *and* k drafted guesses after it computes k+1 positions for the price
of one step's round trips (their experts ride in the same one request per owner per layer); every
draft that equals the token the model then samples at its position is a token gained.

Exact, always: each verified position is computed exactly as a one-token decode step computes it
(:meth:`~p2pswarm.backbone.serving.runner.Backbone.forward_batch` with ``verify``), the token at each
position is sampled from that position's logits with the position's own random number
(:mod:`p2pswarm.backbone.serving.sampling`), and a draft is accepted only when it *equals* that token.
The first mismatch ends the step: the positions after it are dropped from every layer's state
(:meth:`~p2pswarm.backbone.serving.runner.Backbone.keep_positions`), bit-identical to never having fed
them. So greedy tokens and logits, and a seeded request's text, are the same with speculation on
or off.

``auto`` (the CLI's default) is ``mtp`` where the model has an MTP block (also on a backbone file
whose block's experts are on workers: the adaptive length below decides whether drafts pay),
otherwise ``off`` (:func:`auto_mode`; the log says which and why).

Drafters: ``ngram`` (prompt lookup: the tokens that followed the latest earlier occurrence of the
sequence's last n tokens, n = 3, 2, 1: free, and good wherever the output repeats its input or
itself). ``mtp``: the model's own multi-token-prediction block (:mod:`p2pswarm.backbone.serving.mtp`;
glm4moe, qwen35moe, deepseek2), refused with one line naming what the file has where the model has
none or its architecture's block is not implemented (:func:`check_mode`).

Adaptive length, by time (:class:`Costs`, :func:`choose_lengths`): a step that verifies k more
rows costs k times (the step's measured time per extra row + the measured time to draft a token)
and gains, for a sequence whose drafts pass at rate p, p + p^2 + ... + p^k expected tokens. Each
step the drafts are handed out one token at a time to the sequence whose next draft gains most,
while that gain per second beats the step's tokens per second so far: the choice that maximises
the step's expected tokens per second. So behind a WAN (a step is L round trips, a row is cheap)
sequences draft long; where a draft token costs a round trip of its own (the MTP block's experts on
a worker) against a cheap step, or in a compute-bound batch of many (every row costs the step its
arithmetic), they draft little or nothing. A sequence that drafts nothing for :data:`PROBE_EVERY`
steps (more where a draft token costs more than a step: probes take at most :data:`PROBE_SHARE` of
the time) drafts one token, so acceptance and costs are measured again; so does one sequence when
no sequence drafted for that many steps of the scheduler (short requests would never probe). Before a draft token's cost
is measured, a sequence drafts one token (a draft may be a round trip). A step of more than
:data:`MAX_SPECULATING` decoding sequences drafts nothing at all (no drafting thread hop either).
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from p2pswarm.errors import UserError

if TYPE_CHECKING:
    from p2pswarm.backbone.serving.mtp import MtpBlock

MODES = ("off", "ngram", "mtp")
NGRAM_MAX = 3  # longest suffix looked up
MAX_SPECULATING = 8  # decoding sequences in a step above which nobody drafts
PROBE_EVERY = 8  # a sequence that drafted nothing for so many steps drafts one token (re-measures) ...
PROBE_SHARE = 0.05  # ... or more steps, so that probing costs at most this share of the time
DECAY = 0.7  # weight of the past in a sequence's acceptance counts and in the step-cost fit
PRIOR_RATE, PRIOR_WEIGHT = 0.8, 2.0  # a new sequence's acceptance: as if 2 drafts were checked at 0.8


class SpeculationUnsupported(UserError):
    """``--speculate mtp`` on a model without MTP blocks (exit 2, one line)."""


def check_mode(mode: str, layout) -> None:
    """Refuse a mode the model cannot run, naming what its file has."""
    from p2pswarm.engine.arch import mtp_architectures

    if mode not in MODES:
        raise UserError(f"--speculate must be one of {', '.join(MODES)}, not {mode!r}")
    if mode == "mtp":
        arch = layout.arch
        n = int(layout.hparams.get("nextn_predict_layers", 0) or 0)
        if n and arch not in mtp_architectures():
            raise SpeculationUnsupported(
                f"--speculate mtp: {layout.path} has {n} MTP (NextN) block(s) ({arch}), but running them is "
                f"implemented for {', '.join(mtp_architectures())} only; use --speculate ngram")
        if not n:
            raise SpeculationUnsupported(
                f"--speculate mtp: {layout.path} ({arch}, {layout.n_layer} layers) has no MTP (NextN) block "
                f"(no {arch}.nextn_predict_layers); use --speculate ngram or off")


def auto_mode(layout) -> tuple[str, str]:
    """``--speculate auto`` (the default): ``mtp`` where the file has an MTP (NextN) block this
    code runs, else ``off``; with the reason, for the log. Why on by default, even on a backbone
    file whose block's experts are on workers (a draft token then costs a round trip to them): the
    verification is exact, and the draft length is chosen each step from the measured cost of a
    draft token and of a verified row against the step's time (:func:`choose_lengths`), so drafting
    stops (a probe token now and then) where it does not pay."""
    from p2pswarm.engine.arch import mtp_architectures

    n = int(layout.hparams.get("nextn_predict_layers", 0) or 0)
    name = getattr(layout.path, "name", layout.path)
    if not n:
        return "off", f"{name} ({layout.arch}) has no MTP (NextN) block"
    if layout.arch not in mtp_architectures():
        return "off", (f"{name} has {n} MTP block(s) ({layout.arch}), but running them is implemented for "
                       f"{', '.join(mtp_architectures())} only")
    if layout.n_layer - n not in layout.expert_tensors:
        return "mtp", (f"{name} has {n} MTP block(s) ({layout.arch}); its routed experts are on the workers, "
                       f"so each draft token costs a round trip: drafts only where the measured costs say they pay")
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
    costs: "Costs" = field(default_factory=lambda: Costs())  # measured step and draft times
    pool: "Adaptive" = field(default_factory=lambda: Adaptive())  # all sequences' recent acceptance
    idle: int = 0  # steps, over all sequences, since any sequence drafted (the scheduler's probe clock)

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
        dispatcher puts them: :func:`~p2pswarm.backbone.serving.mtp.block_for`) and have the backbone keep
        the hidden states it reads."""
        if self.mode != "mtp" or self.mtp is not None:
            return
        from p2pswarm.backbone.serving.mtp import block_for

        self.mtp = block_for(backbone)
        backbone.keep_hidden = True


class Adaptive:
    """One sequence's recent acceptance: the rate p at which its drafts pass, each draft position
    given that the ones before it passed (decayed counts, starting from a prior that decays with
    them: ``pool``'s rate, the recent acceptance of all sequences, else :data:`PRIOR_RATE`), and its
    steps without a draft (for the probe). Its observations feed ``pool`` too."""

    def __init__(self, pool: "Adaptive | None" = None):
        prior = PRIOR_RATE if pool is None else pool.rate
        self.passed = prior * PRIOR_WEIGHT  # decayed count of draft positions that passed
        self.tried = PRIOR_WEIGHT  # ... that were checked (the accepted ones and the first rejected one)
        self.idle = 0  # steps since it last drafted
        self.pool = pool

    @property
    def rate(self) -> float:
        return self.passed / self.tried

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        self.passed = DECAY * self.passed + accepted
        self.tried = DECAY * self.tried + accepted + (accepted < drafted)
        if self.pool is not None:
            self.pool.observe(drafted, accepted)


class Costs:
    """What the step and a draft cost, measured: seconds per drafted token (an EWMA) and a decayed
    least-squares fit of a step's seconds against its rows (``base_s + row_s * rows``). Why a fit:
    a verified row's price is the step's marginal time per row, which is near zero for a WAN-bound
    step and the per-row arithmetic for a compute-bound one; only steps of different row counts
    (prefill chunks, drafts, probes) tell it apart."""

    def __init__(self):
        self.draft_s: float | None = None  # seconds per drafted token
        self._drafts = 0  # drafter calls measured
        self._w = self._x = self._y = self._xx = self._xy = 0.0  # decayed sums of the fit

    def observe_draft(self, seconds: float, tokens: int) -> None:
        """One drafter call. The second call's time replaces the first's rather than blending with
        it: the first pays one-time costs (the MTP block's graphs built, its first requests), 70 ms
        against 3 ms a token after it on a local block, which an EWMA would carry for a short
        request's whole life, so that it drafted little where drafts are nearly free."""
        if tokens > 0:
            per = seconds / tokens
            self._drafts += 1
            if self.draft_s is None or self._drafts == 2:
                self.draft_s = per
            else:
                self.draft_s = DECAY * self.draft_s + (1 - DECAY) * per

    def observe_step(self, seconds: float, rows: int) -> None:
        d = DECAY
        self._w, self._x, self._y = d * self._w + 1, d * self._x + rows, d * self._y + seconds
        self._xx, self._xy = d * self._xx + rows * rows, d * self._xy + rows * seconds

    @property
    def row_s(self) -> float | None:
        """Seconds a step's one more row costs: the fit's slope, between 0 and the mean seconds per
        row (no base); None before two steps of different row counts."""
        if not self._w:
            return None
        mx, my = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mx * mx
        if var < 1e-6 * max(mx * mx, 1.0):
            return None
        slope = (self._xy / self._w - mx * my) / var
        return min(max(slope, 0.0), my / max(mx, 1.0))

    def step_s(self, rows: int) -> float | None:
        """The fit's seconds for a step of ``rows`` rows (the mean step where no slope is known yet)."""
        if not self._w:
            return None
        mx, my = self._x / self._w, self._y / self._w
        slope = self.row_s or 0.0
        return max(my + slope * (rows - mx), 1e-6)


def choose_lengths(rates: list[float], caps: list[int], costs: Costs, rows: int | None = None) -> list[int]:
    """Each sequence's draft length for a step of ``len(rates)`` decoding rows (module doc): drafts
    go one token at a time to the sequence whose next one gains most (p^(j+1) for its j+1-th), while
    that gain per second of what the token costs (a row + drafting it) beats the step's expected
    tokens per second so far. ``rows``: the step's rows without drafts (default: one per rate).
    Nothing measured yet: every sequence its cap (it measures), at most one token before a draft
    token's cost is known (it may be a round trip)."""
    ks = [0] * len(rates)
    t = costs.step_s(len(rates) if rows is None else rows)
    if t is None or costs.draft_s is None:
        return [c if costs.draft_s is not None else min(c, 1) for c in caps]
    cost = (costs.row_s or 0.0) + (costs.draft_s or 0.0)
    tokens = float(len(rates))
    while True:
        gains = [r ** (k + 1) if k < c else -1.0 for r, k, c in zip(rates, ks, caps)]
        i = max(range(len(gains)), key=gains.__getitem__, default=None)
        if i is None or gains[i] <= 0 or gains[i] * t <= tokens * cost:  # (gain/cost <= tokens/t)
            return ks
        ks[i] += 1
        tokens += gains[i]
        t += cost


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


def draft_lengths(spec: Speculation | None, decoding: list) -> dict[int, int]:
    """This step's draft length per sequence id (:func:`choose_lengths`, plus the probe), for the
    scheduler's ``decoding`` sequences that may draft (:func:`history`); only those > 0. Cheap (on
    the event loop): nothing is drafted yet. Nothing when speculation is off or the step is large."""
    if spec is None or not spec.on or len(decoding) > MAX_SPECULATING:
        return {}
    ready = [s for s in decoding if history(s) is not None]
    for s in ready:
        if s.adaptive is None:
            s.adaptive = Adaptive(spec.pool)
    caps = [max(0, min(spec.draft_max, s.params.max_tokens - s.n_out - 1)) for s in ready]
    ks = choose_lengths([s.adaptive.rate for s in ready], caps, spec.costs, rows=len(decoding))
    probe_every = probe_interval(spec.costs, len(decoding))
    out = {}
    for s, k, cap in zip(ready, ks, caps):
        a = s.adaptive
        a.idle = 0 if k else a.idle + 1
        if not k and a.idle >= probe_every and cap > 0:
            k, a.idle = 1, 0  # the probe: acceptance and the draft's cost, measured again
        if k > 0:
            out[s.sid] = k
    # The probe on the scheduler's clock as well: requests shorter than the interval never probe on
    # their own (a new sequence starts idle), so a draft cost measured once too high (a cold page
    # cache under the block's experts: seconds) would stop drafting for good; one sequence probes
    # when nobody drafted for the interval, so the estimate is measured again and decays.
    spec.idle = 0 if out else spec.idle + 1
    if not out and spec.idle >= probe_every:
        s, cap = max(zip(ready, caps), key=lambda sc: (sc[1] > 0, sc[0].adaptive.idle), default=(None, 0))
        if s is not None and cap > 0:
            out[s.sid], s.adaptive.idle, spec.idle = 1, 0, 0
    return out


def probe_interval(costs: Costs, rows: int) -> int:
    """Steps without a draft after which a sequence drafts one token: :data:`PROBE_EVERY`, or more
    where a draft token costs more than :data:`PROBE_SHARE` of PROBE_EVERY steps."""
    t = costs.step_s(rows)
    if t is None:
        return PROBE_EVERY
    cost = (costs.row_s or 0.0) + (costs.draft_s or 0.0)
    return max(PROBE_EVERY, math.ceil(cost / (PROBE_SHARE * t)))


def mtp_drafting(spec: Speculation | None, lengths: dict[int, int]) -> bool:
    """Whether :func:`plan_drafts` runs the MTP block this step (CPU work, and a round trip where
    its experts are on workers: the scheduler runs it off the event loop then, and skips the
    thread hop in a step where nobody drafts)."""
    return spec is not None and spec.mtp is not None and bool(lengths)


def plan_drafts(spec: Speculation | None, decoding: list, lengths: dict[int, int]) -> dict[int, list[int]]:
    """This step's drafts: sequence id -> drafted tokens, for the ``decoding`` sequences given a
    length by :func:`draft_lengths` (each drafter call timed: :class:`Costs`)."""
    if spec is None or not lengths:
        return {}
    out = {}
    for s in decoding:
        k = lengths.get(s.sid, 0)
        toks = history(s) if k else None
        if toks is None:
            continue
        t0 = time.perf_counter()
        if spec.drafter is None and spec.mtp is not None:
            draft = spec.mtp.draft(s.state, toks, k)
        else:
            draft = (spec.drafter or ngram_draft)(toks, k)
        spec.costs.observe_draft(time.perf_counter() - t0, k)
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
