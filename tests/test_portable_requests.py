"""Workers answer portably on request: the path a backbone verifies any worker through.

A ggml worker process (real socket, real GGUF shard) answers a request that names the portable
family with the same bits as the backbone's own portable kernel, and its ordinary requests with
ggml's bits; it refuses a family it cannot answer in, with the reason. A connection whose hello
asks for portable answers is accepted whatever the peer's own kernel (a ggml backbone of another
ISA verifying this worker); without that, a foreign kernel is still refused at the handshake.
The aarch64 worker under qemu answering a portable request: tests/test_arm64_worker.py.
"""
from __future__ import annotations


import numpy as np
import pytest

from p2pswarm.backbone.sessions.local import open_backbone
from p2pswarm.backbone.owners.socket_owner import SocketOwner
from p2pswarm.engine.experts import ggml_bank as ggml_experts
from p2pswarm.engine import kernels
from p2pswarm.engine.experts import portable_kernel as pk
from p2pswarm.errors import FrameError, WorkerError
from p2pswarm.model.layout import ModelLayout
from p2pswarm.net.wire import expert_protocol as proto
from helpers.ggml import needs_ggml

FOREIGN = "ggml-0.0.0/riscv64+v"  # a ggml kernel of another ISA: its own family, shared by no one here


def test_answer_families_and_request_field():
    assert kernels.answer_families("portable-1/aarch64") == ("portable-1",)
    assert kernels.answer_families(FOREIGN) == (FOREIGN, kernels.portable_family())
    assert kernels.portable_family() == pk.FAMILY
    req = proto.ComputeRequest(7, 2, np.ones((2, 4), np.float32), [(3, np.array([1, 0], np.int32))], "portable-1")
    back = proto.ComputeRequest.from_msg(proto.unpack(req.to_wire()))
    assert back.family == "portable-1" and back.groups[0][0] == 3
    plain = proto.unpack(proto.ComputeRequest(7, 2, req.rows, req.groups).to_wire())
    assert "family" not in plain and proto.ComputeRequest.from_msg(plain).family is None
    with pytest.raises(FrameError, match="family must be a string"):
        proto.ComputeRequest.from_msg({**plain, "family": 5})


@needs_ggml
@pytest.mark.slow
async def test_ggml_worker_answers_portable_requests_bit_equal(tiny_q4km):
    layout = ModelLayout.open(tiny_q4km)
    portable, ggml = pk.PortableExpertBank(layout, threads=1), ggml_experts.GgmlExpertBank(layout, threads=1)
    rng = np.random.default_rng(23)
    x = rng.standard_normal((5, portable.n_embd)).astype(np.float32)
    groups = [(3, np.array([0, 2, 4])), (11, np.arange(5)), (6, np.array([1]))]
    layer = layout.expert_layers[1]
    want_p = portable.forward_groups(layer, x, groups)
    want_g = ggml.forward_groups(layer, x, groups)
    async with open_backbone(tiny_q4km, workers=1, kernel="ggml", threads=1) as swarm:
        owner = swarm.owners[0]
        got_g = await owner.compute(layer, x, groups)
        got_p = await owner.compute(layer, x, groups, family=kernels.portable_family())
        assert owner.families == (kernels.family(ggml.kernel), kernels.portable_family())
        for a, b in zip(got_p, want_p):
            assert np.array_equal(a.view(np.int32), b.view(np.int32)), "portable answer differs from our replica"
        for a, b in zip(got_g, want_g):
            assert np.array_equal(a.view(np.int32), b.view(np.int32))
        assert not all(np.array_equal(a, b) for a, b in zip(got_p, got_g)), "the family field changed nothing"
        with pytest.raises(WorkerError, match="cannot answer in kernel family 'portable-9'.*answers in ggml-"):
            await owner.compute(layer, x, groups, family="portable-9")
        assert len(await owner.compute(layer, x, groups)) == 3  # the connection still serves

        wp = swarm.workers[0]
        ranges = {"layers": owner.layers, "experts": owner.experts}

        def dial(**kw) -> SocketOwner:
            return SocketOwner("verify", wp.host, wp.port, model_fingerprint=swarm.fingerprint, **ranges, **kw)

        # a backbone of a foreign kernel asking for portable answers on the whole connection
        verify = dial(kernel=FOREIGN, family=kernels.portable_family())
        try:
            for a, b in zip(await verify.compute(layer, x, groups), want_p):
                assert np.array_equal(a.view(np.int32), b.view(np.int32))
        finally:
            await verify.aclose()
        for kw, why in (({"kernel": FOREIGN}, "kernel mismatch: peer computes with 'ggml-0.0.0/riscv64"),
                        ({"kernel": FOREIGN, "family": "portable-9"},
                         "kernel family mismatch: peer asks for answers in 'portable-9'")):
            bad = dial(**kw)
            try:
                with pytest.raises(WorkerError, match=why):
                    await bad.compute(layer, x, groups)
            finally:
                await bad.aclose()
