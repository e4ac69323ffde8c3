"""Split == monolithic with a wire switch on and off (P2PSWARM_WIRE_INPUTS, P2PSWARM_WIRE_CODEC).

Why: every change to what crosses the expert RPC must leave the logits bit for bit those of the
monolithic run, whether the change is on or off; the tests differ only in what they check of the
owners and of the bytes."""
from __future__ import annotations

import numpy as np
from p2pswarm.backbone.serving.generate import sequence_logits

TOKENS = [17, 3, 250, 99, 4, 4, 301, 12]


async def wire_by_switch(path, var: str, monkeypatch, check) -> dict[str, tuple[int, int]]:
    """Two worker processes over sockets, with ``var`` on then off: the logits (prefill and decode)
    equal the monolithic run's and no group fell back to the backbone; ``check(swarm, on)`` runs
    after them (the owners have said hello by then). Returns switch -> (bytes sent, received)."""
    from p2pswarm.backbone.sessions.local import open_backbone

    async with open_backbone(path) as mono:
        want = await sequence_logits(mono.backbone, TOKENS)
        want_decode = await sequence_logits(mono.backbone, TOKENS, decode=True)
    wire = {}
    for switch in ("on", "off"):
        monkeypatch.setenv(var, switch)
        async with open_backbone(path, workers=2, transport="socket") as swarm:
            d = swarm.backbone.dispatcher
            got = await sequence_logits(swarm.backbone, TOKENS)
            got_decode = await sequence_logits(swarm.backbone, TOKENS, decode=True)
            assert d.stats.fallbacks == 0 and d.stats.local_groups == 0 and d.stats.requests > 0
            check(swarm, switch == "on")
            wire[switch] = (d.wire.sent, d.wire.received)
        assert np.array_equal(got, want) and np.array_equal(got_decode, want_decode), f"{var}={switch}"
    return wire
