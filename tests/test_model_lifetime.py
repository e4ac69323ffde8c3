"""A closed backbone gives its model back: memory, memory maps and the file's disk space.

The model's objects are frozen out of the cyclic collector while it serves
(``p2pswarm.engine.arch._freeze_loaded_objects``); a process that goes on after the backbone
closes must still be able to free it, or a deleted multi-GB model stays mapped and on disk.
"""
from __future__ import annotations

import gc

from p2pswarm.backbone.session import open_backbone
from p2pswarm.model.synth import make_model

from helpers.ggml import needs_ggml


def _mapped(path) -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if str(path) in line)


async def _serve_with_a_cycle(path) -> None:
    """Open a backbone, tie its model into a reference cycle (as a test that watches the router
    does), run it, close it; the locals go when this returns."""
    async with open_backbone(path, workers=0, kernel="ggml") as swarm:
        model = swarm.backbone.model
        route = model.route
        model.route = lambda il, cur: route(il, cur)  # model -> lambda -> bound method -> model
        await swarm.backbone.logits([1, 2, 3])
        assert gc.get_freeze_count() > 0 and _mapped(path) > 0


@needs_ggml
async def test_a_closed_backbone_frees_its_model_even_in_a_reference_cycle(tmp_path, monkeypatch):
    monkeypatch.delenv("P2PSWARM_NO_GC_FREEZE", raising=False)
    path = make_model(tmp_path / "m.gguf", arch="glm4moe")
    await _serve_with_a_cycle(path)
    path.unlink()
    gc.collect()
    assert _mapped(path) == 0, "the closed model is still mapped: its deleted file still takes disk"
