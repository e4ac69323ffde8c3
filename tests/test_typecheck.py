"""mypy in its default mode finds nothing in the packages listed here (configured in
pyproject.toml: dependencies without type information are ``Any``).

Why these: the network and market layers carry the untrusted input (peers' records, tokens,
frames) and the most ``None``-able state, which is where a type checker finds what tests miss.
Slow: mypy needs ~10-30 s per package on a busy two-core machine (its cache makes reruns faster).
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.parametrize("pkg", ["p2pswarm/net", "p2pswarm/market"])
def test_mypy_finds_nothing(pkg):
    proc = subprocess.run([sys.executable, "-m", "mypy", pkg], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert "Success: no issues found" in proc.stdout, proc.stdout[-2000:]
