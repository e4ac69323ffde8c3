"""Layers without routed experts (GLM-4.5's and DeepSeek's leading dense-FFN layers) through the
backbone's machinery: the router returns no experts, nothing is sent for the layer, the shards,
coverage units and demand hold only the layers that have experts, and split == monolithic and
batched == alone stay bit for bit.

The model is the tiny qwen3moe with layer 0's routed-expert tensors removed from the file, and a
DenseModel that treats such a layer as dense: its FFN is a SwiGLU of the layer's attention
matrices (shapes that fit; the point is that post_moe adds something the workers never see)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import trio

from p2pswarm.backbone.dispatch.dispatcher import Dispatcher, InProcessOwner
from p2pswarm.backbone.serving.runner import Backbone
from p2pswarm.backbone.sessions.local import ensure_shards
from p2pswarm.engine import ops
from p2pswarm.engine.arch.qwen3moe import Qwen3MoE
from p2pswarm.engine.experts.numpy_bank import ExpertBank
from p2pswarm.engine.routing import no_experts
from p2pswarm.model.layout import ModelLayout
from p2pswarm.model.manifest import model_fingerprint
from p2pswarm.net.signed.records import units_for
from p2pswarm.worker.expert_worker import ExpertWorker

from helpers.gguf_edit import rewrite
from p2pswarm.backbone.serving.generate import sequence_logits

TOKENS = [17, 3, 250, 99, 4, 4, 301, 12, 77, 5, 160, 42]


class DenseLead(Qwen3MoE):
    """qwen3moe whose layers without expert tensors are dense: route to nothing, FFN in post_moe."""

    def route(self, il, cur):
        if il not in self.layout.expert_tensors:
            return no_experts(cur.shape[0])
        return super().route(il, cur)

    def post_moe(self, il, h, cur, moe):
        if il not in self.layout.expert_tensors:
            p = f"blk.{il}."
            return h + ops.swiglu_expert(cur, self.w[p + "attn_q.weight"], self.w[p + "attn_q.weight"],
                                         self.w[p + "attn_output.weight"])
        return h + moe


@pytest.fixture(scope="module")
def dense_lead(tiny_f32, tmp_path_factory):
    return rewrite(tiny_f32, tmp_path_factory.mktemp("dense") / "dense0.gguf",
                   drop_tensor=lambda name: name.startswith("blk.0.") and "_exps." in name)


class RecordingOwner(InProcessOwner):
    """An in-process worker that notes the layers it is asked for."""

    def __init__(self, worker, name):
        super().__init__(worker, name)
        self.layers: set[int] = set()

    async def compute(self, layer, cur, groups, family=None):
        self.layers.add(layer)
        return await super().compute(layer, cur, groups, family)


async def _run(path: Path, n_workers: int, shard_dir: Path):
    layout = ModelLayout.open(path)
    model = DenseLead(layout)
    owners = []
    if n_workers:
        shards = ensure_shards(layout, model_fingerprint(layout), n_workers, shard_dir)
        owners = [RecordingOwner(ExpertWorker(s, kernel="numpy"), f"w{i}") for i, s in enumerate(shards)]
    disp = Dispatcher(ExpertBank(layout), owners, fallback=False)
    bb = Backbone(model, disp)
    prefill = await sequence_logits(bb, TOKENS)
    decode = await sequence_logits(bb, TOKENS[:6], decode=True)
    states = [bb.new_state() for _ in range(3)]
    batched = await bb.forward_batch([(TOKENS[i:i + 3 + i], st) for i, st in enumerate(states)])
    alone = [await bb.forward(TOKENS[i:i + 3 + i], bb.new_state()) for i in range(3)]
    return prefill, decode, batched, alone, disp, layout


async def test_dense_layer_through_the_runner_and_workers(dense_lead, tmp_path):
    layout = ModelLayout.open(dense_lead)
    assert layout.expert_layers == [1, 2, 3] and layout.n_layer == 4
    mono = await _run(dense_lead, 0, tmp_path)
    split = await _run(dense_lead, 3, tmp_path)
    for a, b in zip(mono[:2], split[:2]):
        assert np.isfinite(a).all() and np.array_equal(a, b)
    for got in (mono, split):  # batched == alone, bit for bit
        assert all(np.array_equal(x, y) for x, y in zip(got[2], got[3]))
    disp = split[4]
    s = disp.stats
    assert s.requests > 0 and s.local_groups == 0 and s.fallbacks == 0
    assert all(o.layers == {1, 2, 3} for o in disp.owners)  # never asked for layer 0
    assert s.layers == 3 * (1 + 6 + 1 + 3)  # 3 dispatched layers per step (prefill, decode, batch, alone)
    # no work for layer 0: demand counted on layers 1-3 only; layers counted are the expert layers
    assert {layer for layer, _ in disp.demand._counts} == {1, 2, 3}
    # the shards and their coverage units hold layers 1-3 only
    for shard in sorted((tmp_path).glob("*.gguf")):
        lay = ModelLayout.open(shard)
        assert lay.expert_layers == [1, 2, 3]
        info = ExpertWorker.describe_shard(shard, "numpy")
        assert {u.layer for u in units_for("m", (info.layer_begin, info.layer_end),
                                           (info.expert_begin, info.expert_end), 4)} == {1, 2, 3}


def test_dense_layer_changes_the_output(dense_lead, tiny_f32):
    """The dense FFN is really applied (post_moe of layer 0 is not the identity)."""
    async def first_layer(path):
        layout = ModelLayout.open(path)
        model = DenseLead(layout)
        h = model.pre_moe(0, model.embed(np.array(TOKENS)), model.new_state(), 0)
        cur = model.ffn_input(0, h)
        ids, w = model.route(0, cur)
        return ids, model.post_moe(0, h, cur, np.zeros_like(cur)), h

    ids, out, h = trio.run(first_layer, dense_lead)
    assert ids.shape == (len(TOKENS), 0) and not np.array_equal(out, h)


def test_a_dense_layer_is_probed_apart_from_the_routed_ones(dense_lead):
    """The invariance probe's memo key tells a layer without experts from one with them even when
    their dense tensors have the same types: layer 0's route (no experts) is trivially invariant,
    and that answer, reused for layers 1-3, let their router's batched GEMM (not row-invariant under
    OpenBLAS's Haswell kernels, e.g. an AMD EPYC without AVX-512) break batched == alone."""
    from p2pswarm.backbone.serving.runner import _layer_signature

    model = DenseLead(ModelLayout.open(dense_lead))
    assert _layer_signature(model, 0) != _layer_signature(model, 1) == _layer_signature(model, 2)
