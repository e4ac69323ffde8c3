"""Every script in bench/ still starts: ``--help`` prints its usage and exits 0.

Why: nothing else runs the benchmarks, and they reach into the package (its modules, sometimes a
private function they time), so a refactor can break one silently until a session needs its
numbers. Two did (bench_omp_wait after bench_vs_llama's ``--last-row``; bench_replay after the
dispatcher's split). ``--help`` imports the script and everything it imports at module level and
parses its arguments, which is where those breakages showed; the runs themselves are too long for
the suite. Each runs from a folder outside the checkout, as docs/benchmarks.md says to run A/B pairs.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
# modules the scripts import, not scripts
LIBRARIES = {"common.py", "cpu_groups.py", "soak_check.py", "soak_probes.py", "wan_swarm.py"}
SCRIPTS = sorted(p.name for p in BENCH.glob("*.py") if p.name not in LIBRARIES)


def test_the_list_of_libraries_is_current():
    """A script in LIBRARIES would escape the check: each one really has no ``__main__`` block."""
    for name in LIBRARIES:
        assert '__name__ == "__main__"' not in (BENCH / name).read_text(), name
    assert len(SCRIPTS) >= 50


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_bench_script_help(script, tmp_path):
    r = subprocess.run([sys.executable, str(BENCH / script), "--help"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == 0, f"{script} --help exited {r.returncode}:\n{out[-2000:]}"
    assert "Traceback" not in out, out[-2000:]
    assert out.strip(), f"{script} --help printed nothing"
