"""An independent reference nobody here wrote: llama.cpp's own qwen3moe forward pass.

F32 models, llama.cpp with an F32 KV cache and flash attention off; max |logit difference| must be
<= 1e-4 + 2e-5 * max|logit| over a >= 24-token sequence, for our prefill and our token-by-token
decode, on several shapes: tied embeddings, near-tied router scores, other head geometry.
"""
from __future__ import annotations

import numpy as np
import pytest

from p2pswarm.backbone.sessions.local import open_backbone
from p2pswarm.model.synth import make_model

from conftest import llama_logits, needs_llama
from p2pswarm.backbone.serving.generate import sequence_logits

TOKENS = [5, 211, 37, 90, 14, 14, 14, 302, 8, 66, 129, 3, 250, 77, 41, 19, 180, 222, 6, 51, 97, 140, 12, 260,
          33, 71, 2, 118, 199, 45, 88, 301]

SHAPES = {
    "tied": dict(tied=True, seed=11),
    "untied-near-tie-router": dict(tied=False, router_near_tie=True, seed=12),
    "mqa-8-experts-top-2": dict(tied=False, seed=13, n_head=8, n_head_kv=1, head_dim=32, n_expert=8,
                                n_expert_used=2, layers=3),
}


@needs_llama
@pytest.mark.slow
@pytest.mark.parametrize("shape", list(SHAPES))
async def test_f32_logits_match_llama_cpp(models_dir, shape):
    path = models_dir / f"ref-{shape}.gguf"
    if not path.exists():
        make_model(path, preset="tiny", qtype="f32", **SHAPES[shape])
    ref = llama_logits(path, TOKENS)
    async with open_backbone(path, workers=0) as mono:
        prefill = await sequence_logits(mono.backbone, TOKENS)
        decode = await sequence_logits(mono.backbone, TOKENS, decode=True)
    tol = 1e-4 + 2e-5 * float(np.abs(ref).max())
    assert np.abs(ref).max() > 1.0  # real logits, not a degenerate model
    for name, ours in (("prefill", prefill), ("decode", decode)):
        diff = float(np.abs(ours - ref).max())
        print(f"{shape} {name}: max |diff| {diff:.3g} (tolerance {tol:.3g})")
        assert diff <= tol, f"{shape} {name}: max |diff| {diff} > {tol}"
        assert (np.argmax(ours, axis=1) == np.argmax(ref, axis=1)).all()
