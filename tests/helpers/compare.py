"""The all-position logits check every architecture's test makes against llama.cpp."""
from __future__ import annotations

import numpy as np


def tolerance(ref: np.ndarray) -> float:
    """The issue's bound for F32 models: 1e-4 + 2e-5 * max|logit|."""
    return 1e-4 + 2e-5 * float(np.abs(ref).max())


def assert_logits_close(label: str, ref: np.ndarray, **ours: np.ndarray) -> None:
    """Each of ``ours`` (by what it is: prefill=..., decode=...) within :func:`tolerance` of
    llama.cpp's ``ref`` and with its argmax at every position; prints the distances."""
    tol = tolerance(ref)
    assert np.abs(ref).max() > 1.0  # real logits, not a degenerate model
    for what, got in ours.items():
        diff = float(np.abs(got - ref).max())
        print(f"{label} {what}: max |diff| vs llama.cpp {diff:.3g} (tolerance {tol:.3g})")
        assert diff <= tol, f"{label} {what}: max |diff| {diff} > {tol}"
        assert (np.argmax(got, axis=1) == np.argmax(ref, axis=1)).all()
