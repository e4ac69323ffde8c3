"""ruff (configured in pyproject.toml: pyflakes' checks and unused noqa) over the whole tree finds nothing; tests share code only through tests/helpers/."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_ruff_finds_nothing():
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "p2pswarm", "relay", "tests", "bench", "native"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_no_test_module_imports_another():
    """Shared test code lives in tests/helpers/ (or conftest.py): a test module importing another
    one runs that module's fixtures and module-level set-up twice, and couples unrelated tests."""
    import re

    offenders = [f"{p.name}:{i}: {line.strip()}" for p in sorted((REPO / "tests").glob("*.py"))
                 for i, line in enumerate(p.read_text().splitlines(), 1)
                 if re.match(r"\s*(from|import) test_\w+", line)]
    assert not offenders, offenders
