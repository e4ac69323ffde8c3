"""Every implementation of p2pswarm/contracts.py's Protocols has every member, and really
implements it (a subclass that only inherits a Protocol's stub would pass isinstance).

Real objects over a real GGUF: the three expert kernels' banks, both
architectures' dense models, and the owner transports (checked on their classes: building a
remote owner needs a worker process, which the swarm tests start).
"""
from __future__ import annotations

import inspect

import numpy as np
import pytest

from p2pswarm import contracts
from p2pswarm.backbone.dispatch.dispatcher import InProcessOwner, LocalOwner
from p2pswarm.backbone.owners.libp2p_owner import Libp2pOwner
from p2pswarm.backbone.owners.socket_owner import SocketOwner
from p2pswarm.engine.arch import load_dense
from p2pswarm.engine.kernels import make_bank
from p2pswarm.model.layout import ModelLayout
from p2pswarm.model.synth import make_model


def _implements(obj, proto) -> list[str]:
    """Members of ``proto`` that ``obj``'s class leaves as the Protocol's own stub."""
    stubs = []
    for name, member in vars(proto).items():
        if name.startswith("_") and name != "__getitem__" or not callable(member):
            continue
        if getattr(type(obj), name, None) is member:
            stubs.append(name)
    return stubs


@pytest.mark.parametrize("kernel", ["numpy", "portable", "ggml"])  # pip install builds libggml
def test_every_bank_is_an_expert_bank(tiny_f32, kernel):
    bank = make_bank(ModelLayout.open(tiny_f32), kernel)
    assert isinstance(bank, contracts.ExpertBank) and _implements(bank, contracts.ExpertBank) == []
    assert isinstance(bank.kernel, str) and bank.kernel
    rows = np.random.default_rng(0).standard_normal((3, 256), dtype=np.float32)
    assert bank.holds(0, 0)
    one = bank.forward(0, 1, rows)
    (grouped,) = bank.forward_groups(0, rows, [(1, np.arange(3))])
    assert one.shape == (3, 256) and np.array_equal(one, grouped)


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen35moe", "gpt-oss", "glm4moe", "deepseek2"])
def test_every_architecture_is_a_dense_model(tmp_path, arch):
    model = load_dense(ModelLayout.open(make_model(tmp_path / "m.gguf", arch=arch, layers=1)))
    assert isinstance(model, contracts.DenseModel) and _implements(model, contracts.DenseModel) == []
    assert isinstance(model.w, contracts.DenseWeights) and _implements(model.w, contracts.DenseWeights) == []
    name = model.output_name
    assert not model.w.is_loaded(name)
    marker = np.zeros((1, 1), np.float32)
    assert model.w.provide(name, marker) and model.w[name] is marker
    assert not model.w.provide(name, np.ones(1)) and model.w[name] is marker  # never replaced twice


@pytest.mark.parametrize("cls", [LocalOwner, InProcessOwner, SocketOwner, Libp2pOwner])
def test_every_owner_implements_owner(cls):
    assert contracts.Owner in cls.__mro__  # subclassed for the defaults
    for name in ("holds", "compute"):
        assert getattr(cls, name) is not getattr(contracts.Owner, name), f"{cls.__name__}.{name} is the stub"
    assert inspect.iscoroutinefunction(cls.compute) and inspect.iscoroutinefunction(cls.aclose)
    assert isinstance(cls.name, str) and isinstance(cls.remote, bool)


def test_owner_members_have_defaults_the_dispatcher_reads():
    """What the dispatcher's hot path and the status page read of an owner is on the Protocol, with
    a default, so neither probes attributes: a socket worker has no peer id (its name stands in),
    no round trip until measured, and its status says what it knows."""
    from p2pswarm.backbone.dispatch.dispatcher import peer_of

    o = SocketOwner("w0", "127.0.0.1", 1, model_fingerprint="x", kernel="numpy", layers=(0, 2), experts=(0, 4))
    assert o.peer is None and peer_of(o) == "w0"
    assert o.rtt_s is None and o.recovered_at is None and o.refused is None and o.predict_s(10) is None
    st = o.status()
    assert isinstance(st, contracts.OwnerStatus)
    assert (st.peer, st.rtt_s, st.kernel, st.refused) == (None, None, "numpy", None)
    assert st.wire == o.wire.as_dict()
    o.refused = "kernel mismatch"
    assert o.status().refused == "kernel mismatch"
