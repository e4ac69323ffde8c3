"""The model map and the slicer: byte-exact shards, clear refusals, nothing half-written."""
from __future__ import annotations

import hashlib
import os
import shutil

import numpy as np
import pytest
from gguf import GGUFWriter

from p2pswarm.errors import ModelFormatError
from p2pswarm.model.gguf_read import field_value
from p2pswarm.model.layout import ModelLayout
from p2pswarm.model.manifest import model_fingerprint, source_fingerprint
from p2pswarm.model.slicer import slice_backbone, slice_experts, split_ranges, verify_shard

from conftest import assert_one_line_error, run_cli


def _bytes(layout: ModelLayout, off: int, n: int) -> bytes:
    return layout.reader.data[off : off + n].tobytes()


def test_layout_finds_every_expert_tensor(tiny_f32):
    lay = ModelLayout.open(tiny_f32)
    assert lay.arch == "qwen3moe"
    assert lay.expert_layers == list(range(lay.n_layer))
    for il in lay.expert_layers:
        kinds = lay.expert_tensors[il]
        assert set(kinds) == {"gate", "up", "down"}
        for t in kinds.values():
            assert t.n_expert == lay.n_expert
            assert t.expert_nbytes * lay.n_expert == t.nbytes
            # expert e's slab is exactly the e-th outermost slice of the tensor
            arr = lay.tensor(t.name).data
            off, n = t.slab(5)
            assert _bytes(lay, off, n) == np.ascontiguousarray(arr[5]).tobytes()


@pytest.mark.parametrize("layers,experts", [((0, 4), (0, 16)), ((1, 3), (5, 11)), ((2, 3), (15, 16))])
def test_shard_bytes_equal_source_ranges(tiny_f32, tmp_path, layers, experts):
    src = ModelLayout.open(tiny_f32)
    out = tmp_path / "shard.gguf"
    res = slice_experts(tiny_f32, out, layers, experts)
    shard = ModelLayout.open(out)
    assert shard.shard_kind == "experts"
    assert shard.expert_layers == list(range(*layers))
    assert (shard.expert_begin, shard.expert_end) == experts
    assert source_fingerprint(shard) == model_fingerprint(src) == res.source_fingerprint
    n_tensors = 0
    for il in shard.expert_layers:
        for kind, t in shard.expert_tensors[il].items():
            s = src.expert_tensors[il][kind]
            assert t.ggml_type == s.ggml_type and t.shape[1:] == s.shape[1:]
            assert t.n_expert == experts[1] - experts[0]
            assert _bytes(shard, t.data_offset, t.nbytes) == _bytes(src, *s.slabs(*experts))
            n_tensors += 1
    # exactly the asked experts: no dense tensor, nothing else
    assert len(shard.reader.tensors) == n_tensors
    assert {t.name for t in shard.reader.tensors} == set(res.tensors)
    recorded = verify_shard(out)
    for t in shard.reader.tensors:
        assert recorded[t.name] == hashlib.sha256(_bytes(shard, t.data_offset, t.n_bytes)).hexdigest()


def test_quantised_shard_keeps_types(tiny_q8, tmp_path):
    src = ModelLayout.open(tiny_q8)
    out = tmp_path / "q8.gguf"
    slice_experts(tiny_q8, out, None, (3, 9))
    shard = ModelLayout.open(out)
    for il in shard.expert_layers:
        for kind, t in shard.expert_tensors[il].items():
            s = src.expert_tensors[il][kind]
            assert t.ggml_type == s.ggml_type
            assert _bytes(shard, t.data_offset, t.nbytes) == _bytes(src, *s.slabs(3, 9))


def test_backbone_slice_has_everything_but_experts(tiny_f32, tmp_path):
    src = ModelLayout.open(tiny_f32)
    out = tmp_path / "backbone.gguf"
    slice_backbone(tiny_f32, out)
    bb = ModelLayout.open(out)
    assert bb.shard_kind == "backbone" and not bb.expert_tensors
    want = {t.name for t in src.reader.tensors if "_exps." not in t.name}
    assert {t.name for t in bb.reader.tensors} == want
    for t in bb.reader.tensors:
        s = src.tensor(t.name)
        assert _bytes(bb, t.data_offset, t.n_bytes) == _bytes(src, s.data_offset, s.n_bytes)
    # the tokenizer travels with the backbone
    assert field_value(bb.reader.fields["tokenizer.ggml.tokens"]) == field_value(src.reader.fields["tokenizer.ggml.tokens"])
    verify_shard(out)


def test_verify_detects_a_flipped_byte(tiny_f32, tmp_path):
    out = tmp_path / "s.gguf"
    slice_experts(tiny_f32, out, (0, 1), (0, 2))
    lay = ModelLayout.open(out)
    t = lay.reader.tensors[0]
    pos = t.data_offset + 17
    del lay
    with open(out, "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(Exception, match="does not match its recorded sha256"):
        verify_shard(out)


def test_split_ranges_are_even_and_cover():
    assert split_ranges(16, 3) == [(0, 6), (6, 11), (11, 16)]
    assert split_ranges(16, 7)[0] == (0, 3) and split_ranges(16, 7)[-1] == (14, 16)
    for n, k in [(16, 1), (16, 16), (256, 7)]:
        r = split_ranges(n, k)
        assert r[0][0] == 0 and r[-1][1] == n and all(a[1] == b[0] for a, b in zip(r, r[1:]))


# ---- refusals: one line, non-zero exit, no file left behind --------------------------------------
def _dense_gguf(path, arch="llama"):
    w = GGUFWriter(path, arch)
    w.add_block_count(1)
    w.add_embedding_length(8)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.add_tensor("blk.0.ffn_up.weight", np.zeros((16, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _slice(model, tmp_path, *extra):
    out = tmp_path / "out.gguf"
    proc = run_cli("slice", str(model), *extra, "-o", str(out))
    return proc, out


def _no_leftovers(tmp_path):
    return not any(p.name.startswith(("out.gguf", ".out.gguf")) for p in tmp_path.iterdir())


@pytest.mark.slow
@pytest.mark.parametrize("args,needle", [
    (["--layers", "0-9", "--experts", "0-3"], "layers 0-9 out of range"),
    (["--experts", "10-99"], "experts 10-99 out of range"),
    (["--experts", "7-3"], "bad expert range"),
    (["--experts", "x"], "bad expert range"),
    ([], "--experts"),
])
def test_bad_ranges_refused(tiny_f32, tmp_path, args, needle):
    proc, out = _slice(tiny_f32, tmp_path, *args)
    assert_one_line_error(proc, needle)
    assert _no_leftovers(tmp_path)


@pytest.mark.slow
def test_dense_model_refused(tmp_path):
    model = tmp_path / "dense.gguf"
    _dense_gguf(model)
    proc, _ = _slice(model, tmp_path, "--experts", "0-1")
    assert_one_line_error(proc, "dense model")
    assert _no_leftovers(tmp_path)


@pytest.mark.slow
def test_unknown_architecture_refused(tmp_path):
    model = tmp_path / "odd.gguf"
    _dense_gguf(model, arch="frobnicator")
    proc, _ = _slice(model, tmp_path, "--experts", "0-1")
    assert_one_line_error(proc, "unknown architecture 'frobnicator'")
    assert _no_leftovers(tmp_path)


@pytest.mark.slow
def test_truncated_file_refused(tiny_f32, tmp_path):
    model = tmp_path / "cut.gguf"
    data = tiny_f32.read_bytes()
    model.write_bytes(data[: len(data) // 2])
    proc, _ = _slice(model, tmp_path, "--experts", "0-1")
    # the sizes, not numpy's reshape text: what the header needs and what the file has
    assert_one_line_error(proc, "is truncated", f"need {len(data):,} bytes", f"has {len(data) // 2:,}")
    assert "reshape" not in proc.stderr
    assert _no_leftovers(tmp_path)


@pytest.mark.parametrize("mangle,needle", [
    (lambda d: b"NOPE" + d[4:], "bad magic"),
    (lambda d: d[:4] + b"\x63\x00\x00\x00" + d[8:], "corrupt"),  # version 99
    (lambda d: d[:24] + b"\xff" * 64 + d[88:], "corrupt"),  # garbage in the first key
    (lambda d: b"GGUF", "too short"),
])
@pytest.mark.slow
def test_corrupt_file_refused(tiny_f32, tmp_path, mangle, needle):
    model = tmp_path / "bad.gguf"
    model.write_bytes(mangle(tiny_f32.read_bytes()[:1 << 20]))
    proc, _ = _slice(model, tmp_path, "--experts", "0-1")
    assert_one_line_error(proc, needle)
    assert _no_leftovers(tmp_path)


def test_failed_slice_leaves_no_file(tiny_f32, tmp_path, monkeypatch):
    """A failure in the middle of the copy (here: the source shrinks under us) removes the partial file."""
    model = tmp_path / "m.gguf"
    shutil.copy(tiny_f32, model)
    lay = ModelLayout.open(model)
    fp = model_fingerprint(lay)
    os.truncate(model, lay.expert_tensors[2]["down"].data_offset)  # after the map was read
    out = tmp_path / "out.gguf"
    with pytest.raises(Exception, match="short read"):
        slice_experts(model, out, None, (0, 4), layout=lay, fingerprint=fp)
    assert _no_leftovers(tmp_path)


@pytest.mark.slow
def test_slicing_a_shard_is_refused(tiny_f32, tmp_path):
    shard = tmp_path / "s.gguf"
    slice_experts(tiny_f32, shard, None, (0, 4))
    proc, _ = _slice(shard, tmp_path, "--experts", "0-1")
    assert_one_line_error(proc, "already an expert shard")


def test_missing_file_is_one_line(tmp_path):
    with pytest.raises(ModelFormatError, match="no such file"):
        ModelLayout.open(tmp_path / "nope.gguf")


@pytest.mark.slow
def test_slicing_streams_in_bounded_memory(tmp_path):
    """Slicing ~680 MB out of a 1.5 GB geometry-122b model keeps the slicer's peak RSS small."""
    import subprocess
    import sys

    from p2pswarm.model.synth import make_model

    model = make_model(tmp_path / "geo.gguf", preset="geometry-122b", layers=1)
    out = tmp_path / "shard.gguf"
    # VmHWM, not getrusage's ru_maxrss: the latter survives fork + exec, so a child of a large
    # pytest process would report its parent's size.
    code = ("import re, sys; from p2pswarm.cli import main; "
            f"rc = main(['slice', {str(model)!r}, '--experts', '0-127', '-o', {str(out)!r}]); "
            "print('PEAK_KB', re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1)); "
            "sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    peak_mb = int(proc.stdout.split("PEAK_KB")[1].split()[0]) / 1024
    shard_mb = out.stat().st_size / 2**20
    print(f"slice of {shard_mb:.0f} MB: peak RSS {peak_mb:.0f} MB")
    assert shard_mb > 600 and peak_mb < 200
