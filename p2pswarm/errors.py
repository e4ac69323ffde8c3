"""Expected failures, each explained in one line (never a traceback), sorted by whose fault they are.

Why three kinds: the fix differs. An input error (:class:`UserError`: a bad flag, a file that is
not a model, a request the model cannot take) is the caller's to fix: HTTP 400, CLI exit 2. A peer
error (:class:`PeerError`: a worker that failed or lied about its frames) is nobody's input: the
backbone falls back, and what reaches a client is a 502 naming the peer in the log. An internal
error (:class:`InternalError`: the installed py-libp2p lacks what a patch replaces) is ours or the
installation's: HTTP 500. The CLI prints every :class:`SwarmError` as one line; it exits 2 for
input errors and 1 for the others.
"""
from __future__ import annotations


class SwarmError(Exception):
    """An expected failure, explained in one line: the base of the three kinds below."""


class UserError(SwarmError):
    """A problem with the input or the environment the user controls: HTTP 400, CLI exit 2."""


class PeerError(SwarmError):
    """A peer (a worker, a backbone, whoever sent the frame) failed or misbehaved: HTTP 502, logged
    with the peer. ``peer`` names it where the raiser knows it."""

    def __init__(self, *args: object, peer: str | None = None):
        super().__init__(*args)
        self.peer = peer


class InternalError(SwarmError):
    """Our fault or the installation's (a dependency lacks what we rely on): HTTP 500."""


class ModelFormatError(UserError):
    """A GGUF file that is corrupt, truncated, of an unknown architecture, or missing a key/tensor."""


class FrameError(PeerError):
    """A wire frame that is malformed or larger than the configured maximum."""


class WorkerError(PeerError):
    """A worker that failed, died, timed out or refused us; the backbone may fall back."""


class WorkerSlow(WorkerError):
    """A worker that did not answer within its deadline (a few times its recent p99): hung or
    overloaded, maybe not dead. The backbone falls back and tries it again soon."""


class UnitsUnavailable(PeerError):
    """Routed experts that no live owner holds and the backbone could not get into its expert cache
    (every replica gone, no peer holding the bytes): HTTP 503, naming the units."""

    def __init__(self, *args: object, layer: int = -1, experts: list[int] | None = None):
        super().__init__(*args)
        self.layer = layer
        self.experts = list(experts or [])


def clip(text: object, limit: int = 300) -> str:
    """``text`` on one line, cut to about ``limit`` characters at a word boundary with " [...]".

    Why: a message that quotes what a peer sent, or a library's exception, must stay one bounded
    line; but cutting mid-word (or mid-peer-id) made messages unreadable. Our own sentences and ids
    are never clipped: only text we do not control."""
    one = " ".join(str(text).split())
    if len(one) <= limit:
        return one
    cut = one.rfind(" ", 0, limit + 1)
    return (one[:cut] if cut > limit // 2 else one[:limit]) + " [...]"


# ---- trio's exception groups -------------------------------------------------------------------
# Nurseries wrap whatever crosses them in (nested) exception groups; callers want the error their
# own code raised. One unwrapper, three views of it.


def leaves(exc: BaseException) -> list[BaseException]:
    """Every non-group exception inside ``exc`` (``[exc]`` when it is not a group), depth first."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for e in exc.exceptions for leaf in leaves(e)]
    return [exc]


def first_error(group: BaseException) -> BaseException:
    """The first leaf of a (nested) exception group."""
    return leaves(group)[0]


def single_error(group: BaseException) -> BaseException:
    """The one error inside (nested) single-member exception groups, or the group itself when it
    holds several."""
    found = leaves(group)
    return found[0] if len(found) == 1 else group
