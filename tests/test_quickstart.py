"""docs/quickstart.md runs as written: its ```bash blocks, in order, in one bash session
(as a user pastes them into one terminal), in an empty folder with an empty home. Real processes
throughout: bootstrap, three workers, a backbone with the OpenAI API and the official client."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "quickstart.md"


def blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)```", PAGE.read_text(), re.S)


def test_quickstart_is_linked_first_from_the_readme():
    readme = (ROOT / "README.md").read_text()
    first_link = re.search(r"\]\(([^)]+\.md)\)", readme).group(1)
    assert first_link == "docs/quickstart.md", first_link
    assert len(blocks()) >= 8


def page_env(tmp_path: Path) -> dict[str, str]:
    """An empty home, and `p2pswarm` and `python` on PATH as this checkout's (PYTHONPATH) and this
    interpreter: wrappers that exec ``sys.executable``, never a symlink to it, which would resolve
    to the base interpreter outside the venv (and miss the venv's packages, `openai` among them)."""
    home = tmp_path / "home"
    home.mkdir()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, args in (("p2pswarm", " -m p2pswarm.cli"), ("python", "")):
        (bin_dir / name).write_text(f'#!/bin/sh\nexec "{sys.executable}"{args} "$@"\n')
        (bin_dir / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("P2PSWARM_")}
    env.update(HOME=str(home), PATH=f"{bin_dir}:{env['PATH']}", PYTHONPATH=str(ROOT))
    return env


# stop whatever is still running if a step fails, so the test never leaves nodes behind
PRELUDE = "set -eo pipefail\ntrap 'kill $(jobs -p) 2>/dev/null || true' EXIT\n"


def test_page_python_is_the_venvs(tmp_path):
    """The page's `python` is this interpreter with its packages (the venv's, where there is one)."""
    env = page_env(tmp_path)
    out = subprocess.run(["bash", "-c", "python -c 'import sys; print(sys.prefix)'"], env=env, text=True,
                         capture_output=True, check=True).stdout.strip()
    assert out == sys.prefix


@pytest.mark.slow
def test_quickstart_gives_up_when_a_node_fails(tmp_path):
    """A bootstrap that cannot start (here: a live one already holds its key, as after a first run
    left running) ends the page's wait within its bound, with the node's own reason, never a hang."""
    from helpers.procs import Proc

    env = page_env(tmp_path)
    swarm = tmp_path / "swarm"
    swarm.mkdir()
    live = Proc(["bootstrap", "--listen", "/ip4/127.0.0.1/tcp/0", "--identity", str(swarm / "boot.key")],
                tmp_path / "live-boot.log", env)
    try:
        t0 = time.monotonic()
        proc = subprocess.run(["bash", "-c", PRELUDE + "cd swarm\n" + blocks()[1]], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
        took = time.monotonic() - t0
    finally:
        live.stop()
    assert proc.returncode != 0 and took < 70, (took, proc.stdout, proc.stderr)
    assert "boot did not start; the end of boot.log:" in proc.stderr, proc.stderr
    assert "boot.key" in proc.stderr and "--identity" in proc.stderr, proc.stderr  # the node's one line


@pytest.mark.slow
def test_quickstart_runs_as_written(tmp_path):
    env = page_env(tmp_path)
    script = PRELUDE + "\n".join(blocks())
    try:
        proc = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=420, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        logs = "".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted((tmp_path / "swarm").glob("*.log")))
        raise AssertionError(f"the quickstart hung:\n{exc.stdout}\n{logs}") from None
    logs = "".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted((tmp_path / "swarm").glob("*.log")))
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}\n{logs}"
    out = proc.stdout
    assert "status page: http://127.0.0.1:" in out
    assert re.search(r'"fallbacks":0', out), out  # /health after the workers were found
    # the two workers, and the --auto one once the backbone's next refresh (every 30 s) has found it
    assert re.search(r"^p2pswarm_workers [23]\.0$", out, re.M), out
    assert re.search(r"^workers: 3 peers \(3 live", out, re.M), out  # swarm-status looks itself
    assert "live" in out and "Traceback" not in proc.stderr + logs
    assert "enrolled in" in out
    assert len(re.findall(r" 1 +\d+ +\d+ ok$", out, re.M)) == 2, out  # a receipt for each worker that computed
