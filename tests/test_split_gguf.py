"""Split (multi-part) GGUF models, as llama.cpp's gguf-split writes them and big models are
published: every command takes the first part, the result is the unsplit file's, byte for byte.

The models are the tiny random-weight ones ``make-model`` writes, unsplit and cut into 3 parts by
``make-model --split-max-size``'s own writer; every test runs for each architecture in
:data:`SPLIT_ARCHES` (add one there, with its make_model options, to cover it)."""
from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from p2pswarm.model.gguf_read import read_gguf_kv
from p2pswarm.model.layout import ModelLayout
from p2pswarm.model.manifest import build_manifest, model_fingerprint, read_manifest
from p2pswarm.model.split_gguf import model_name, split_path
from p2pswarm.model.split_write import plan_parts, write_split
from p2pswarm.model.synth import make_model
from p2pswarm.net.signed.identity import Identity

from conftest import assert_one_line_error, needs_llama, run_cli
from helpers.llama_ref import llama_logits

#: architecture -> make_model options of its tiny test model
SPLIT_ARCHES = {
    "qwen3moe": {},
    "qwen35moe": {"arch": "qwen35moe"},
    "gpt-oss": {"arch": "gpt-oss"},
    "glm4moe": {"arch": "glm4moe"},
    "deepseek2": {"arch": "deepseek2"},
}
N_PARTS = 3
TOKENS = [5, 17, 42, 99, 100, 7, 256, 300, 12]


def _three_part_size(path: Path) -> int:
    """A --split-max-size that cuts the model at ``path`` into exactly N_PARTS parts."""
    lay = ModelLayout.open(path)
    sizes = [int(t.n_bytes) for t in lay.reader.tensors]
    align = int(lay.reader.alignment)
    for max_bytes in range(sum(sizes) // N_PARTS, sum(sizes), 4096):
        if len(plan_parts(sizes, max_bytes, align)) == N_PARTS:
            return max_bytes
    raise AssertionError("no size gives 3 parts")


def _make_pair(d: Path, arch: str) -> tuple[Path, Path]:
    whole = d / "whole.gguf"
    make_model(whole, seed=7, **SPLIT_ARCHES[arch])
    parts = write_split(whole, str(d / "model"), _three_part_size(whole))
    assert [p.name for p in parts] == [f"model-{i:05d}-of-00003.gguf" for i in (1, 2, 3)]
    return whole, parts[0]


@pytest.fixture(scope="module", params=[a if a == "qwen3moe" else pytest.param(a, marks=pytest.mark.slow) for a in SPLIT_ARCHES])
def pair(request, tmp_path_factory) -> Iterator[tuple[Path, Path]]:
    """(the unsplit model, the first of its 3 parts), for each architecture (qwen3moe in the quick subset).
    Removed after its module: five ~100 MB pairs would otherwise stay on disk for the whole run."""
    d = tmp_path_factory.mktemp(f"split-{request.param}")
    yield _make_pair(d, request.param)
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def one_pair(tmp_path_factory) -> Iterator[tuple[Path, Path]]:
    """The same for one architecture: what a broken part does does not depend on it."""
    d = tmp_path_factory.mktemp("split-bad")
    yield _make_pair(d, "qwen3moe")
    shutil.rmtree(d, ignore_errors=True)


def test_split_reads_as_the_unsplit_file(pair):
    whole, first = pair
    a, b = ModelLayout.open(whole), ModelLayout.open(first)
    assert len(b.parts) == N_PARTS and len(a.parts) == 1
    assert b.header_bytes() == a.header_bytes()
    assert b.file_size == a.file_size == whole.stat().st_size
    assert model_fingerprint(b) == model_fingerprint(a)
    assert list(b.reader.fields) == list(a.reader.fields)
    assert [(t.name, t.data_offset, t.n_bytes) for t in b.reader.tensors] == \
           [(t.name, t.data_offset, t.n_bytes) for t in a.reader.tensors]
    in_parts = {str(p.path) for t in b.reader.tensors for p, _ in [b.locate(int(t.data_offset), int(t.n_bytes))]}
    assert len(in_parts) == N_PARTS  # every part holds tensors, and they are read from there
    for ta, tb in zip(a.reader.tensors, b.reader.tensors):
        assert np.array_equal(ta.data, tb.data), ta.name
        assert b.view(int(tb.data_offset), int(tb.n_bytes)).tobytes() == \
               a.view(int(ta.data_offset), int(ta.n_bytes)).tobytes()
    for layer, kinds in a.expert_tensors.items():
        assert b.expert_tensors[layer] == kinds
    # the signed manifest (every byte hashed, offsets, header hash, size): the same, signature too
    issuer = Identity.generate()
    assert build_manifest(first, issuer, now=1).encode() == build_manifest(whole, issuer, now=1).encode()


def _split_with_gguf_py(whole: Path, out: Path, max_bytes: int) -> Path:
    """``whole`` rewritten in parts by gguf-py's own writer (``GGUFWriter(split_max_size=)``, what
    ``convert_hf_to_gguf.py --split-max-size`` writes published models with); the first part."""
    import gguf

    lay = ModelLayout.open(whole)
    w = gguf.GGUFWriter(out, lay.arch, split_max_size=max_bytes)
    for kv in read_gguf_kv(whole):
        if kv.key != "general.architecture":  # the writer puts it first, as in the unsplit file
            w.add_key_value(kv.key, kv.value, kv.vtype, kv.sub_type)
    for t in lay.reader.tensors:
        w.add_tensor(t.name, t.data, raw_shape=[int(d) for d in reversed(t.shape.tolist())], raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    firsts = sorted(out.parent.glob(f"{out.stem}-00001-of-*.gguf"))
    assert len(firsts) == 1, firsts
    return firsts[0]


@pytest.mark.slow
def test_parts_written_by_gguf_py_read_as_the_unsplit_file(pair, tmp_path):
    """Parts we did not write (gguf-py's writer: no fingerprint key of ours) read the same way."""
    whole, _first = pair
    first = _split_with_gguf_py(whole, tmp_path / "conv.gguf", _three_part_size(whole))
    a, b = ModelLayout.open(whole), ModelLayout.open(first)
    assert len(b.parts) > 1
    assert b.header_bytes() == a.header_bytes() and model_fingerprint(b) == model_fingerprint(a)
    got = []
    for model in (whole, first):
        out = tmp_path / f"{model.stem}.npy"
        run_cli("logits", str(model), "--tokens", ",".join(map(str, TOKENS)), "--out", str(out), check=True)
        got.append(np.load(out))
    assert np.array_equal(got[0], got[1])


@pytest.mark.parametrize("count", [1, 0])
@pytest.mark.slow
def test_one_part_and_merged_files_read_as_the_unsplit_file(one_pair, tmp_path, count):
    """One part (split.count 1: gguf-split with a size above the model's) and a file
    ``gguf-split --merge`` wrote (the split keys kept, split.count 0): the unsplit model, any name."""
    whole, _first = one_pair
    (part,) = write_split(whole, str(tmp_path / "one"), 1 << 40)
    _set_key(part, "split.count", "<H", count)
    merged = part.rename(tmp_path / "merged.gguf")
    a, b = ModelLayout.open(whole), ModelLayout.open(merged)
    assert b.header_bytes() == a.header_bytes() and model_fingerprint(b) == model_fingerprint(a)
    for model in (whole, merged):
        run_cli("slice", str(model), "--backbone", "-o", str(tmp_path / f"{model.stem}-bb.gguf"), check=True)
    assert (tmp_path / "whole-bb.gguf").read_bytes() == (tmp_path / "merged-bb.gguf").read_bytes()


@needs_llama
@pytest.mark.slow
def test_llama_cpp_loads_the_parts_and_computes_the_same_logits(pair):
    whole, first = pair
    assert np.array_equal(llama_logits(first, TOKENS), llama_logits(whole, TOKENS))


@needs_llama
@pytest.mark.slow
def test_quantised_split_model(tmp_path):
    """Q8_0 (dense matrices on ggml's quantised kernels, mapped on the parts): llama.cpp and our
    logits read the parts as the unsplit file."""
    whole = tmp_path / "q8.gguf"
    make_model(whole, qtype="q8_0", seed=9)
    first = write_split(whole, str(tmp_path / "q8"), _three_part_size(whole))[0]
    assert np.array_equal(llama_logits(first, TOKENS), llama_logits(whole, TOKENS))
    got = []
    for model in (whole, first):
        out = tmp_path / f"{model.stem}.npy"
        run_cli("logits", str(model), "--tokens", ",".join(map(str, TOKENS)), "--out", str(out), "--kernel", "ggml",
                check=True)
        got.append(np.load(out))
    assert np.array_equal(got[0], got[1])


@pytest.mark.slow
def test_slices_of_a_split_model_equal_the_unsplit_ones(pair, tmp_path):
    whole, first = pair
    for args in (["--layers", "1-2", "--experts", "3-9"], ["--backbone"]):
        outs = []
        for model in (whole, first):
            out = tmp_path / f"{model.stem}-{args[0]}.gguf"
            run_cli("slice", str(model), *args, "-o", str(out), check=True)
            outs.append(out.read_bytes())
        assert outs[0] == outs[1], args


@pytest.mark.parametrize("kernel", ["ggml", pytest.param("numpy", marks=pytest.mark.slow),
                                    pytest.param("portable", marks=pytest.mark.slow)])
@pytest.mark.slow
def test_logits_of_a_split_model_equal_the_unsplit_ones(pair, tmp_path, kernel):
    """Equal bits; where a kernel refuses the architecture (portable: gpt-oss), the same refusal."""
    whole, first = pair
    got = []
    for model in (whole, first):
        out = tmp_path / f"{model.stem}.npy"
        proc = run_cli("logits", str(model), "--tokens", ",".join(map(str, TOKENS)), "--out", str(out), "--decode",
                       "--kernel", kernel)
        got.append(np.load(out) if proc.returncode == 0 else proc.stderr.replace(str(model), "MODEL"))
    if kernel == "portable" and _portable_refusal(whole):
        assert got[0] == got[1] and _portable_refusal(whole) in got[0]
        return
    assert np.array_equal(got[0], got[1])


def _portable_refusal(model: Path) -> str | None:
    from p2pswarm.engine.experts.portable_kernel import refusal

    return refusal(ModelLayout.open(model))


@pytest.mark.parametrize("implementation,threads", [("c", 1), ("c", 2), ("numpy", 1)])
def test_portable_kernel_on_the_parts(pair, implementation, threads):
    """The portable kernel's experts (one C call per expert, the threaded per-matrix path, and its
    numpy twin) read a split model's parts as the unsplit file."""
    from p2pswarm.engine.experts.portable_kernel import PortableExpertBank

    whole, first = pair
    why = _portable_refusal(whole)
    if why is not None:  # an architecture the portable kernel refuses: refused alike, split or not
        assert _portable_refusal(first) == why
        return
    banks = [PortableExpertBank(ModelLayout.open(m), threads=threads, implementation=implementation)
             for m in (whole, first)]
    rows = np.random.default_rng(0).standard_normal((64, banks[0].n_embd)).astype(np.float32)
    layers = sorted(banks[0].layers)
    split = banks[1].layout
    held_in = {split.locate(t.data_offset, t.nbytes)[0].path for il in (layers[0], layers[-1])
               for t in split.expert_tensors[il].values()}
    assert len(held_in) > 1, held_in  # so some are read from a part that is not the first
    for layer in (layers[0], layers[-1]):
        for expert in (0, banks[0].expert_end - 1):
            a, b = (bank.forward(layer, expert, rows) for bank in banks)
            assert np.array_equal(a, b), (layer, expert)


@pytest.mark.slow
def test_generate_from_a_split_model(pair):
    whole, first = pair
    texts = [run_cli("generate", str(m), "--prompt", "Hello swarm", "--max-tokens", "8", check=True).stdout
             for m in (whole, first)]
    assert texts[0] == texts[1] and texts[0].strip()


@pytest.mark.slow
def test_manifest_of_a_split_model_equals_the_unsplit_ones(pair, tmp_path):
    whole, first = pair
    key = tmp_path / "issuer.key"
    run_cli("identity", "--path", str(key), check=True)
    got = []
    for model in (whole, first):
        out = tmp_path / f"{model.stem}.manifest"
        run_cli("manifest", "--model", str(model), "--key", str(key), "--out", str(out), check=True)
        got.append(replace(read_manifest(out), issued_at=0, signature=b"", body=b""))
    # the same model, the same bytes at the same offsets: only the signing time may differ
    assert got[0] == got[1]
    assert got[1].file_size == whole.stat().st_size


def test_model_name_drops_the_part_suffix():
    assert model_name("/x/dssplit-00001-of-00005.gguf") == "dssplit"
    assert model_name("tiny.gguf") == "tiny" and model_name("a-1-of-2.gguf") == "a-1-of-2"
    assert model_name("-00001-of-00002.gguf") == "-00001-of-00002"  # nothing left: the name as it is


@pytest.mark.slow
def test_make_model_writes_parts_with_progress(tmp_path):
    out = tmp_path / "m.gguf"
    proc = run_cli("make-model", "-o", str(out), "--seed", "7", "--split-max-size", "10M", check=True,
                   env={"P2PSWARM_PROGRESS_AFTER": "0"})
    parts = sorted(tmp_path.glob("m-*-of-*.gguf"))
    assert len(parts) > 1 and parts[0].name == f"m-00001-of-{len(parts):05d}.gguf", parts
    assert str(parts[0]) in proc.stdout and f"{len(parts)} parts" in proc.stdout
    assert "make-model" in proc.stderr and f"part {len(parts)} of {len(parts)}" in proc.stderr, proc.stderr
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no leftovers
    whole = tmp_path / "whole.gguf"
    make_model(whole, seed=7)
    assert model_fingerprint(ModelLayout.open(parts[0])) == model_fingerprint(ModelLayout.open(whole))
    for bad in ("lots", "0", "-5M"):
        proc = run_cli("make-model", "-o", str(tmp_path / "bad.gguf"), f"--split-max-size={bad}")
        assert_one_line_error(proc, "size", repr(bad))
        assert proc.returncode == 2 and not list(tmp_path.glob("bad*"))


# ---- bad input: one line, exit 2, naming the part --------------------------------------------------


@pytest.fixture
def parts_copy(one_pair, tmp_path) -> list[Path]:
    """A private copy of the 3 parts (the tests break them)."""
    _whole, first = one_pair
    prefix = str(first)[: -len("-00001-of-00003.gguf")]
    out = []
    for i in range(N_PARTS):
        dst = split_path(tmp_path / "m", i, N_PARTS)
        shutil.copyfile(split_path(prefix, i, N_PARTS), dst)
        out.append(dst)
    return out


def _set_key(path: Path, key: str, fmt: str, value) -> None:
    """Overwrite the value of integer key ``key`` in place."""
    data = bytearray(path.read_bytes())
    raw = struct.pack("<Q", len(key)) + key.encode()
    at = data.index(raw) + len(raw) + 4
    data[at: at + struct.calcsize(fmt)] = struct.pack(fmt, value)
    path.write_bytes(bytes(data))


def _refused(model: Path, *needles: str, cmd: str = "slice") -> None:
    """``cmd`` on ``model`` exits 2 with one line holding every needle (all commands open a model
    the same way: ModelLayout.open)."""
    args = {"slice": ["slice", str(model), "--backbone", "-o", str(model.parent / "bb.gguf")],
            "logits": ["logits", str(model), "--tokens", "1,2", "--out", str(model.parent / "l.npy")],
            "manifest": ["manifest", "--model", str(model), "--key", str(model.parent / "k.key"),
                         "--out", str(model.parent / "m.manifest")]}[cmd]
    if cmd == "manifest":
        run_cli("identity", "--path", str(model.parent / "k.key"), check=True)
    proc = run_cli(*args)
    assert_one_line_error(proc, *needles)
    assert proc.returncode == 2, proc.stderr
    assert not (model.parent / "bb.gguf").exists() and not (model.parent / "m.manifest").exists()


@pytest.mark.slow
def test_missing_part(parts_copy):
    parts_copy[2].unlink()
    _refused(parts_copy[0], parts_copy[2].name, "part 3 of 3", "missing", cmd="logits")


@pytest.mark.slow
def test_part_of_another_model(parts_copy, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    whole = other / "whole.gguf"
    make_model(whole, seed=8, **SPLIT_ARCHES[ModelLayout.open(parts_copy[0]).arch])  # same shape, other weights
    theirs = write_split(whole, str(other / "m"), _three_part_size(whole))
    assert len(theirs) == N_PARTS
    shutil.copyfile(theirs[1], parts_copy[1])
    _refused(parts_copy[0], parts_copy[1].name, "another model", cmd="manifest")


@pytest.mark.slow
def test_part_given_first(parts_copy):
    _refused(parts_copy[1], parts_copy[1].name, "part 2 of 3", "first part", "-00001-of-00003.gguf")


@pytest.mark.slow
def test_wrong_split_no(parts_copy):
    _set_key(parts_copy[2], "split.no", "<H", 1)
    _refused(parts_copy[0], parts_copy[2].name, "part 2 of 3", "expected part 3 of 3")


@pytest.mark.slow
def test_wrong_split_count(parts_copy):
    _set_key(parts_copy[1], "split.count", "<H", 4)
    _refused(parts_copy[0], parts_copy[1].name, "of 4", "expected part 2 of 3")


@pytest.mark.slow
def test_tensor_count_mismatch(parts_copy):
    for p in parts_copy:
        _set_key(p, "split.tensors.count", "<i", 1000)
    _refused(parts_copy[0], parts_copy[0].name, "split.tensors.count is 1000", cmd="logits")


@pytest.mark.slow
def test_first_part_misnamed(parts_copy):
    renamed = parts_copy[0].with_name("model.gguf")
    parts_copy[0].rename(renamed)
    _refused(renamed, "model.gguf", "-00001-of-00003.gguf")


@pytest.mark.slow
def test_truncated_part(parts_copy):
    with open(parts_copy[1], "r+b") as f:
        f.truncate(os.path.getsize(parts_copy[1]) - 4096)
    _refused(parts_copy[0], parts_copy[1].name)


# ---- a swarm served from a split model (real processes) ---------------------------------------------


@pytest.mark.slow
def test_backbone_node_serves_a_swarm_from_the_first_part(pair, tmp_path):
    """`node --role backbone --model <first part>` with a manifest of the split model: a worker with
    no shard downloads its slice from it (the shard server reads the parts) and gets the unsplit
    model's slice byte for byte; with a second worker (a shard cut from the parts) the backbone
    answers a completion through the swarm as the unsplit model does alone, no fallback."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from helpers.procs import Proc, assert_swarm_logits_exact, start_bootstrap, start_shard_workers, wait_until
    from p2pswarm.model.slicer import slice_experts

    whole, first = pair
    env = dict(os.environ, P2PSWARM_KERNEL="numpy", P2PSWARM_HOME=str(tmp_path / "home"))
    lay = ModelLayout.open(first)
    fp, last, half = model_fingerprint(lay), lay.n_layer - 1, lay.n_expert // 2
    key = tmp_path / "issuer.key"
    issuer = run_cli("identity", "--path", str(key), env=env, check=True).stdout.split()[-1]
    worker_id = run_cli("identity", "--path", str(tmp_path / "w.key"), env=env, check=True).stdout.split()[-1]
    manifest, token = tmp_path / "m.manifest", tmp_path / "w.token"
    run_cli("manifest", "--model", str(first), "--key", str(key), "--out", str(manifest), env=env, check=True)
    run_cli("token", "issue", "--key", str(key), "--peer", worker_id, "--allow",
            f"shard:{fp}:0-{last}:{half}-{lay.n_expert - 1}", "--ttl", "1h", "--out", str(token), env=env, check=True)
    nodes: list[Proc] = []
    try:
        boot = start_bootstrap(tmp_path, env)
        nodes.append(boot)
        bb = Proc(["node", "--role", "backbone", "--model", str(first), "--manifest", str(manifest),
                   "--bootstrap", boot.addr, "--http", "127.0.0.1:0", "--identity", str(tmp_path / "bb.key")],
                  tmp_path / "bb.log", env)
        nodes.append(bb)
        nodes.append(Proc(["node", "--role", "worker", "--model", fp, "--layers", f"0-{last}", "--experts",
                           f"{half}-{lay.n_expert - 1}", "--token", str(token), "--trust-issuer", issuer,
                           "--bootstrap", boot.addr, "--identity", str(tmp_path / "w.key")], tmp_path / "w.log", env))
        downloaded = tmp_path / "home" / "shards" / f"{fp[:16]}-L0-{last}-E{half}-{lay.n_expert - 1}.gguf"
        sliced = tmp_path / "sliced.gguf"
        slice_experts(whole, sliced, (0, lay.n_layer), (half, lay.n_expert))  # the range the token names
        assert downloaded.read_bytes() == sliced.read_bytes()
        nodes += start_shard_workers(first, tmp_path, env, [(0, half)], boot.addr)

        base = next(w for w in bb.ready if w.startswith("http="))[5:].replace("0.0.0.0", "127.0.0.1")
        with httpx.Client(base_url=base, timeout=120) as c:
            wait_until(lambda: len(c.get("/v1/swarm").json()["workers"]) == 2, timeout=60, interval=0.5,
                       what="both workers seen by the backbone")
            # the served name is the model's, not its first part's (model, not model-00001-of-00003)
            assert [m["id"] for m in c.get("/v1/models").json()["data"]] == [model_name(first)] == ["model"]
            r = c.post("/v1/completions", json={"prompt": "Hello swarm", "max_tokens": 8, "temperature": 0})
            assert r.status_code == 200, r.text
            text = r.json()["choices"][0]["text"]
            fams = {f.name: f for f in text_string_to_metric_families(c.get("/metrics").text)}
        alone = run_cli("generate", str(whole), "--prompt", "Hello swarm", "--max-tokens", "8", env=env, check=True)
        assert text and alone.stdout == "Hello swarm" + text + "\n"

        def total(name: str) -> float:
            return sum(s.value for s in fams[name].samples if s.name.endswith("_total"))

        assert total("p2pswarm_expert_requests") > 0 and total("p2pswarm_expert_fallbacks") == 0
        status = run_cli("swarm-status", "--bootstrap", boot.addr, "--model", str(first), "--kernel", "numpy",
                         "--json", env=env, check=True)
        assert json.loads(status.stdout.strip().splitlines()[-1])["missing"] == 0
        # and a backbone process of its own (`logits --swarm` on the first part): the monolithic bits
        assert_swarm_logits_exact(first, ",".join(map(str, TOKENS)), boot.addr, tmp_path, env, decode=True)
    finally:
        for n in reversed(nodes):
            n.stop()
