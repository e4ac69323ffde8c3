"""The types a request crosses the backbone's layers in: what it asks (:class:`Params`) and what it
gets back, step by step (:class:`Step`, :class:`Rows`, :class:`Rewind`).

Why one module, at the bottom of ``backbone/``: the scheduler produces these, and the layers above
it (``generate``, ``completion``, ``http_api``, the commands) consume them. Defined in any of those
modules, the producer would import its consumer (``Step`` lived in ``generate.py``, which drives a
scheduler: an import cycle); here both import downwards only (tests/test_lint.py checks it)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from p2pswarm.backbone.dispatch.stats import DispatchStats
from p2pswarm.backbone.serving.sampling import Sampler


@dataclass
class Params:
    """What one request asks for; ``sampler`` defaults to greedy."""

    max_tokens: int = 16
    sampler: Sampler | None = None
    stop_at_eos: bool = True
    request_id: str | None = None  # named in logs (e.g. the HTTP completion id); default seq-N
    #: also hand out every step's logits rows, as :class:`Rows` (needs a scheduler with ``rows``)
    rows: bool = False


@dataclass
class Step:
    """One sampled token of a request, with what its step cost."""

    index: int
    token: int
    text: str  # the text this token completes ("" mid-way through a UTF-8 character)
    seconds: float
    dispatch: DispatchStats  # what this step's forward pass dispatched
    end: bool = False  # an end-of-generation token: the last step
    drafted: int = 0  # tokens drafted in the step this token opens (speculative decoding)
    accepted: bool = False  # this token is a draft the model confirmed


@dataclass(frozen=True)
class Rows:
    """Logits of the positions ``pos0 .. pos0 + len(logits) - 1`` of a ``Params(rows=True)``
    request. After a replay on ban the positions come again, from 0: a later :class:`Rows` for a
    position replaces the earlier one (equal where the position was clean)."""

    pos0: int
    logits: np.ndarray


@dataclass(frozen=True)
class Rewind:
    """The tokens from index ``keep`` on (of the ``sent`` a consumer has) were computed with
    outputs of ``worker``, since banned: they are withdrawn, and the steps that follow, from index
    ``keep``, replace them (replay on ban: :mod:`p2pswarm.backbone.serving.replay`)."""

    keep: int
    sent: int
    worker: str
