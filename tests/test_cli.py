"""The commands a user types, run as real processes: logits, generate, demo, and their refusals."""
from __future__ import annotations

import re

import numpy as np
import pytest

from conftest import assert_one_line_error, run_cli, start_cli

TOKENS = "11,22,33,44,55,66,77,88,99,110,121,132,143,154,165,176,187,198,209,220"


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_logits_missing_model(tmp_path):
    proc = run_cli("logits", str(tmp_path / "nope.gguf"), "--tokens", "1", "--out", str(tmp_path / "x.npy"))
    assert_one_line_error(proc, "no such file")


@pytest.mark.slow
def test_generate_is_deterministic_and_equal_split(tiny_f32):
    texts = []
    for workers in (0, 3):
        proc = run_cli("generate", str(tiny_f32), "--prompt", "the swarm", "--max-tokens", "12",
                       "--workers", str(workers), "--stats", check=True)
        assert proc.stdout.startswith("the swarm")
        assert "tokens/s" in proc.stderr and "[step 11" in proc.stderr
        # nothing after the text's stats line: the worker processes stop quietly
        assert proc.stderr.rstrip().splitlines()[-1].startswith("12 tokens in"), proc.stderr[-2000:]
        texts.append(proc.stdout)
    assert texts[0] == texts[1]
    sampled = [run_cli("generate", str(tiny_f32), "--prompt", "the swarm", "--max-tokens", "12",
                       "--temperature", "0.9", "--top-p", "0.9", "--seed", str(s), check=True).stdout for s in (1, 1, 2)]
    assert sampled[0] == sampled[1]


@pytest.mark.slow
def test_generate_refusals(tiny_f32):
    assert_one_line_error(run_cli("generate", str(tiny_f32), "--prompt", "x", "--max-tokens", "0"), "--max-tokens")
    assert_one_line_error(run_cli("generate", str(tiny_f32), "--prompt", "x", "--top-p", "0"), "--top-p")


LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ ", re.M)  # a timestamped log line


@pytest.mark.slow
def test_demo_runs_with_no_arguments(tmp_path):
    """Cold (an empty cache: it makes the model and cuts the shards), as on a fresh machine: its
    output is its own lines only, no timestamped log line of ours or of the worker processes."""
    proc = run_cli("demo", timeout=900, env={"P2PSWARM_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "making the tiny qwen35moe model" in proc.stdout
    assert not LOG_LINE.search(proc.stdout + proc.stderr), proc.stderr[-3000:]
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


# --- the fresh-machine path: errors, progress -----------------------------------------------------
@pytest.fixture(scope="module")
def expert_shard(tiny_f32, tmp_path_factory):
    from p2pswarm.model.slicer import slice_experts

    path = tmp_path_factory.mktemp("shard") / "shard.gguf"
    slice_experts(tiny_f32, path, None, (0, 8))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("command", [
    ["node", "--role", "backbone", "--http", "127.0.0.1:0", "--model", "{shard}"],
    ["logits", "{shard}", "--tokens", "1,2", "--out", "{tmp}/x.npy"],
    ["generate", "{shard}", "--prompt", "hi"],
    ["demo", "--model", "{shard}"],
])
def test_expert_shard_given_as_model_is_refused(expert_shard, tmp_path, command):
    args = [a.format(shard=expert_shard, tmp=tmp_path) for a in command]
    proc = run_cli(*args, env={"P2PSWARM_HOME": str(tmp_path / "home")}, timeout=120)
    assert_one_line_error(proc, f"{expert_shard} is an expert shard, not a model: give the full model GGUF")
    assert proc.returncode == 2
    assert not (tmp_path / "home").exists()  # refused before anything else: no identity made


@pytest.mark.slow
def test_backbone_on_a_taken_http_port_is_one_line_before_joining(tiny_f32, tmp_path):
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        proc = run_cli("node", "--role", "backbone", "--model", str(tiny_f32), "--http", f"127.0.0.1:{port}",
                       env={"P2PSWARM_HOME": str(tmp_path / "home")}, timeout=120)
    finally:
        taken.close()
    assert_one_line_error(proc, f"--http 127.0.0.1:{port}: cannot listen there", "address already in use",
                          "--http")
    assert proc.returncode == 2 and "READY" not in proc.stdout
    assert not (tmp_path / "home").exists()  # checked before the node made or loaded its identity


@pytest.mark.slow
def test_worker_on_a_taken_health_port_names_health(tiny_f32, tmp_path):
    """The worker's error names the flag it was given (--health), not the backbone's --http."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = run_cli("node", "--role", "worker", "--shard", str(tiny_f32), "--health", f"127.0.0.1:{port}",
                       env={"P2PSWARM_HOME": str(tmp_path / "home")}, timeout=120)
    assert_one_line_error(proc, f"--health 127.0.0.1:{port}: cannot listen there", "address already in use",
                          "with --health HOST:PORT")
    assert "--http" not in proc.stderr and proc.returncode == 2


def _progress_lines(stderr: str, label: str) -> list[int]:
    import re

    pat = re.compile(rf"^{label}: +(\d+)% \S+B of \S+B, \S+B/s, \d\d:\d\d elapsed, ETA \S+$")
    return [int(m.group(1)) for m in map(pat.match, stderr.splitlines()) if m]


@pytest.mark.slow
def test_progress_off_a_terminal_is_periodic_lines(tiny_f32, tmp_path):
    """`slice` with stderr a pipe: whole lines, one per 10 % or so, done, total, rate and ETA; no
    carriage returns. Quick work prints none by default (P2PSWARM_PROGRESS_AFTER=0 shows them)."""
    proc = run_cli("slice", str(tiny_f32), "--experts", "0-7", "-o", str(tmp_path / "s.gguf"),
                   env={"P2PSWARM_PROGRESS_AFTER": "0"}, check=True)
    pct = _progress_lines(proc.stderr, "slice")
    assert len(pct) >= 8 and pct == sorted(pct) and pct[-1] == 100, proc.stderr
    assert all(b - a <= 20 for a, b in zip([0, *pct], pct)), pct  # no long silent stretch
    assert "\r" not in proc.stderr
    quiet = run_cli("slice", str(tiny_f32), "--experts", "0-7", "-o", str(tmp_path / "q.gguf"), check=True)
    assert _progress_lines(quiet.stderr, "slice") == [], quiet.stderr
    # -q: none even where they would show, as make-model -q; the result line stays
    q = run_cli("slice", str(tiny_f32), "--experts", "0-7", "-q", "-o", str(tmp_path / "q2.gguf"),
                env={"P2PSWARM_PROGRESS_AFTER": "0"}, check=True)
    assert q.stderr == "" and q.stdout.startswith(f"wrote {tmp_path / 'q2.gguf'}"), (q.stdout, q.stderr)


@pytest.mark.slow
def test_progress_on_a_terminal_is_a_bar(tiny_f32, tmp_path):
    """`manifest` with stderr a terminal (a pty of 100 x 24): tqdm's bar, redrawn in place."""
    import fcntl
    import os
    import pty
    import struct
    import subprocess
    import sys
    import termios

    key = tmp_path / "issuer.key"
    run_cli("identity", "--path", str(key), check=True)
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "p2pswarm.cli", "manifest", "--model", str(tiny_f32), "--key",
                             str(key), "--out", str(tmp_path / "m.manifest")], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=slave)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 4096)
        except OSError:  # EIO: the child closed the pty
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    assert proc.wait(120) == 0
    shown = b"".join(chunks).decode("utf-8", "replace")
    assert "\r" in shown and "manifest: 100%|" in shown and "B/s]" in shown, shown[-500:]


@pytest.mark.slow
def test_backbone_serves_http_on_the_socket_it_checked(tiny_f32, tmp_path):
    """The socket bound before joining is the one served: a backbone process (no workers: every
    expert local) answers /v1/completions on the port it logged."""
    import os

    import httpx

    from p2pswarm.backbone.sessions.local import stop_process

    env = dict(os.environ, P2PSWARM_HOME=str(tmp_path / "home"), P2PSWARM_KERNEL="numpy")
    log = tmp_path / "bb.log"
    proc, _addr = start_cli(["node", "--role", "backbone", "--model", str(tiny_f32), "--http", "127.0.0.1:0"],
                            log, env, timeout=120)
    try:
        base = log.read_text().split("and the status page on ")[1].split()[0].rstrip(";")
        assert base.startswith("http://127.0.0.1:") and not base.endswith(":0")
        r = httpx.post(f"{base}/v1/completions", json={"prompt": "hello", "max_tokens": 3, "temperature": 0},
                       timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3
    finally:
        stop_process(proc)


@pytest.mark.slow
@pytest.mark.parametrize("value", ["zero", "0", "-3", "1.5"])
def test_node_refuses_a_bad_token_budget(value):
    """`--token-budget` takes 'auto' (the default) or a positive integer; anything else is
    argparse's usage line and one error line, exit 2, before anything starts."""
    proc = run_cli("node", "--role", "backbone", "--token-budget", value, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "--token-budget: expected 'auto' or a positive integer" in proc.stderr.strip().splitlines()[-1], proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("argv, message", [
    (["--role", "backbone", "--dht", "client"], "--dht is for --role worker"),
    (["--role", "worker", "--shard", "x.gguf", "--relay", "auto", "--bootstrap", "/ip4/127.0.0.1/tcp/1",
      "--dht", "server"], "--dht server needs a dialable worker"),
])
def test_node_refuses_a_dht_mode_it_cannot_have(argv, message):
    """`--dht server|client` is a worker's; a relayed worker cannot serve the DHT (nobody can dial
    its kad). One error line, non-zero exit, before anything starts."""
    proc = run_cli("node", *argv, timeout=60)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    assert message in proc.stderr.strip().splitlines()[-1], proc.stderr


def test_rewards_shows_each_chains_run_as_a_time():
    """`rewards`' table shows a chain's epoch as when its backbone run started (UTC), not raw ms."""
    from p2pswarm.commands.rewards import run_started

    assert run_started(1_796_560_000_123) == "2026-12-06 12:26:40"
    assert run_started(10 ** 30) == str(10 ** 30)  # a signed but absurd epoch is shown as it is
