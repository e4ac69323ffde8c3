"""mypy, in its default mode (no --strict flags), over the packages listed: 0 errors.

Why per package: each case reports the errors of its own package only (``--follow-imports=silent``:
the modules it imports are read for their types, and their own errors belong to their own case),
so a package is added here once it is clean, and a new error names the package that has it.
Configuration: ``[tool.mypy]`` in pyproject.toml."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.parametrize("pkg", ["p2pswarm/net", "p2pswarm/market", "p2pswarm/backbone", "p2pswarm/worker",
                                 "p2pswarm/relay", "p2pswarm/commands",
                                 "p2pswarm/model", "p2pswarm/engine"])
def test_mypy_default_mode_is_clean(pkg):
    proc = subprocess.run([sys.executable, "-m", "mypy", "--follow-imports=silent", "--no-incremental", pkg],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "Success: no issues found" in proc.stdout
