"""Lossless coding on the expert RPC (p2pswarm.net.wire.codec): the same bits, fewer bytes.

Float32 outputs byte-plane split + zstd, and Q8_K input rows without their derivable ``bsums``,
must decode to exactly the bytes that were coded; the Q8_K sums recomputed on the worker must equal
the ones libggml's own quantiser writes; end to end over worker processes the logits stay equal to
the monolithic run's, with fewer bytes on the wire, and ``P2PSWARM_WIRE_CODEC=off`` turns it off.
"""
from __future__ import annotations

import numpy as np
import pytest
import zstandard

from p2pswarm.engine.ggml.inputs import InputQuantiser
from p2pswarm.engine.ggml.lib import load_libggml
from p2pswarm.errors import FrameError
from p2pswarm.net.wire import expert_protocol as proto
from p2pswarm.net.wire import codec as wire_codec


def _awkward_floats(rng, n: int, e: int) -> np.ndarray:
    a = (rng.standard_normal((n, e)) * rng.uniform(1e-3, 50, (n, 1))).astype(np.float32)
    flat = a.reshape(-1)
    if flat.size >= 8:
        flat[:8] = [np.nan, np.inf, -np.inf, -0.0, 1e-45, -1e-40, 3.4e38, 0.0]  # NaN, infs, denormals
    return a


@pytest.mark.parametrize("shape", [(0, 64), (1, 64), (3, 256), (40, 3072)])
def test_coded_outputs_decode_to_the_same_bits(shape):
    a = _awkward_floats(np.random.default_rng(shape[0]), *shape)
    frame = proto.result_to_wire(5, [a], shape[1], coding=wire_codec.OUTPUT_CODING)
    msg = proto.unpack(frame)
    assert proto.result_coded(msg["out"])
    back = proto.result_from_wire(msg["out"])
    assert back.dtype == np.float32 and back.shape == a.shape
    assert np.array_equal(back.view(np.uint32), a.view(np.uint32))  # bits, NaN included
    if shape[0] >= 40:  # real-sized rows: the sign/exponent plane compresses, so the frame shrinks
        plain = proto.result_to_wire(5, [a], shape[1])
        assert len(frame) < 0.93 * len(plain), (len(frame), len(plain))


def test_a_coding_the_worker_does_not_know_or_a_precision_answers_plain():
    a = np.ones((2, 8), np.float32)
    for kw in ({"coding": "lzma-9"}, {"coding": wire_codec.OUTPUT_CODING, "precision": "f16"}):
        out = proto.unpack(proto.result_to_wire(1, [a], 8, **kw))["out"]
        assert not proto.result_coded(out) and np.array_equal(proto.result_from_wire(out), a)


def _coded(n: int = 64) -> dict:
    return wire_codec.encode_f32(np.linspace(-3, 3, n, dtype=np.float32).reshape(-1, 8))


@pytest.mark.parametrize("spoil", [
    lambda d: d.update(planes=d["planes"][:3]),
    lambda d: d.update(zstd=[1, 0, 0, 1]),
    lambda d: d.update(shape=[9, 8]),  # planes hold 8 x 8 values
    lambda d: d.update(planes=[b"\x28\xb5\x2f\xfd junk"] * 4, zstd=[True] * 4),
    # a plane that inflates past the array's size (a small frame of many zeros)
    lambda d: d.update(planes=[zstandard.ZstdCompressor().compress(bytes(1 << 20))] * 4, zstd=[True] * 4),
    lambda d: d.update(dtype="<i4"),
])
def test_a_malformed_coded_array_is_a_frame_error(spoil):
    d = _coded()
    spoil(d)
    with pytest.raises(FrameError, match="malformed result"):
        proto.result_from_wire(proto.unpack(proto.pack({"op": "result", "out": d}))["out"])


@pytest.mark.parametrize("n_rows", [1, 5, 33])
def test_q8_K_rows_without_their_sums_unpack_to_ggmls_own_bytes(n_rows):
    """The bsums recomputed from the quants equal what libggml's Q8_K quantiser wrote, including
    rows whose quants sit at the int8 extremes; through the request encoding too."""
    rng = np.random.default_rng(n_rows)
    rows = (rng.standard_normal((n_rows, 512)) * rng.uniform(1e-3, 1e3, (n_rows, 1))).astype(np.float32)
    rows[0, :16] = rows[0].max() * 4  # a block with 16 quants at +127
    q = InputQuantiser(load_libggml())("q8_K", rows)
    packed = wire_codec.pack_q8_K(q)
    assert packed.shape == (n_rows, 2 * 260)
    assert np.array_equal(wire_codec.unpack_q8_K(packed), q)
    req = proto.ComputeRequest(1, 0, q, [(0, np.arange(n_rows, dtype=np.int32))], form="q8_K", packed=True)
    wire = req.to_wire()
    plain = proto.ComputeRequest(1, 0, q, req.groups, form="q8_K").to_wire()
    # 32 bytes a block of 256 fewer (two blocks a row), less the longer dtype name
    assert len(plain) - len(wire) == n_rows * 2 * 32 - (len(wire_codec.Q8_K_PACKED) - len("q8_K"))
    back = proto.ComputeRequest.from_msg(proto.unpack(wire))
    assert back.form == "q8_K" and np.array_equal(back.rows, q)


def test_a_packed_row_of_the_wrong_size_is_a_frame_error():
    with pytest.raises(FrameError, match="do not make"):
        proto.rows_from_wire({"dtype": wire_codec.Q8_K_PACKED, "shape": [1, 256], "data": bytes(292)})


@pytest.mark.slow
async def test_worker_processes_code_the_wire_and_the_logits_stay_exact(tiny_q4km, monkeypatch):
    """Worker OS processes (Q4_K experts: q8_K inputs) over sockets: with the codec on (default)
    the owners ask for coded outputs and send packed inputs, fewer bytes both ways than with
    P2PSWARM_WIRE_CODEC=off; the logits equal the monolithic run's bit for bit either way."""
    from helpers.wire_switch import wire_by_switch

    def check(swarm, on):
        assert all((o.output_coding == wire_codec.OUTPUT_CODING) == on for o in swarm.owners)
        assert all((wire_codec.Q8_K_PACKED in o.input_forms) == on for o in swarm.owners)

    wire = await wire_by_switch(tiny_q4km, "P2PSWARM_WIRE_CODEC", monkeypatch, check)
    # sent: 32 of a row's 292 bytes (E 256: one Q8_K block), less the requests' other fields
    assert wire["on"][0] < 0.98 * wire["off"][0] and wire["on"][1] < 0.95 * wire["off"][1], wire
