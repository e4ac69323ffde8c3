"""Would a lossless codec pay on the expert RPC's float32 output rows?

Runs the backbone alone on a synthetic model (``--preset``; the geometry-122b one at 1 layer by
default) over a prompt and decode steps, records every expert call's output rows (float32, as a
worker returns them), and reports for each coding: the bytes relative to raw, and the CPU time to
encode + decode a MiB on this machine; then what that saves per token and the link speed below
which it pays (when the bytes saved take longer on the link than the coding takes on the CPU).

Codings: zlib (stdlib), zstandard and lz4 (PyPI; optional: ``pip install zstandard lz4``), each on
the raw bytes and on a byte-plane split (the 4 bytes of each float32 regrouped: sign+exponent
bytes together, mantissa bytes together), which is what makes float data compressible if anything does.

    python bench/bench_wire_codec.py [--preset geometry-122b] [--layers 1] [--tokens 16]
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np
import trio
from common import header

from p2pswarm.backbone.session import open_backbone
from p2pswarm.model.synth import make_model


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
        import lz4.frame

        out["lz4"] = (lz4.frame.compress, lz4.frame.decompress)
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
        await swarm.backbone.logits(tokens[:steps], decode=True)  # token by token: decode steps
    return ins, outs


def measure(name: str, blobs: list[bytes]) -> list[str]:
    raw = sum(len(b) for b in blobs)
    lines = []
    for cname, (enc, dec) in codecs().items():
        for split in (False, True):
            size, t0 = 0, time.process_time()
            for b in blobs:
                data = planes(b) if split else b
                c = enc(data)
                back = dec(c)
                if (unplanes(back) if split else back) != b:
                    raise RuntimeError(f"{cname} did not round-trip")
                size += len(c)
            cpu = time.process_time() - t0
            ms_per_mib = 1000 * cpu / (raw / 2**20)
            saved = 1 - size / raw
            # it pays when the bytes saved take longer on the link than the coding costs:
            # saved * 1 MiB * 8 / mbps > ms_per_mib / 1000  =>  mbps < saved * 8 * 2**20 / (ms_per_mib / 1000) / 1e6
            pays_below = saved * 8 * 2**20 / (ms_per_mib / 1000) / 1e6 if saved > 0 else 0.0
            lines.append(f"| {name} | {cname}{' + byte planes' if split else ''} | {size / raw:.3f} | "
                         f"{ms_per_mib:.1f} | {pays_below:.0f} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="geometry-122b")
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=16)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="wire-codec-") as d:
        model = Path(d) / "m.gguf"
        make_model(model, preset=args.preset, qtype="q8_0", seed=2, layers=args.layers)
        ins, outs = trio.run(capture, model, [17 + 7 * i for i in range(args.tokens)], args.tokens)
    lines = ["| rows | coding | bytes vs raw | CPU ms per MiB (encode + decode, one core) | pays on links below (Mbit/s) |",
             "|---|---|---|---|---|"]
    lines += measure("outputs (f32)", outs)
    lines += measure("inputs (f32)", ins)
    text = header("Lossless coding of the expert RPC's float32 rows",
                  f"python bench/bench_wire_codec.py --preset {args.preset} --layers {args.layers} --tokens {args.tokens}") + (
        f"{len(outs)} expert calls of a {args.preset} model ({args.layers} layer(s)), decode steps 1..{args.tokens}, "
        f"{sum(map(len, outs)) / 1e6:.1f} MB of output rows; CPU time on this {os.cpu_count()}-core machine.\n\n"
    ) + "\n".join(lines) + "\n"
    print(text)


if __name__ == "__main__":
    main()
