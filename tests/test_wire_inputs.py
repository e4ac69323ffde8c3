"""Expert inputs shipped pre-quantised: the same output bits as float32 rows.

ggml quantises a K-quant / Q8_0 / F16 mat-mul's float32 input to the weight type's vec_dot_type
itself; rows quantised on the backbone by the same libggml, handed to ``mul_mat_id`` already in
that type, must give exactly the outputs the float32 rows give, for every kernel family (weight
type) and row count (the per-row vec_dot path and the tiled GEMM from 8 rows), and over a socket.
"""
from __future__ import annotations

import numpy as np
import pytest

from p2pswarm.engine.experts.ggml_bank import GgmlExpertBank
from p2pswarm.engine.ggml.lib import load_libggml
from p2pswarm.model.layout import ModelLayout
from p2pswarm.model.synth import make_model
from p2pswarm.net.wire import expert_protocol as proto

# (model qtype, expert qtype, the input form its experts take, arch)
FAMILIES = [("f32", None, None, None), ("q8_0", None, "q8_0", None), ("q8_0", "q4_k", "q8_K", None),
            ("f16", None, "f16", None), ("f32", "mxfp4", "q8_0", "gpt-oss")]  # gpt-oss: biases, swiglu_oai


@pytest.fixture(scope="module", params=FAMILIES, ids=lambda f: f[1] or f[0])
def bank(request, tmp_path_factory):
    qtype, expert_qtype, form, arch = request.param
    path = tmp_path_factory.mktemp("inputs") / f"tiny-{qtype}-{expert_qtype}.gguf"
    make_model(path, preset="tiny", qtype=qtype, expert_qtype=expert_qtype, seed=5, **({"arch": arch} if arch else {}))
    b = GgmlExpertBank(ModelLayout.open(path), lib=load_libggml())
    yield b, form
    b.close()


@pytest.mark.parametrize("n_rows", [1, 3, 9, 40])
def test_pre_quantised_rows_give_the_same_bits(bank, n_rows):
    b, form = bank
    rng = np.random.default_rng(n_rows)
    rows = (rng.standard_normal((n_rows, b.n_embd)) * rng.uniform(0.01, 30, (n_rows, 1))).astype(np.float32)
    groups = [(e, np.sort(rng.choice(n_rows, size=max(1, n_rows * 2 // 3), replace=False)).astype(np.int32))
              for e in range(0, b.expert_end, 3)]
    for layer in sorted(b.layers):
        assert b.input_form(layer) == form
        want = b.forward_groups(layer, rows, groups)
        q, got_form = b.quantise_input(layer, rows)
        assert got_form == form
        if form is None:
            continue
        _, block, block_bytes = proto.INPUT_FORMS[form]
        assert q.dtype == np.uint8 and q.shape == (n_rows, b.n_embd // block * block_bytes)
        # through the wire encoding too
        req = proto.ComputeRequest(1, layer, q, groups, form=form)
        back = proto.ComputeRequest.from_msg(proto.unpack(req.to_wire()))
        assert back.form == form and np.array_equal(back.rows, q)
        got = b.forward_groups(layer, back.rows, back.groups, form)
        assert all(np.array_equal(w, g) for w, g in zip(want, got)), f"layer {layer}: {form} rows changed the output"


def test_a_form_the_layer_does_not_take_is_refused(bank):
    from p2pswarm.errors import UserError

    b, form = bank
    layer = min(b.layers)
    rows = np.ones((2, b.n_embd), np.float32)
    other = "bf16" if form != "bf16" else "q8_0"
    q = np.zeros((2, b.n_embd // proto.INPUT_FORMS[other][1] * proto.INPUT_FORMS[other][2]), np.uint8)
    with pytest.raises(UserError, match="takes"):
        b.forward_groups(layer, q, [(0, np.array([0, 1]))], other)
    assert b.forward_groups(layer, rows, [(0, np.array([0, 1]))])[0].shape == (2, b.n_embd)


@pytest.mark.parametrize("model", ["tiny_q8", "tiny_q4km"])
@pytest.mark.slow
async def test_worker_processes_take_quantised_rows_and_the_logits_stay_exact(request, model, monkeypatch):
    """Worker OS processes over sockets: with the switch on (the default) the rows go in the
    workers' form (fewer bytes sent), with P2PSWARM_WIRE_INPUTS=off as float32; the logits of
    both equal the monolithic run's bit for bit, and no group fell back to the backbone."""
    from helpers.wire_switch import wire_by_switch

    def check(swarm, on):
        assert all((o.input_quantiser is not None) == on for o in swarm.owners)
        assert all(o.input_forms for o in swarm.owners)  # the workers said they take a form

    wire = await wire_by_switch(request.getfixturevalue(model), "P2PSWARM_WIRE_INPUTS", monkeypatch, check)
    assert wire["on"][0] < 0.5 * wire["off"][0], wire


@pytest.mark.parametrize("dtype", [{"a": 1}, [1, 2], 7, None])
def test_rows_with_a_non_string_dtype_are_a_frame_error(dtype):
    """A fuzzed request's rows may carry any msgpack value as their dtype: a FrameError (the stream
    is closed with its reason), never a TypeError from looking a dict up in the forms table."""
    from p2pswarm.errors import FrameError
    from p2pswarm.net.wire.expert_protocol import rows_from_wire

    with pytest.raises(FrameError):
        rows_from_wire({"dtype": dtype, "shape": [1, 4], "data": b"\0" * 16})


@pytest.mark.parametrize("n_rows", [1, 9, 40])
def test_a_layers_rows_quantised_once_are_each_owners_bytes(bank, n_rows):
    """LayerInputs (the dispatcher's: a layer's rows quantised once for all its owners): the rows
    an owner packs from them are the bytes it made from its own rows, for every form and row
    count; another layer's or another array's rows get nothing from it."""
    from p2pswarm.backbone.owners.local_owners import LayerInputs, pack_rows

    b, form = bank
    rng = np.random.default_rng(100 + n_rows)
    cur = (rng.standard_normal((n_rows, b.n_embd)) * rng.uniform(0.01, 30, (n_rows, 1))).astype(np.float32)
    memo = LayerInputs(0, cur)
    whole = memo.quantised(b, 0, cur)
    assert whole is not None and whole[1] == form
    assert memo.quantised(b, 0, cur) is whole  # made once
    for owner in range(3):  # three owners' groups, overlapping rows
        groups = [(e, np.sort(rng.choice(n_rows, size=max(1, n_rows // 2), replace=False)).astype(np.int32))
                  for e in range(owner, b.expert_end, 3)]
        own_rows, own_groups = pack_rows(cur, groups)
        own, own_form = b.quantise_input(0, own_rows)
        shared, shared_groups = pack_rows(whole[0], groups)
        assert own_form == form and shared.dtype == own.dtype and shared.tobytes() == own.tobytes()
        assert all(e == f and np.array_equal(i, j) for (e, i), (f, j) in zip(own_groups, shared_groups))
    assert memo.quantised(b, 1, cur) is None
    assert memo.quantised(b, 0, cur.copy()) is None
