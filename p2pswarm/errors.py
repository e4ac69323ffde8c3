"""Errors the user can cause and fix: each is printed as one line, never as a traceback."""
from __future__ import annotations


class UserError(Exception):
    """A problem with the input or the environment, explained in one line."""


class ModelFormatError(UserError):
    """A GGUF file that is corrupt, truncated, of an unknown architecture, or missing a key/tensor."""


class FrameError(UserError):
    """A wire frame that is malformed or larger than the configured maximum."""


class WorkerError(UserError):
    """A worker that failed, died, timed out or refused us; the backbone may fall back."""


class WorkerSlow(WorkerError):
    """A worker that did not answer within its deadline (a few times its recent p99): hung or
    overloaded, maybe not dead. The backbone falls back and tries it again soon."""


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
