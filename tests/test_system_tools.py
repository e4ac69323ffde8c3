"""tests/system_tools.py, the README test command's installer: where it cannot install it says once
exactly what to install, and a test needing a missing program fails with that line (no skip)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import system_tools

SCRIPT = Path(system_tools.__file__)


def test_without_apt_it_says_once_what_to_install(tmp_path):
    """A machine with none of the programs and no apt-get: one line naming every package, exit 0
    (the suite still runs; the tests that need them fail with the same advice)."""
    empty = tmp_path / "bin"
    empty.mkdir()
    proc = subprocess.run([sys.executable, str(SCRIPT)], env={"PATH": str(empty)}, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and proc.stdout == "", proc
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert "cannot install (no apt-get on this machine)" in lines[0]
    every = list(dict.fromkeys(pkg for pkg, _why in system_tools.TOOLS.values()))
    assert lines[0].endswith(f"as root: {system_tools.install_line(every)}"), lines[0]
    for pkg in ("nftables", "chromium", "chromium-driver", "qemu-user-static", "debootstrap", "nodejs"):
        assert f" {pkg}" in lines[0], lines[0]


def test_a_test_needing_a_missing_program_fails_with_the_line(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(pytest.fail.Exception) as info:
        system_tools.require("nft", "ip")
    msg = str(info.value)
    assert msg == ("not installed: nft, ip; as root: apt-get install -y nftables iproute2 "
                   "(python tests/system_tools.py does it)"), msg


def test_ci_runs_exactly_the_readme_test_command():
    """.ci/run installs nothing itself and runs the README's second set-up line, read from the
    README (so the two cannot drift apart)."""
    root = SCRIPT.parent.parent
    readme = (root / "README.md").read_text()
    first_block = readme.split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    assert first_block[1] == "pip install -e '.[test]' && python tests/system_tools.py && python -m pytest -q"
    ci = (root / ".ci" / "run").read_text()
    assert "apt-get" not in ci and "pip install" not in ci
    extract = next(line for line in ci.splitlines() if line.startswith("cmd=$("))
    got = subprocess.run(["bash", "-c", f'{extract} && printf %s "$cmd"'], cwd=root, capture_output=True,
                         text=True, check=True).stdout
    assert got == first_block[1]
