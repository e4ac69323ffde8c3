"""p2pswarm/settings.py is the one reader of the P2PSWARM_* environment.

What is checked: no other module of the package reads a P2PSWARM_* variable from os.environ;
docs/configuration.md lists every variable settings defines; a malformed value is a one-line
UserError naming it (also through the CLI: exit 2, no traceback); unset means the default.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from p2pswarm import settings
from p2pswarm.errors import UserError

from conftest import assert_one_line_error, run_cli

REPO = Path(__file__).resolve().parent.parent
ENV_READ = re.compile(r"(environ(\.get|\.setdefault)?\s*[\[(]|getenv\()\s*[\"']P2PSWARM_")


def test_only_settings_reads_the_environment():
    offenders = []
    for path in sorted([*(REPO / "p2pswarm").rglob("*.py"), *(REPO / "relay").rglob("*.py")]):
        if path.name == "settings.py" and path.parent.name == "p2pswarm":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if ENV_READ.search(line) or "P2PSWARM_TEST_" in line:
                offenders.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
    assert offenders == []


def test_every_variable_is_documented():
    doc = (REPO / "docs" / "configuration.md").read_text()
    assert len(settings.ALL) >= 16
    missing = [v.name for v in settings.ALL if f"`{v.name}`" not in doc]
    assert missing == []


@pytest.mark.parametrize("var,text,match", [
    (settings.THREADS, "x", "P2PSWARM_THREADS='x': is not an integer"),
    (settings.THREADS, "0", "must be >= 1"),
    (settings.EXPERT_CACHE_MB, "lots", "is not an integer"),
    (settings.KERNEL, "cuda", "unknown kernel"),
    (settings.PROGRESS_AFTER, "-1", "must be >= 0"),
    (settings.GRAPH_CACHE_MB, "-5", "P2PSWARM_GRAPH_CACHE_MB='-5': must be >= 0"),
    (settings.GRAPH_CACHE_MB, "lots", "is not an integer"),
    (settings.WORKER_GRAPH_CACHE_MB, "-2", "P2PSWARM_WORKER_GRAPH_CACHE_MB='-2': must be >= 0"),
    (settings.WORKER_GRAPH_CACHE_MB, "16MB", "is not an integer"),
    (settings.SCRATCH_MB, "-1", "P2PSWARM_SCRATCH_MB='-1': must be >= 0"),
    (settings.SCRATCH_MB, "2GiB", "is not an integer"),
    (settings.WIRE_CODEC_FAST_MBPS, "fast", "P2PSWARM_WIRE_CODEC_FAST_MBPS='fast': is not a number"),
    (settings.WIRE_CODEC_FAST_MBPS, "-1", "must be >= 0"),
])
def test_malformed_values_are_one_line_errors(monkeypatch, var, text, match):
    monkeypatch.setenv(var.name, text)
    with pytest.raises(UserError, match=re.escape(match)):
        var.get()


def test_defaults_and_parsing(monkeypatch, tmp_path):
    for v in (settings.THREADS, settings.KERNEL, settings.POPULATE, settings.GC_FREEZE, settings.HOME):
        monkeypatch.delenv(v.name, raising=False)
    assert (settings.THREADS.get(), settings.KERNEL.get(), settings.POPULATE.get(), settings.GC_FREEZE.get()) == \
        (None, "auto", True, True)
    monkeypatch.setenv("P2PSWARM_THREADS", "3")
    monkeypatch.setenv("P2PSWARM_KERNEL", " GGML ")
    monkeypatch.setenv("P2PSWARM_POPULATE", "off")
    monkeypatch.setenv("P2PSWARM_NO_GC_FREEZE", "1")
    monkeypatch.setenv("P2PSWARM_HOME", str(tmp_path / "h"))
    assert (settings.THREADS.get(), settings.KERNEL.get(), settings.POPULATE.get(), settings.GC_FREEZE.get()) == \
        (3, "ggml", False, False)
    assert settings.home_dir() == tmp_path / "h"
    monkeypatch.setenv("P2PSWARM_CACHE", str(tmp_path / "c"))
    assert settings.cache_dir("shards") == tmp_path / "c" / "shards" and (tmp_path / "c" / "shards").is_dir()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert settings.cache_dir("portable", create=False, per_user=True) == tmp_path / "xdg" / "p2pswarm" / "portable"


@pytest.mark.slow
def test_bad_value_through_the_cli(tiny_f32):
    proc = run_cli("logits", str(tiny_f32), "--tokens", "1,2", "--out", str(tiny_f32.parent / "never.npy"), env={"P2PSWARM_THREADS": "many",
                                                                             "P2PSWARM_KERNEL": "ggml"})
    assert_one_line_error(proc, "P2PSWARM_THREADS='many': is not an integer")


@pytest.mark.slow
def test_bad_graph_cache_size_through_the_cli(tiny_f32):
    out = tiny_f32.parent / "never-graphs.npy"
    proc = run_cli("logits", str(tiny_f32), "--tokens", "1,2", "--out", str(out),
                   env={"P2PSWARM_GRAPH_CACHE_MB": "-1", "P2PSWARM_KERNEL": "ggml"})
    assert_one_line_error(proc, "P2PSWARM_GRAPH_CACHE_MB='-1': must be >= 0")
    assert not out.exists()


@pytest.mark.slow
def test_bad_worker_graph_cache_size_through_the_cli(shards):
    proc = run_cli("worker", "--shard", str(shards[0]), "--listen", "127.0.0.1:0",
                   env={"P2PSWARM_WORKER_GRAPH_CACHE_MB": "lots", "P2PSWARM_KERNEL": "ggml"})
    assert_one_line_error(proc, "P2PSWARM_WORKER_GRAPH_CACHE_MB='lots': is not an integer")


@pytest.mark.slow
def test_bad_codec_threshold_stops_a_backbone_at_start(tiny_f32):
    """Read per request once links are measured: a bad value must stop the node at start, not mid-run."""
    proc = run_cli("node", "--role", "backbone", "--model", str(tiny_f32), env={"P2PSWARM_WIRE_CODEC_FAST_MBPS": "fast"})
    assert_one_line_error(proc, "P2PSWARM_WIRE_CODEC_FAST_MBPS='fast': is not a number")
