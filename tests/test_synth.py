"""make-model: seeded synthetic qwen3moe GGUFs (p2pswarm.model.synth, p2pswarm.commands.make_model).

What is checked: byte-determinism, tensor names/types/shapes/metadata for every preset and type,
that llama.cpp loads and runs the files with finite, spread-out logits, that our engine agrees with
llama.cpp on them (so its activation and routing statistics describe what llama.cpp computes), that routing is not degenerate, the 122B expert geometry (5,308,416 bytes per
Q4_K expert), the real Qwen3.5 vocabulary via --vocab, and that a failure leaves no file behind.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import gguf
import numpy as np
import pytest

from p2pswarm.commands import make_model as cmd
from p2pswarm.errors import UserError
from p2pswarm.model import synth
from p2pswarm.model.gguf_read import read_gguf_kv
from p2pswarm.model.vocab import sha256_file

from conftest import engine_trace, llama_logits, needs_llama

REPO = Path(__file__).resolve().parents[1]


LAYER_TENSORS = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm",
                 "attn_k_norm", "ffn_norm", "ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps",
                 "ffn_down_exps"]
TOKENS = [5, 17, 42, 99, 100, 7, 256, 300, 12, 64, 128, 31, 2, 77, 500, 9]


def sha256(path: Path) -> str:
    return sha256_file(path)


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


# ---------------------------------------------------------------------------------------------
# Fixtures: each model is made once per test session.


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("synth")
    return {
        "f32": synth.make_model(d / "tiny-f32.gguf"),
        "q8_0": synth.make_model(d / "tiny-q8.gguf", qtype="q8_0"),
    }


# ---------------------------------------------------------------------------------------------
# Determinism


def test_same_seed_same_bytes_different_seed_different(tmp_path: Path) -> None:
    a = synth.make_model(tmp_path / "a.gguf", layers=1, seed=7)
    b = synth.make_model(tmp_path / "b.gguf", layers=1, seed=7)
    c = synth.make_model(tmp_path / "c.gguf", layers=1, seed=8)
    assert sha256(a) == sha256(b)
    assert sha256(a) != sha256(c)
    assert a.stat().st_size == c.stat().st_size


@pytest.mark.slow
def test_same_bytes_in_a_fresh_process(tmp_path: Path) -> None:
    """The built-in vocabulary (BPE training) and the weights do not depend on process state."""
    here = synth.make_model(tmp_path / "here.gguf", layers=1, seed=3, qtype="q8_0")
    code = textwrap.dedent(f"""
        from p2pswarm.model import synth
        synth.make_model({str(tmp_path / 'there.gguf')!r}, layers=1, seed=3, qtype="q8_0")
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)
    assert sha256(here) == sha256(tmp_path / "there.gguf")


def test_layers_share_a_prefix(tmp_path: Path) -> None:
    """Each tensor has its own seeded generator: layer 0 is the same whatever --layers says."""
    one = gguf.GGUFReader(str(synth.make_model(tmp_path / "1.gguf", layers=1)))
    two = gguf.GGUFReader(str(synth.make_model(tmp_path / "2.gguf", layers=2)))
    t2 = {t.name: t for t in two.tensors}
    for t in one.tensors:
        assert np.array_equal(np.asarray(t.data), np.asarray(t2[t.name].data)), t.name


# ---------------------------------------------------------------------------------------------
# Structure


def expected_tensors(n_layer: int, tied: bool) -> list[str]:
    names = ["token_embd.weight"]
    for i in range(n_layer):
        names += [f"blk.{i}.{n}.weight" for n in LAYER_TENSORS]
    names.append("output_norm.weight")
    if not tied:
        names.append("output.weight")
    return names


def check_structure(path: Path, *, n_layer: int, n_embd: int, n_head: int, n_head_kv: int,
                    head_dim: int, n_expert: int, n_expert_used: int, n_ff_exp: int,
                    dense: str, experts: str, tied: bool = False) -> gguf.GGUFReader:
    r = gguf.GGUFReader(str(path))
    kv = {k: f.contents() for k, f in r.fields.items() if not k.startswith("tokenizer.ggml.")}
    assert kv["general.architecture"] == "qwen3moe"
    a = "qwen3moe."
    assert kv[a + "block_count"] == n_layer
    assert kv[a + "embedding_length"] == n_embd
    assert kv[a + "attention.head_count"] == n_head
    assert kv[a + "attention.head_count_kv"] == n_head_kv
    assert kv[a + "attention.key_length"] == head_dim
    assert kv[a + "attention.value_length"] == head_dim
    assert kv[a + "expert_count"] == n_expert
    assert kv[a + "expert_used_count"] == n_expert_used
    assert kv[a + "expert_feed_forward_length"] == n_ff_exp
    for key in ("context_length", "feed_forward_length", "rope.freq_base",
                "attention.layer_norm_rms_epsilon"):
        assert a + key in kv
    assert "general.file_type" in kv
    assert "p2pswarm.synth.preset" in kv and "p2pswarm.synth.seed" in kv
    tok = r.fields["tokenizer.ggml.tokens"]
    n_vocab = len(tok.data)
    assert r.fields["tokenizer.ggml.model"].contents() == "gpt2"

    names = [t.name for t in r.tensors]
    assert names == expected_tensors(n_layer, tied)
    by = {t.name: t for t in r.tensors}
    # numpy shape (outermost first) of every tensor
    want = {
        "token_embd.weight": (n_vocab, n_embd),
        "output_norm.weight": (n_embd,),
        "output.weight": (n_vocab, n_embd),
    }
    for i in range(n_layer):
        p = f"blk.{i}."
        want.update({
            p + "attn_norm.weight": (n_embd,),
            p + "attn_q.weight": (n_head * head_dim, n_embd),
            p + "attn_k.weight": (n_head_kv * head_dim, n_embd),
            p + "attn_v.weight": (n_head_kv * head_dim, n_embd),
            p + "attn_output.weight": (n_embd, n_head * head_dim),
            p + "attn_q_norm.weight": (head_dim,),
            p + "attn_k_norm.weight": (head_dim,),
            p + "ffn_norm.weight": (n_embd,),
            p + "ffn_gate_inp.weight": (n_expert, n_embd),
            p + "ffn_gate_exps.weight": (n_expert, n_ff_exp, n_embd),
            p + "ffn_up_exps.weight": (n_expert, n_ff_exp, n_embd),
            p + "ffn_down_exps.weight": (n_expert, n_embd, n_ff_exp),
        })
    for name, t in by.items():
        assert tuple(int(x) for x in reversed(t.shape)) == want[name], name
        if t.name.endswith("_exps.weight"):
            assert t.tensor_type.name == experts, name
        elif len(t.shape) == 1 or "ffn_gate_inp" in name:
            assert t.tensor_type.name == "F32", name
        else:
            assert t.tensor_type.name == dense, name
    return r


TINY = dict(n_layer=4, n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_expert=16,
            n_expert_used=4, n_ff_exp=256)


def test_tiny_f32_structure(models: dict[str, Path]) -> None:
    r = check_structure(models["f32"], **TINY, dense="F32", experts="F32")
    assert r.fields["p2pswarm.synth.preset"].contents() == "tiny"
    assert r.fields["p2pswarm.synth.seed"].contents() == 0
    assert r.fields["tokenizer.ggml.pre"].contents() == "qwen2"
    tokens = r.fields["tokenizer.ggml.tokens"].contents()
    assert len(tokens) > 256 + 200  # bytes + a few hundred merges + specials
    for s in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        assert s in tokens
    assert r.fields["tokenizer.ggml.eos_token_id"].contents() == tokens.index("<|endoftext|>")
    merges = r.fields["tokenizer.ggml.merges"].contents()
    assert len(merges) >= 200
    types = r.fields["tokenizer.ggml.token_type"].contents()
    assert types[tokens.index("<|im_end|>")] == 3 and types[0] == 1


def test_tiny_q8_0_structure(models: dict[str, Path]) -> None:
    check_structure(models["q8_0"], **TINY, dense="Q8_0", experts="Q8_0")


def test_tiny_f16_and_tied(tmp_path: Path) -> None:
    p = synth.make_model(tmp_path / "f16.gguf", qtype="f16", layers=2, tied=True)
    check_structure(p, **{**TINY, "n_layer": 2}, dense="F16", experts="F16", tied=True)
    assert synth.describe(p)["tied"] is True


def test_header_reader_agrees_with_gguf_reader(models: dict[str, Path]) -> None:
    kvs, tis = synth.read_gguf_header(models["q8_0"])
    r = gguf.GGUFReader(str(models["q8_0"]))
    assert [kv.key for kv in kvs] == [k for k in r.fields if not k.startswith("GGUF.")]
    assert len(tis) == len(r.tensors)
    for ti, t in zip(tis, r.tensors):
        assert ti.name == t.name and ti.gtype == int(t.tensor_type)
        assert ti.shape == tuple(int(x) for x in reversed(t.shape))
        assert r.data_offset + ti.offset == t.data_offset


@pytest.mark.slow
def test_fast_reader_matches_gguf_py_part_by_part(models: dict[str, Path]) -> None:
    """The sped-up reader (p2pswarm.model.gguf_read) must build exactly gguf-py's fields: same
    types, same data indices, same parts (dtype, shape, bytes), for a model and for the 150k-token
    vocabulary whose string arrays it parses on its own path; and it must be faster on the vocabulary."""
    from p2pswarm.model.gguf_read import open_gguf

    vocab = REPO / "p2pswarm" / "data" / "ggml-vocab-qwen35.gguf"
    for path in (models["q8_0"], vocab):
        t0 = time.perf_counter()
        fast = open_gguf(path)
        t_fast = time.perf_counter() - t0
        t0 = time.perf_counter()
        stock = gguf.GGUFReader(str(path))
        t_stock = time.perf_counter() - t0
        assert list(fast.fields) == list(stock.fields)
        for key, f in stock.fields.items():
            g = fast.fields[key]
            assert (g.types, g.data, g.offset, len(g.parts)) == (f.types, f.data, f.offset, len(f.parts)), key
            for a, b in zip(f.parts, g.parts):
                assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), key
        assert [(t.name, t.data_offset, t.n_bytes) for t in fast.tensors] == \
            [(t.name, t.data_offset, t.n_bytes) for t in stock.tensors]
    assert t_fast < t_stock / 2, (t_fast, t_stock)  # measured 0.5 s vs 8.9 s on 2 busy cores


def test_direct_q4_k_experts_decode_to_the_intended_scale(tmp_path: Path) -> None:
    p = synth.make_model(tmp_path / "q4k.gguf", layers=1, expert_qtype="q4_k")
    r = check_structure(p, **{**TINY, "n_layer": 1}, dense="F32", experts="Q4_K")
    for t in r.tensors:
        if t.name.endswith("_exps.weight"):
            w = gguf.quants.dequantize(t.data, t.tensor_type)
            fan_in = w.shape[-1]
            assert np.isfinite(w).all()
            assert abs(float(w.std()) * np.sqrt(fan_in) - 1.0) < 0.05, t.name
            assert abs(float(w.mean())) < 0.01 / np.sqrt(fan_in), t.name


def test_weight_scales(models: dict[str, Path]) -> None:
    r = gguf.GGUFReader(str(models["f32"]))
    for t in r.tensors:
        w = np.asarray(t.data, dtype=np.float64)
        if "norm" in t.name:
            assert abs(w.mean() - 1) < 0.01 and 0.005 < w.std() < 0.05, t.name
        elif t.name != "token_embd.weight":
            assert 0.5 < w.std() * np.sqrt(w.shape[-1]) < 2.5, t.name


# ---------------------------------------------------------------------------------------------
# Activations and routing (numpy forward; matched against llama.cpp below)


def test_activations_and_routing_are_healthy(models: dict[str, Path]) -> None:
    logits, st = engine_trace(models["f32"], TOKENS)
    assert np.isfinite(logits).all()
    assert 1.0 < logits.std() < 5.0
    assert all(0.5 < v < 5.0 for v in st["rms"]), st["rms"]  # O(1) residual stream
    for sel, w in zip(st["experts"], st["topk_w"]):
        assert len(np.unique(sel)) >= 10  # of 16: many distinct experts used across tokens
        spread = w.max(-1) - w.min(-1)
        assert (spread > 0.05).mean() > 0.8  # top-k weights are not all equal
        assert w[:, 0].mean() > 0.3  # the first choice is clearly preferred on average


def test_router_near_tie_has_small_nonzero_margins(tmp_path: Path) -> None:
    p = synth.make_model(tmp_path / "tie.gguf", layers=2, router_near_tie=True)
    logits, st = engine_trace(p, TOKENS)
    assert np.isfinite(logits).all()
    margins = np.concatenate(st["margin"])
    assert margins.min() > 1e-7  # never an exact (or float-noise) tie
    assert np.median(margins) < 5e-3  # yet small: k-th and (k+1)-th nearly tied
    assert margins.min() < 5e-4
    for w in st["topk_w"]:
        assert np.abs(w - 0.25).max() < 0.02  # near-uniform top-k weights
    assert len(np.unique(np.concatenate([s.ravel() for s in st["experts"]]))) >= 10


# ---------------------------------------------------------------------------------------------
# llama.cpp


@needs_llama
@pytest.mark.slow
def test_llama_cpp_runs_tiny_f32_and_matches_numpy(models: dict[str, Path]) -> None:
    got = llama_logits(models["f32"], TOKENS)
    assert np.isfinite(got).all() and got.std() > 1.0
    want, _ = engine_trace(models["f32"], TOKENS)
    assert np.abs(got - want).max() < 1e-3 * max(1.0, np.abs(want).max())
    assert (got.argmax(-1) == want.argmax(-1)).all()


@needs_llama
@pytest.mark.slow
def test_llama_cpp_runs_tiny_q8_0(models: dict[str, Path]) -> None:
    got = llama_logits(models["q8_0"], TOKENS)
    assert np.isfinite(got).all() and got.std() > 1.0
    want, _ = engine_trace(models["q8_0"], TOKENS)  # dequantised weights
    assert np.corrcoef(got.ravel(), want.ravel())[0, 1] > 0.99


@pytest.mark.slow
@needs_llama
def test_llama_cpp_runs_tiny_q4_k_m(tmp_path: Path) -> None:
    p = synth.make_model(tmp_path / "q4km.gguf", qtype="q4_k_m")
    r = gguf.GGUFReader(str(p))
    types = {t.name: t.tensor_type.name for t in r.tensors}
    assert types["blk.0.ffn_gate_exps.weight"] in ("Q4_K", "Q5_K", "Q6_K")
    assert types["blk.0.ffn_gate_inp.weight"] == "F32"
    assert r.fields["p2pswarm.synth.preset"].contents() == "tiny"
    assert r.fields["general.file_type"].contents() == int(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    assert leftovers(tmp_path) == ["q4km.gguf"]
    got = llama_logits(p, TOKENS)
    assert np.isfinite(got).all() and got.std() > 1.0
    want, _ = engine_trace(p, TOKENS)
    assert np.corrcoef(got.ravel(), want.ravel())[0, 1] > 0.98
    # quantisation is deterministic too
    q = synth.make_model(tmp_path / "again.gguf", qtype="q4_k_m")
    assert sha256(p) == sha256(q)


@needs_llama
@pytest.mark.slow
def test_llama_cpp_runs_router_near_tie(tmp_path: Path) -> None:
    p = synth.make_model(tmp_path / "tie.gguf", layers=2, router_near_tie=True)
    got = llama_logits(p, TOKENS)
    want, _ = engine_trace(p, TOKENS)
    assert np.abs(got - want).max() < 1e-3 * max(1.0, np.abs(want).max())


# ---------------------------------------------------------------------------------------------
# The 122B geometry


@pytest.mark.slow
def test_geometry_122b_one_layer(tmp_path: Path) -> None:
    out = tmp_path / "g.gguf"
    code = textwrap.dedent(f"""
        import time
        from p2pswarm.model import synth
        t = time.monotonic()
        synth.make_model({str(out)!r}, preset="geometry-122b", layers=1)
        # VmHWM: this process's peak RSS (ru_maxrss would include the forked pytest's)
        hwm = [ln for ln in open("/proc/self/status") if ln.startswith("VmHWM:")][0]
        print(time.monotonic() - t, int(hwm.split()[1]))
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    res = subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=600,
                         capture_output=True, text=True)
    secs, maxrss_kib = res.stdout.split()
    try:
        info = synth.describe(out)
        print(f"geometry-122b --layers 1: {float(secs):.1f} s, {info['file_bytes']:,} bytes, "
              f"peak RSS {int(maxrss_kib) / 1024:.0f} MiB, "
              f"{info['bytes_per_expert']:,} bytes per expert (gate+up+down)")
        assert info["bytes_per_expert"] == 5_308_416 == 3 * 3072 * 1024 // 256 * 144
        assert info["expert_types"] == ["Q4_K"]
        assert int(maxrss_kib) < 400 * 1024  # streamed: never the whole model in memory
        r = check_structure(out, n_layer=1, n_embd=3072, n_head=32, n_head_kv=2, head_dim=128,
                            n_expert=256, n_expert_used=8, n_ff_exp=1024, dense="F32",
                            experts="Q4_K")
        assert r.fields["p2pswarm.synth.preset"].contents() == "geometry-122b"
        for t in r.tensors:
            if t.name.endswith("_exps.weight"):
                assert t.n_bytes == 256 * 5_308_416 // 3
                for e in (0, 255):  # one expert: a contiguous slab, decoded on its own
                    w = gguf.quants.dequantize(np.asarray(t.data[e]), t.tensor_type)
                    fan_in = w.shape[-1]
                    assert np.isfinite(w).all()
                    assert abs(float(w.std()) * np.sqrt(fan_in) - 1.0) < 0.05, t.name
    finally:
        out.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------
# Failures leave nothing behind


def test_failure_midway_leaves_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = synth._tensor_chunks
    count = {"n": 0}

    def boom(plan, seed):  # type: ignore[no-untyped-def]
        count["n"] += 1
        if count["n"] > 5:
            raise OSError(28, "No space left on device")
        return real(plan, seed)

    monkeypatch.setattr(synth, "_tensor_chunks", boom)
    with pytest.raises(UserError, match="No space left"):
        synth.make_model(tmp_path / "m.gguf")
    assert leftovers(tmp_path) == []


def test_interrupt_leaves_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(plan, seed):  # type: ignore[no-untyped-def]
        raise KeyboardInterrupt

    monkeypatch.setattr(synth, "_tensor_chunks", interrupted)
    with pytest.raises(KeyboardInterrupt):
        synth.make_model(tmp_path / "m.gguf")
    assert leftovers(tmp_path) == []


def test_q4_k_m_without_llama_cpp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp -> ImportError
    with pytest.raises(UserError, match=r"pip install 'p2pswarm\[llama\]'"):
        synth.make_model(tmp_path / "m.gguf", layers=1, qtype="q4_k_m")
    assert leftovers(tmp_path) == []


def test_existing_file_is_kept_on_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "m.gguf"
    out.write_bytes(b"old")
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    with pytest.raises(UserError):
        synth.make_model(out, layers=1, qtype="q4_k_m")
    assert out.read_bytes() == b"old" and leftovers(tmp_path) == ["m.gguf"]


@pytest.mark.parametrize("kwargs, match", [
    (dict(preset="huge"), "unknown preset"),
    (dict(qtype="q2_k"), "unknown type"),
    (dict(layers=0), "layers must be a positive integer"),
    (dict(n_expert_used=32), "must not exceed n_expert"),
    (dict(n_embd=200, qtype="q8_0"), "multiple of 32"),
    (dict(n_head_kv=3), "multiple of n_head_kv"),
    (dict(seed=-1), "seed"),
    (dict(preset="geometry-122b", qtype="q4_k_m"), "Q4_K directly"),
])
def test_bad_options(tmp_path: Path, kwargs: dict, match: str) -> None:
    with pytest.raises(UserError, match=match):
        synth.make_model(tmp_path / "m.gguf", **kwargs)
    assert leftovers(tmp_path) == []


def test_bad_output_and_vocab(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="does not exist"):
        synth.make_model(tmp_path / "missing" / "m.gguf")
    with pytest.raises(UserError, match="is a directory"):
        synth.make_model(tmp_path)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 20)
    with pytest.raises(UserError, match="vocabulary"):
        synth.make_model(tmp_path / "m.gguf", vocab=junk)
    with pytest.raises(UserError, match="not a GGUF"):
        synth.make_model(tmp_path / "m.gguf", vocab=Path(__file__))
    with pytest.raises(UserError, match="cannot read"):
        synth.make_model(tmp_path / "m.gguf", vocab=tmp_path / "nope.gguf")
    # a model without a tokenizer is refused as a vocabulary
    bare = tmp_path / "bare.gguf"
    w = gguf.GGUFWriter(bare, "qwen3moe")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    with pytest.raises(UserError, match="no tokenizer.ggml"):
        synth.make_model(tmp_path / "m.gguf", vocab=bare)
    assert sorted(leftovers(tmp_path)) == ["bare.gguf", "junk.gguf"]


def test_vocab_from_our_own_model_round_trips(models: dict[str, Path], tmp_path: Path) -> None:
    p = synth.make_model(tmp_path / "m.gguf", layers=1, vocab=models["f32"])
    a = {kv.key: kv.value for kv in read_gguf_kv(models["f32"])
         if kv.key.startswith("tokenizer.")}
    b = {kv.key: kv.value for kv in read_gguf_kv(p) if kv.key.startswith("tokenizer.")}
    assert a == b


# ---------------------------------------------------------------------------------------------
# The command


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="p2pswarm")
    sub = parser.add_subparsers(dest="command")
    cmd.add_parser(sub)
    return parser.parse_args(argv)


def test_command_writes_and_reports(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "m.gguf"
    args = parse(["make-model", "-o", str(out), "--layers", "1", "--type", "q8_0", "--seed", "5",
                  "--tied"])
    assert args.func is cmd.run
    assert cmd.run(args) == 0
    line = capsys.readouterr().out
    assert "1 layers" in line and "bytes per expert" in line
    info = synth.describe(out)
    assert info["seed"] == 5 and info["tied"] is True and info["n_layer"] == 1
    ref = synth.make_model(tmp_path / "ref.gguf", layers=1, qtype="q8_0", seed=5, tied=True)
    assert sha256(out) == sha256(ref)


def test_command_defaults_and_errors(tmp_path: Path) -> None:
    args = parse(["make-model", "-o", str(tmp_path / "m.gguf")])
    assert (args.preset, args.qtype, args.seed, args.tied, args.layers) == (
        "tiny", "f32", 0, None, None)
    assert parse(["make-model", "-o", "x", "--untied"]).tied is False
    with pytest.raises(SystemExit):
        parse(["make-model", "-o", "x", "--layers", "0"])
    with pytest.raises(SystemExit):
        parse(["make-model", "-o", "x", "--type", "q2_k"])
    with pytest.raises(SystemExit):
        parse(["make-model", "-o", "x", "--tied", "--untied"])
    with pytest.raises(UserError, match="does not exist"):
        cmd.run(parse(["make-model", "-o", str(tmp_path / "no" / "m.gguf")]))
    with pytest.raises(UserError, match="vocabulary"):
        cmd.run(parse(["make-model", "-o", str(tmp_path / "m.gguf"), "--vocab", __file__]))
    assert leftovers(tmp_path) == []


def test_command_progress_lines_for_long_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """make-model's progress (p2pswarm.progress, as every long command's) off a terminal: a line
    per 10 % and one every 5 s of slow stretches, naming the tensor; nothing for quick work."""
    import io

    from p2pswarm import progress

    clock = [100.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: clock[0])
    monkeypatch.delenv("P2PSWARM_PROGRESS_AFTER", raising=False)
    buf = io.StringIO()
    prog = progress.ProgressBar("make-model", unit="B", stream=buf)
    total = 10**9
    clock[0] += 2  # past the quiet first second
    for i in range(101):
        prog(total * i // 100, total, f"blk.{i // 10}.ffn_up_exps.weight")
    clock[0] += 6  # a slow stretch inside one tenth: a line anyway
    prog(total, total, "output_norm.weight")
    prog.close()
    lines = buf.getvalue().splitlines()
    assert [int(ln.split("%")[0].split()[-1]) for ln in lines] == [*range(10, 101, 10), 100]
    assert lines[0].startswith("make-model:  10% 100MB of 1.00GB, ") and lines[0].endswith("(blk.1.ffn_up_exps.weight)")
    assert lines[-1].endswith("(output_norm.weight)")
    quiet = io.StringIO()
    small = progress.ProgressBar("make-model", unit="B", stream=quiet)
    for i in range(11):
        small(i, 10, "blk.0.attn_q.weight")
    small.close()
    assert quiet.getvalue() == ""


def test_timing_of_tiny(tmp_path: Path) -> None:
    t = time.monotonic()
    synth.make_model(tmp_path / "t.gguf")
    assert time.monotonic() - t < 30  # "makes in seconds" (a loose bound for a loaded machine)
