"""Shared fixtures: small real GGUF models made once per test session, and a CLI runner.

Every test runs with its own ``P2PSWARM_CACHE`` so nothing touches the user's cache, and the
model files are real qwen3moe GGUFs written by ``p2pswarm.model.synth`` (llama.cpp loads them).
"""
from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from p2pswarm.model.synth import make_model

from helpers.llama_ref import llama_logits  # noqa: F401  (re-exported: the tests' reference)

REPO = Path(__file__).resolve().parent.parent


def _have_llama() -> bool:
    """Whether llama.cpp (the reference) is here. Installed but broken is an error, not a skip: the
    comparisons must never vanish silently (a reference that cannot even load would otherwise turn
    every comparison into a "pass")."""
    try:
        importlib.metadata.version("llama_cpp_python")
    except importlib.metadata.PackageNotFoundError:
        if os.environ.get("CI"):
            raise pytest.UsageError("CI needs llama-cpp-python (the reference): pip install -e '.[test]'")
        return False
    try:
        import llama_cpp  # noqa: F401
    except Exception as exc:  # pragma: no cover - depends on the environment
        raise pytest.UsageError(f"llama-cpp-python is installed but cannot be imported: {exc}") from exc
    return True


HAVE_LLAMA = _have_llama()

needs_llama = pytest.mark.skipif(
    not HAVE_LLAMA, reason="llama-cpp-python is not installed (pip install -e '.[test]' builds it)"
)


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("P2PSWARM_CACHE", str(tmp_path / "cache"))


def _model(models_dir: Path, name: str, **kw) -> Path:
    path = models_dir / f"{name}.gguf"
    if not path.exists():
        make_model(path, **kw)
    return path


@pytest.fixture(scope="session")
def tiny_f32(models_dir) -> Path:
    return _model(models_dir, "tiny-f32", preset="tiny", qtype="f32", seed=1)


@pytest.fixture(scope="session")
def tiny_q8(models_dir) -> Path:
    return _model(models_dir, "tiny-q8_0", preset="tiny", qtype="q8_0", seed=2)


@pytest.fixture(scope="session")
def tiny_q4km(models_dir) -> Path:
    if not HAVE_LLAMA:
        pytest.skip("q4_k_m needs llama.cpp's quantiser: llama-cpp-python is not installed")
    return _model(models_dir, "tiny-q4_k_m", preset="tiny", qtype="q4_k_m", seed=3)


@pytest.fixture(scope="session")
def qwen35_path() -> Path:
    """The real Qwen3.5 vocabulary the package ships (p2pswarm/data), sha256-checked."""
    from p2pswarm.model import vocab

    return Path(vocab.qwen35_vocab_path())


def run_cli(*args: str, timeout: float = 300, env: dict | None = None, check: bool = False, cwd=None):
    """Run ``p2pswarm ARGS`` as a real process (in ``cwd``); returns the CompletedProcess (text)."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    proc = subprocess.run([sys.executable, "-m", "p2pswarm.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=full_env, stdin=subprocess.DEVNULL, cwd=cwd)
    if check and proc.returncode != 0:
        raise AssertionError(f"p2pswarm {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}")
    return proc


def start_cli(args: list[str], log: Path, env: dict | None = None, timeout: float = 90) -> tuple[subprocess.Popen, str]:
    """Start ``p2pswarm ARGS`` as a real process (stderr to ``log``) and wait for its ``READY``
    line; returns (process, what the READY line names)."""
    from p2pswarm.backbone.sessions.local import start_cli_process
    from p2pswarm.errors import UserError

    try:
        with open(log, "w") as log_file:
            return start_cli_process(args, f"p2pswarm {' '.join(args[:3])}", timeout, env=env, stderr=log_file)
    except UserError as exc:
        raise AssertionError(f"{exc}: {log.read_text()[-3000:]}") from None


def assert_one_line_error(proc, *needles: str) -> None:
    """A refused input: non-zero exit, no traceback, one line on stderr naming the problem."""
    assert proc.returncode != 0, proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    for n in needles:
        assert n.lower() in lines[0].lower(), lines[0]


def engine_trace(path, tokens) -> tuple[np.ndarray, dict[str, list]]:
    """Monolithic prefill through our engine, with per-layer statistics of what it computed:
    residual rms, chosen experts, top-k weights, and the router margin between the k-th and
    (k+1)-th logits."""
    from p2pswarm.backbone.serving.runner import combine, expert_groups
    from p2pswarm.engine import ops
    from p2pswarm.engine.arch import load_dense
    from p2pswarm.engine.experts.numpy_bank import ExpertBank
    from p2pswarm.model.layout import ModelLayout

    layout = ModelLayout.open(path)
    model, bank = load_dense(layout), ExpertBank(layout)
    state = model.new_state()
    h = model.embed(np.asarray(tokens))
    stats: dict[str, list] = {"rms": [], "experts": [], "topk_w": [], "margin": []}
    for il in range(model.n_layer):
        h = model.pre_moe(il, h, state, 0)
        cur = model.ffn_input(il, h)
        ids, w = model.route(il, cur)
        groups = expert_groups(ids)
        partials = dict(zip([e for e, _ in groups], bank.forward_groups(il, cur, groups)))
        h = model.post_moe(il, h, cur, combine(ids, w, groups, partials))
        router = np.sort(ops.matmul(cur, model.w[f"blk.{il}.ffn_gate_inp.weight"]), axis=-1)[:, ::-1]
        k = model.n_expert_used
        stats["rms"].append(float(np.sqrt(np.mean(h * h))))
        stats["experts"].append(ids)
        stats["topk_w"].append(w)
        stats["margin"].append(router[:, k - 1] - router[:, k])
    return model.output(h), stats


@pytest.fixture
def shards(tiny_f32, tmp_path, monkeypatch):
    """The tiny f32 model cut into two expert shards, for in-process workers; the numpy kernel on
    every side (bit-equality needs one kernel, and the handshake insists on it)."""
    from p2pswarm.backbone.sessions.local import ensure_shards
    from p2pswarm.model.layout import ModelLayout
    from p2pswarm.model.manifest import model_fingerprint

    monkeypatch.setenv("P2PSWARM_KERNEL", "numpy")
    layout = ModelLayout.open(tiny_f32)
    return ensure_shards(layout, model_fingerprint(layout), 2, tmp_path / "shards")
