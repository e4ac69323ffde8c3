"""Would a lossless codec pay on the expert RPC's float32 output rows?

Runs the backbone alone on a synthetic model (``--preset``; the geometry-122b one at 1 layer by
default) over a prompt and decode steps, records every expert call's output rows (float32, as a
worker returns them), and reports for each coding: the bytes relative to raw, and the CPU time to
encode + decode a MiB on this machine; then what that saves per token and the link speed below
which it pays (when the bytes saved take longer on the link than the coding takes on the CPU).

Codings: what the wire ships (p2pswarm.net.wire.codec: four byte planes, each zstd-1 on its own),
zlib (stdlib), zstandard, lz4 and blosc2 (PyPI; optional: ``pip install lz4 blosc2``), blosc2 with
its own byte shuffle or bit shuffle, the others each on
the raw bytes and on a byte-plane split (the 4 bytes of each float32 regrouped: sign+exponent
bytes together, mantissa bytes together), which is what makes float data compressible if anything does.

    python bench/bench_wire_codec.py [--preset geometry-122b] [--layers 1] [--tokens 16] [--batch 64]
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
import zlib
from pathlib import Path

import msgpack
import numpy as np
import trio
from common import header

from p2pswarm.backbone.sessions.local import open_backbone
from p2pswarm.model.synth import make_model
from p2pswarm.net.wire import expert_protocol as proto
from p2pswarm.net.wire import codec as wire_codec
from p2pswarm.backbone.serving.generate import sequence_logits


def planes(b: bytes) -> bytes:
    return np.frombuffer(b, np.uint8).reshape(-1, 4).T.copy().tobytes()


def unplanes(b: bytes) -> bytes:
    return np.frombuffer(b, np.uint8).reshape(4, -1).T.copy().tobytes()


def codecs() -> dict:
    out = {"zlib-1": (lambda b: zlib.compress(b, 1), zlib.decompress)}
    try:
        import zstandard

        c1, c3, d = zstandard.ZstdCompressor(level=1), zstandard.ZstdCompressor(level=3), zstandard.ZstdDecompressor()
        out["zstd-1"] = (c1.compress, d.decompress)
        out["zstd-3"] = (c3.compress, d.decompress)
    except ImportError:
        pass
    try:
        import lz4.block
        import lz4.frame

        out["lz4"] = (lz4.frame.compress, lz4.frame.decompress)
        out["lz4 block"] = (lz4.block.compress, lz4.block.decompress)
    except ImportError:
        pass
    if wire_codec.can_code():  # what the wire does (its array map, msgpack overhead included)
        out["planes-zstd (shipped)"] = (
            lambda b: proto.pack(wire_codec.encode_f32(np.frombuffer(b, np.float32))),
            lambda c: wire_codec.decode_f32(msgpack.unpackb(c, raw=False), "bench").tobytes())
    try:
        import blosc2

        blosc2.set_nthreads(1)  # one core: what a phone's worker thread has to spare
        for cname, codec in (("lz4", blosc2.Codec.LZ4), ("zstd-1", blosc2.Codec.ZSTD)):
            for fname, filt in (("shuffle", blosc2.Filter.SHUFFLE), ("bitshuffle", blosc2.Filter.BITSHUFFLE)):
                def enc(b, codec=codec, filt=filt):
                    return blosc2.compress(b, typesize=4, clevel=1, filter=filt, codec=codec)
                out[f"blosc2 {fname} + {cname}"] = (enc, blosc2.decompress)
    except ImportError:
        pass
    return out


async def capture(model: Path, tokens: list[int], steps: int) -> tuple[list[bytes], list[bytes]]:
    """Every expert call's (input rows, output rows) as the wire would carry them (float32)."""
    ins, outs = [], []
    async with open_backbone(model) as swarm:
        bank = swarm.backbone.dispatcher.local.bank
        orig = bank.forward_groups

        def recording(layer, rows, groups, *a):
            res = orig(layer, rows, groups, *a)
            ins.append(np.ascontiguousarray(rows, np.float32).tobytes())
            outs.append(np.concatenate(res).astype(np.float32).tobytes() if res else b"")
            return res

        bank.forward_groups = recording
        await sequence_logits(swarm.backbone, tokens[:steps], decode=True)  # token by token: decode steps
    return ins, outs


async def capture_batch(model: Path, n: int, steps: int) -> tuple[list[bytes], list[bytes], float]:
    """Expert calls' output rows of ``n`` sequences batched as bench_throughput.py sends them (its
    prompts, one prefill step, then ``steps`` greedy decode steps): (prefill outputs, decode outputs,
    the share of the prefill's output rows that repeat another row of the same call, byte for byte:
    prompts that share a prefix share its hidden states, hence those rows)."""
    from p2pswarm.engine.text.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(model)
    pre, dec, dup = [], [], []
    async with open_backbone(model) as swarm:
        bb = swarm.backbone
        bank = bb.dispatcher.local.bank
        orig = bank.forward_groups
        sink = pre

        def recording(layer, rows, groups, *a):
            res = orig(layer, rows, groups, *a)
            out = np.concatenate(res).astype(np.float32) if res else np.zeros((0, 1), np.float32)
            sink.append(out.tobytes())
            if sink is pre and len(out):
                dup.append(1 - len({x.tobytes() for x in out}) / len(out))
            return res

        # a first batch, not recorded: the runner's one-off invariance probes compute rows twice
        await bb.forward_batch([(tok.encode("warm up"), bb.new_state()), (tok.encode("two"), bb.new_state())])
        bank.forward_groups = recording
        states = [bb.new_state() for _ in range(n)]
        items = [(tok.encode(f"client {i} asks"), st) for i, st in enumerate(states)]  # bench_throughput's prompts
        logits = await bb.forward_batch(items, last_only=True)
        sink = dec
        for _ in range(steps):
            nxt = [[int(np.argmax(lg[-1]))] for lg in logits]
            logits = await bb.forward_batch(list(zip(nxt, states)), last_only=True)
    return pre, dec, float(np.mean(dup)) if dup else 0.0


def measure(name: str, blobs: list[bytes]) -> list[str]:
    """One table row per coding: size vs raw, encode and decode CPU ms per MiB, the break-even link."""
    raw = sum(len(b) for b in blobs)
    lines = []
    for cname, (enc, dec) in codecs().items():
        # blosc2 shuffles internally; a numpy byte-plane split in front of it would undo nothing useful
        for split in ((False,) if cname.startswith(("blosc2", "planes")) else (False, True)):
            size, t_enc, t_dec = 0, 0.0, 0.0
            for b in blobs:
                t0 = time.process_time()
                c = enc(planes(b) if split else b)
                t1 = time.process_time()
                back = dec(c)
                back = unplanes(back) if split else back
                t_enc, t_dec = t_enc + t1 - t0, t_dec + time.process_time() - t1
                if bytes(back) != b:
                    raise RuntimeError(f"{cname} did not round-trip")
                size += len(c)
            mib = raw / 2**20
            ms_per_mib = 1000 * (t_enc + t_dec) / mib
            saved = 1 - size / raw
            # it pays when the bytes saved take longer on the link than the coding costs:
            # saved * 1 MiB * 8 / mbps > ms_per_mib / 1000  =>  mbps < saved * 8 * 2**20 / (ms_per_mib / 1000) / 1e6
            pays_below = saved * 8 * 2**20 / (ms_per_mib / 1000) / 1e6 if saved > 0 else 0.0
            lines.append(f"| {name} | {cname}{' + byte planes' if split else ''} | {size / raw:.3f} | "
                         f"{1000 * t_enc / mib:.1f} | {1000 * t_dec / mib:.1f} | {pays_below:.0f} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="geometry-122b")
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--batch", type=int, default=0,
                    help="also N sequences batched as bench_throughput.py sends them (its prompts), "
                         "prefill and decode apart")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="wire-codec-") as d:
        model = Path(d) / "m.gguf"
        make_model(model, preset=args.preset, qtype="q8_0", seed=2, layers=args.layers)
        ins, outs = trio.run(capture, model, [17 + 7 * i for i in range(args.tokens)], args.tokens)
        batch = trio.run(capture_batch, model, args.batch, args.tokens) if args.batch else None
    lines = ["| rows | coding | bytes vs raw | encode CPU ms / MiB | decode CPU ms / MiB | pays on links below (Mbit/s) |",
             "|---|---|---|---|---|---|"]
    lines += measure("outputs (f32)", outs)
    lines += measure("inputs (f32)", ins)
    if batch:
        pre, dec, dup = batch
        lines += measure(f"outputs, {args.batch} sequences' prefill ({100 * dup:.0f}% of a call's rows repeat "
                         "another of its rows)", pre)
        lines += measure(f"outputs, {args.batch} sequences' decode steps", dec)
    text = header("Lossless coding of the expert RPC's float32 rows",
                  f"python bench/bench_wire_codec.py --preset {args.preset} --layers {args.layers} --tokens {args.tokens}") + (
        f"{len(outs)} expert calls of a {args.preset} model ({args.layers} layer(s)), decode steps 1..{args.tokens}, "
        f"{sum(map(len, outs)) / 1e6:.1f} MB of output rows; CPU time on this {os.cpu_count()}-core machine.\n\n"
    ) + "\n".join(lines) + "\n"
    print(text)


if __name__ == "__main__":
    main()
