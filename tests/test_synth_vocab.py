"""make-model with the real Qwen3.5 vocabulary (--vocab qwen35, the file shipped in
p2pswarm/data): the tokenizer keys are copied as they are, llama.cpp tokenizes with them, and the
demo's model is made from the shipped file without touching the network."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from p2pswarm.model import synth
from p2pswarm.model.gguf_read import read_gguf_kv

from conftest import HAVE_LLAMA
from helpers.llama_ref import llama_tokenize_eval

REPO = Path(__file__).resolve().parents[1]


def _qwen35_vocab() -> Path:
    from p2pswarm.model.vocab import qwen35_vocab_path

    return Path(qwen35_vocab_path())


@pytest.mark.slow
def test_vocab_qwen35(tmp_path: Path) -> None:
    vocab = _qwen35_vocab()
    p = synth.make_model(tmp_path / "v.gguf", layers=1, qtype="q8_0", vocab=vocab)
    info = synth.describe(p)
    assert info["n_vocab"] == 151_936
    assert info["tied"] is True  # default for a large vocabulary: keeps the demo model small
    src = {kv.key: kv for kv in read_gguf_kv(vocab) if kv.key.startswith("tokenizer.ggml.")}
    dst = {kv.key: kv for kv in read_gguf_kv(p) if kv.key.startswith("tokenizer.ggml.")}
    assert src.keys() == dst.keys()
    for k in src:
        assert src[k].value == dst[k].value and src[k].vtype == dst[k].vtype, k
    if HAVE_LLAMA:
        ids, scores = llama_tokenize_eval(p, "Hello, swarm of experts!")
        assert scores.shape == (len(ids), 151_936)
        assert np.isfinite(scores).all() and scores.std() > 1.0


@pytest.mark.slow
def test_make_model_vocab_qwen35_names_the_shipped_file(tmp_path: Path) -> None:
    out = tmp_path / "m.gguf"
    proc = subprocess.run([sys.executable, "-m", "p2pswarm.cli", "make-model", "-o", str(out), "--layers", "1",
                           "--vocab", "qwen35"], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "n_vocab 151936" in proc.stdout
    shipped = {kv.key: kv.value for kv in read_gguf_kv(REPO / "p2pswarm" / "data" / "ggml-vocab-qwen35.gguf")
               if kv.key == "tokenizer.ggml.pre"}
    assert {kv.key: kv.value for kv in read_gguf_kv(out) if kv.key == "tokenizer.ggml.pre"} == shipped


_NO_NETWORK_SCRIPT = textwrap.dedent("""
    import json, sys
    seen = []
    WATCH = ("socket.connect", "socket.getaddrinfo", "socket.gethostbyname", "socket.sendto",
             "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "urllib.Request")
    def hook(event, args):
        # ctypes.util.find_library (loading libggml) runs `ldconfig -p`: a local look-up, allowed
        if event in WATCH and not (event == "subprocess.Popen" and str(args[0]).endswith("ldconfig")):
            seen.append([event, repr(args)[:200]])
    sys.addaudithook(hook)
    from p2pswarm.commands.demo import default_model
    from p2pswarm.model.vocab import qwen35_vocab_path
    path = default_model()
    print(json.dumps({"model": str(path), "vocab": str(qwen35_vocab_path()), "events": seen}))
""")


@pytest.mark.slow
def test_demo_model_preparation_makes_no_network_access(tmp_path: Path) -> None:
    """The demo's first run makes its model from the shipped vocabulary: no socket is dialled, no
    name resolved, no process (pip) started, on an empty cache (Python audit hooks watch)."""
    env = dict(os.environ, P2PSWARM_CACHE=str(tmp_path / "cache"),
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", _NO_NETWORK_SCRIPT], capture_output=True, text=True,
                          env=env, timeout=600, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["events"] == []
    assert Path(got["vocab"]) == REPO / "p2pswarm" / "data" / "ggml-vocab-qwen35.gguf"
    model = Path(got["model"])
    assert model.is_relative_to(tmp_path / "cache") and model.is_file()
    from p2pswarm.engine.text.tokenizer import Tokenizer

    assert Tokenizer.from_gguf(model).n_vocab == 151_936
