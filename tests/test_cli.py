"""The commands a user types, run as real processes: logits, generate, demo, and their refusals."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import assert_one_line_error, run_cli

TOKENS = "11,22,33,44,55,66,77,88,99,110,121,132,143,154,165,176,187,198,209,220"


def test_logits_command_split_equals_monolithic(tiny_f32, tmp_path):
    outs = {}
    for workers, decode in ((0, False), (3, False), (0, True), (2, True)):
        out = tmp_path / f"l{workers}{decode}.npy"
        args = ["logits", str(tiny_f32), "--tokens", TOKENS, "--out", str(out), "--workers", str(workers)]
        proc = run_cli(*args, *(["--decode"] if decode else []), check=True)
        assert f"{workers} workers" in proc.stdout
        outs[(workers, decode)] = np.load(out)
    assert outs[(0, False)].shape == (20, outs[(0, False)].shape[1]) and outs[(0, False)].dtype == np.float32
    assert np.array_equal(outs[(0, False)], outs[(3, False)])
    assert np.array_equal(outs[(0, True)], outs[(2, True)])
    assert not list(tmp_path.glob(".*partial*"))


@pytest.mark.parametrize("args,needle", [
    (["--tokens", "1,x,3"], "bad --tokens"),
    (["--tokens", "1,2,999999"], "token id 999999 out of range"),
    (["--tokens", ""], "--tokens is empty"),
    (["--tokens", "1,2", "--workers", "99"], "cannot split 16 experts among 99 workers"),
    (["--tokens", "1,2", "--workers", "-1"], "--workers must be >= 0"),
])
def test_logits_refusals(tiny_f32, tmp_path, args, needle):
    out = tmp_path / "l.npy"
    proc = run_cli("logits", str(tiny_f32), *args, "--out", str(out))
    assert_one_line_error(proc, needle)
    assert not out.exists()


def test_logits_missing_model(tmp_path):
    proc = run_cli("logits", str(tmp_path / "nope.gguf"), "--tokens", "1", "--out", str(tmp_path / "x.npy"))
    assert_one_line_error(proc, "no such file")


def test_generate_is_deterministic_and_equal_split(tiny_f32):
    texts = []
    for workers in (0, 3):
        proc = run_cli("generate", str(tiny_f32), "--prompt", "the swarm", "--max-tokens", "12",
                       "--workers", str(workers), "--stats", check=True)
        assert proc.stdout.startswith("the swarm")
        assert "tokens/s" in proc.stderr and "[step 11" in proc.stderr
        texts.append(proc.stdout)
    assert texts[0] == texts[1]
    sampled = [run_cli("generate", str(tiny_f32), "--prompt", "the swarm", "--max-tokens", "12",
                       "--temperature", "0.9", "--top-p", "0.9", "--seed", str(s), check=True).stdout for s in (1, 1, 2)]
    assert sampled[0] == sampled[1]


def test_generate_refusals(tiny_f32):
    assert_one_line_error(run_cli("generate", str(tiny_f32), "--prompt", "x", "--max-tokens", "0"), "--max-tokens")
    assert_one_line_error(run_cli("generate", str(tiny_f32), "--prompt", "x", "--top-p", "0"), "--top-p")


@pytest.mark.slow
def test_demo_runs_with_no_arguments(tmp_path):
    proc = run_cli("demo", timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "worker3: pid" in out
    assert "exactness, prefill" in out and "exactness, decode" in out
    assert out.count("bit-identical") == 2
    assert "OK: the split run's logits equal the monolithic run's." in out


@pytest.mark.slow
def test_demo_swarm_mode(tmp_path):
    """`demo --swarm`: bootstrap and worker nodes as separate processes, owners found via the DHT."""
    proc = run_cli("demo", "--swarm", "--workers", "3", "--max-tokens", "6", timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "bootstrap node: pid" in out and "worker node 2: pid" in out
    assert "backbone found 3 owners through the DHT, 0 units uncovered" in out
    assert out.count("bit-identical") == 2 and "OK: the split run's logits" in out
