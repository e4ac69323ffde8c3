"""Engine pieces: weight types, the bounded expert cache, fused gate+up experts."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter

from p2pswarm.backbone.sessions.local import open_backbone
from p2pswarm.engine.experts.numpy_bank import ExpertBank
from p2pswarm.engine.weights import ByteBoundedCache
from p2pswarm.model.gguf_read import field_value
from p2pswarm.model.layout import ModelLayout
from p2pswarm.model.slicer import slice_experts
from p2pswarm.model.synth import make_model
from p2pswarm.backbone.serving.generate import sequence_logits

TOKENS = [9, 8, 7, 300, 42, 42, 5, 17, 260, 1, 2, 3, 99, 150, 11, 12, 13]


async def _split_vs_mono(model, workers=3):
    async with open_backbone(model, workers=0) as mono:
        want = (await sequence_logits(mono.backbone, TOKENS), await sequence_logits(mono.backbone, TOKENS, decode=True))
    async with open_backbone(model, workers=workers, transport="inproc") as split:
        got = (await sequence_logits(split.backbone, TOKENS), await sequence_logits(split.backbone, TOKENS, decode=True))
    return want, got


@pytest.mark.parametrize("qtype", ["f16", "bf16"])
async def test_half_precision_models_split_exactly(tmp_path, qtype):
    model = make_model(tmp_path / f"{qtype}.gguf", preset="tiny", qtype=qtype, layers=2, seed=5)
    lay = ModelLayout.open(model)
    assert lay.expert_tensors[0]["gate"].ggml_type == GGMLQuantizationType[qtype.upper()]
    (mp, md), (sp, sd) = await _split_vs_mono(model)
    assert np.isfinite(mp).all() and np.array_equal(mp, sp) and np.array_equal(md, sd)


def test_expert_cache_is_bounded(tiny_q8):
    """Dequantised experts are cached up to the byte bound; older ones are evicted, results unchanged."""
    lay = ModelLayout.open(tiny_q8)
    one_expert = 3 * 256 * 256 * 4  # gate + up + down as float32
    bank = ExpertBank(lay, cache_bytes=3 * one_expert)
    x = np.random.default_rng(0).standard_normal((3, 256)).astype(np.float32)
    first = [bank.forward(0, e, x) for e in range(8)]
    assert bank.cache.nbytes <= 3 * one_expert and bank.cache.misses == 8
    again = [bank.forward(0, e, x) for e in range(8)]
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    assert bank.cache.nbytes <= 3 * one_expert
    bank.forward(0, 7, x)
    assert bank.cache.hits >= 1


def test_f32_experts_cost_no_cache_memory(tiny_f32):
    bank = ExpertBank(ModelLayout.open(tiny_f32), cache_bytes=1)
    x = np.ones((1, 256), np.float32)
    for e in range(16):
        bank.forward(1, e, x)
    assert bank.cache.nbytes == 0  # views of the memory map


def test_byte_bounded_cache_lru_order():
    c = ByteBoundedCache(max_bytes=10)
    for k in "abc":
        c.get(k, lambda k=k: k, lambda v: 4)
    assert c.nbytes == 8 and list(c._items) == ["b", "c"]
    c.get("b", lambda: "x", lambda v: 4)  # hit: b becomes most recent
    c.get("d", lambda: "d", lambda v: 4)
    assert list(c._items) == ["b", "d"]


def _fuse(src, dst):
    """Rewrite a model with fused `ffn_gate_up_exps` (gate rows first) instead of gate and up."""
    r = GGUFReader(src)
    arch = field_value(r.fields["general.architecture"])
    w = GGUFWriter(dst, arch)
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        val = field_value(f)
        sub = f.types[-1] if len(f.types) > 1 else None
        w.add_key_value(key, val, f.types[0], sub)
    tensors = {t.name: t for t in r.tensors}
    for name, t in tensors.items():
        if "ffn_up_exps" in name:
            continue
        if "ffn_gate_exps" in name:
            up = tensors[name.replace("gate", "up")]
            fused = np.concatenate([np.asarray(t.data), np.asarray(up.data)], axis=1)
            w.add_tensor(name.replace("gate_exps", "gate_up_exps"), fused)
        else:
            w.add_tensor(name, np.asarray(t.data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


async def test_fused_gate_up_experts(tiny_f32, tmp_path):
    fused = tmp_path / "fused.gguf"
    _fuse(tiny_f32, fused)
    lay = ModelLayout.open(fused)
    assert set(lay.expert_tensors[0]) == {"gate_up", "down"}
    t = lay.expert_tensors[0]["gate_up"]
    assert t.shape == (16, 512, 256) and t.expert_nbytes == 512 * 256 * 4
    # the same experts, computed from the fused layout
    x = np.random.default_rng(1).standard_normal((5, 256)).astype(np.float32)
    sep, fus = ExpertBank(ModelLayout.open(tiny_f32)), ExpertBank(lay)
    for e in (0, 7, 15):
        np.testing.assert_allclose(fus.forward(2, e, x), sep.forward(2, e, x), rtol=1e-5, atol=1e-5)
    # a fused shard is still a pure byte-range copy
    shard = tmp_path / "shard.gguf"
    slice_experts(fused, shard, None, (4, 9))
    s = ModelLayout.open(shard)
    st = s.expert_tensors[1]["gate_up"]
    src = lay.expert_tensors[1]["gate_up"]
    off, n = src.slabs(4, 9)
    assert s.reader.data[st.data_offset : st.data_offset + st.nbytes].tobytes() == lay.reader.data[off : off + n].tobytes()
    # and the split run over fused shards equals the monolithic fused run, bit for bit
    (mp, md), (sp, sd) = await _split_vs_mono(fused, workers=3)
    assert np.array_equal(mp, sp) and np.array_equal(md, sd)
