"""Pieces the architecture tests share (qwen35moe, gpt-oss, glm4moe, deepseek2): the token ids every
reference check feeds, a monolithic forward pass through an arch object and a bank, prefill and
decode logits through a backbone, and the batching schedule (batched == alone). The logits tolerance is in helpers.compare, GGUF edits in helpers.gguf_edit."""
from __future__ import annotations


import numpy as np

from p2pswarm.backbone.serving.runner import combine, expert_groups
from p2pswarm.backbone.sessions.local import open_backbone
from p2pswarm.backbone.serving.generate import sequence_logits

TOKENS = [5, 211, 37, 90, 14, 14, 14, 302, 8, 66, 129, 3, 250, 77, 41, 19, 180, 222, 6, 51, 97, 140, 12, 260,
          33, 71, 2, 118, 199, 45, 88, 301]


def forward(model, bank, tokens, state=None, pos0=0):
    """Monolithic forward through the arch object and the bank, without the async backbone."""
    state = state or model.new_state()
    h = model.embed(np.asarray(tokens))
    for il in range(model.n_layer):
        h = model.pre_moe(il, h, state, pos0)
        cur = model.ffn_input(il, h)
        ids, w = model.route(il, cur)
        groups = expert_groups(ids)
        partials = dict(zip([e for e, _ in groups], bank.forward_groups(il, cur, groups)))
        h = model.post_moe(il, h, cur, combine(ids, w, groups, partials))
    return model.output(h)


# (sequence, tokens) per step: prefill chunks of different lengths mixed with decode rows, sequences
# joining late and one leaving early
async def backbone_logits(path, tokens, workers=0, transport="inproc", kernel=None):
    """All-position logits of ``tokens`` by a backbone on ``path`` (``workers`` shard workers over
    ``transport``), as one prefill and as one-token decode steps; and the backbone's dispatcher."""
    async with open_backbone(path, workers=workers, transport=transport, kernel=kernel) as swarm:
        prefill = await sequence_logits(swarm.backbone, tokens)
        decode = await sequence_logits(swarm.backbone, tokens, decode=True)
        disp = swarm.backbone.dispatcher
    return prefill, decode, disp


SCHEDULE = [
    [(0, [17, 3, 250, 99, 4, 4, 301]), (1, [12, 77, 5])],
    [(0, [160]), (1, [42, 8, 200, 31, 64]), (2, [9, 120, 2, 88])],
    [(0, [270]), (1, [15]), (2, [6]), (3, [190, 11, 23, 47, 51, 302, 13, 7, 91])],
    [(1, [33]), (2, [400]), (3, [1])],
    [(0, [2]), (2, [8]), (3, [77, 78])],
]


async def run_schedule(backbone, invariant: bool) -> list[list[np.ndarray]]:
    states = {}
    out: list[list[np.ndarray]] = []
    for step in SCHEDULE:
        items = [(toks, states.setdefault(s, backbone.new_state())) for s, toks in step]
        out.append(await backbone.forward_batch(items, batch_invariant=invariant))
    return out


async def alone(backbone) -> dict[tuple[int, int], np.ndarray]:
    """Each sequence of SCHEDULE on its own, fed the same chunks: (step, sequence) -> logits."""
    res = {}
    for seq in range(4):
        state = backbone.new_state()
        for i, step in enumerate(SCHEDULE):
            for s, toks in step:
                if s == seq:
                    res[(i, s)] = (await backbone.forward_batch([(toks, state)], batch_invariant=True))[0]
    return res


async def experts_in_front_and_per_call(path, tokens=TOKENS):
    """A one-sequence prefill and token-by-token decode of ``tokens`` on the ggml kernel, every
    expert local, with a layer's experts computed in front of the next layer's graph and without
    (the model's ``experts_in_front`` off): ``{True: (prefill, decode, fused boundaries), False: ...}``
    and the model's layer count."""
    got = {}
    for fused in (True, False):
        async with open_backbone(path, workers=0, kernel="ggml") as mono:
            bb = mono.backbone
            bb.model.experts_in_front = fused
            got[fused] = (await sequence_logits(bb, tokens), await sequence_logits(bb, tokens, decode=True),
                          bb.fused_layers)
            n_layer = bb.model.n_layer
    return got, n_layer
