"""``--wire-precision f16|bf16``: outputs rounded to 16 bits everywhere, so split == monolithic stays
bit for bit while the workers send half the output bytes (p2pswarm.net.wire.precision)."""
from __future__ import annotations

import numpy as np
import pytest

from p2pswarm.errors import UserError
from p2pswarm.net.wire import expert_protocol as proto
from p2pswarm.net.wire import precision as wp
from p2pswarm.backbone.serving.generate import sequence_logits


def test_rounding_is_nearest_even_idempotent_and_survives_the_wire():
    rng = np.random.default_rng(0)
    a = (rng.standard_normal((64, 256)) * np.exp(rng.uniform(-20, 12, (64, 1)))).astype(np.float32)
    a[0, :4] = [1e6, -1e6, np.inf, 0.0]
    for p in wp.PRECISIONS:
        r = wp.round_to(a, p)
        assert r.dtype == np.float32 and np.array_equal(wp.round_to(r, p), r)  # idempotent
        back = proto.result_from_wire(proto.unpack(proto.result_to_wire(1, [a], 256, p))["out"])
        assert np.array_equal(back, r)
    f16 = wp.round_to(a, "f16")
    assert f16[0, 0] == wp.F16_MAX and f16[0, 1] == -wp.F16_MAX  # saturates, never inf from a finite value
    bf = wp.round_to(a, "bf16")
    assert not (bf.view(np.uint32) & 0xFFFF).any()
    ok = np.isfinite(a)
    # nearest: within half a bf16 ulp (8 bits of mantissa) of the float32
    assert np.all(np.abs(bf[ok] - a[ok]) <= np.abs(a[ok]) * 2.0 ** -8)
    # ties go to even: 1 + 2^-8 is halfway between 1 and 1 + 2^-7 -> 1; 1 + 3 * 2^-8 -> 1 + 2^-6
    ties = np.array([1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8], np.float32)
    assert wp.round_to(ties, "bf16").tolist() == [1.0, 1 + 2.0 ** -6]


@pytest.mark.parametrize("precision", ["f16", "bf16"])
@pytest.mark.slow
async def test_split_equals_monolithic_at_a_wire_precision(tiny_q8, precision):
    """Worker processes over sockets send 16-bit outputs; the logits equal a backbone alone at the
    same precision bit for bit, differ from float32's, and about half the output bytes came back."""
    from p2pswarm.backbone.sessions.local import open_backbone

    tokens = [17, 3, 250, 99, 4, 4, 301, 12]
    got, received = {}, {}
    for p, workers in ((precision, 0), (precision, 2), (None, 2)):
        async with open_backbone(tiny_q8, workers=workers, transport="socket") as swarm:
            d = swarm.backbone.dispatcher
            d.set_wire_precision(p)
            got[p, workers] = (await sequence_logits(swarm.backbone, tokens), await sequence_logits(swarm.backbone, tokens, decode=True))
            if workers:
                assert d.stats.fallbacks == 0 and d.stats.local_groups == 0 and d.stats.requests > 0
                received[p] = d.wire.received
    for i in range(2):
        assert np.array_equal(got[precision, 2][i], got[precision, 0][i]), "split != monolithic"
        assert not np.array_equal(got[precision, 2][i], got[None, 2][i]), "the precision changed nothing"
    assert received[precision] < 0.6 * received[None], received


async def test_a_bad_wire_precision_is_a_clear_error(tiny_f32):
    from p2pswarm.backbone.sessions.local import open_backbone

    async with open_backbone(tiny_f32) as swarm:
        with pytest.raises(UserError, match="wire-precision"):
            swarm.backbone.dispatcher.set_wire_precision("f8")
