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
