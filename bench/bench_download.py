"""Partial shard download over `/p2pswarm/shard/1.0.0` vs a plain local copy, on the geometry-122b model.

    python bench/bench_download.py [--layers 1] [--experts 32] [--dir /tmp/p2pswarm-bench]

A `p2pswarm serve-shards` process serves the model over libp2p on 127.0.0.1 (TCP + Noise + yamux);
`p2pswarm fetch` processes download experts 0..N-1 of every layer (timed wall clock, process start
and DHT-free dial included, and the download's own rate as it reports it). Baselines: `cp` + `sync`
of the same number of bytes, and `p2pswarm slice` (the local byte-range copy the download must
reproduce). Everything reads from a warm page cache. Also times `build_manifest` (sha256 of every
byte of the model). Runs alternate; the median of each is reported.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import REPO, geometry_model, header

from p2pswarm.model.manifest import build_manifest, write_manifest
from p2pswarm.model.slicer import slice_experts
from p2pswarm.net.signed.identity import load_or_create_identity
from p2pswarm.net.signed.tokens import issue_token


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--experts", type=int, default=32, help="experts per layer in the slice")
    ap.add_argument("--dir", default="/tmp/p2pswarm-bench")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    d = Path(args.dir)
    model = geometry_model(d, args.layers)
    work = Path(tempfile.mkdtemp(prefix="bench-dl-", dir=d))
    issuer = load_or_create_identity(work / "issuer.key")
    worker = load_or_create_identity(work / "worker.key")
    t = time.perf_counter()
    m = build_manifest(model, issuer)
    t_manifest = time.perf_counter() - t
    write_manifest(m, work / "m.manifest")
    token = issue_token(issuer, worker.peer_id_str, ["shard"], 3600).encode()
    env = dict(os.environ, PYTHONPATH=str(REPO), P2PSWARM_HOME=str(work / "home"))
    cli = [sys.executable, "-m", "p2pswarm.cli"]
    server = subprocess.Popen([*cli, "serve-shards", "--model", str(model), "--manifest", str(work / "m.manifest"),
                               "--trust-issuer", issuer.peer_id_str, "--identity", str(work / "server.key")],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    line: list[str] = []
    th = threading.Thread(target=lambda: line.append(server.stdout.readline()), daemon=True)
    th.start()
    th.join(60)
    if not line or not line[0].startswith("READY "):
        server.kill()
        raise SystemExit("serve-shards did not start")
    addr = line[0].split()[1]
    shard = work / "shard.gguf"
    ref = work / "ref.gguf"
    res = slice_experts(model, ref, None, (0, args.experts))
    n = res.nbytes
    blob, out = work / "blob", work / "copy"
    with open(model, "rb") as f, open(blob, "wb") as g:
        g.write(f.read(n))
    runs: dict[str, list[float]] = {"fetch, 4 streams (wall)": [], "fetch, 1 stream (wall)": [], "slice": [],
                                    "cp + sync": []}
    reported: dict[str, list[float]] = {"fetch, 4 streams (wall)": [], "fetch, 1 stream (wall)": []}

    def fetch(streams: int, name: str) -> None:
        shard.unlink(missing_ok=True)
        p = subprocess.run([*cli, "fetch", "--model", m.fingerprint, "--layers", f"0-{args.layers - 1}", "--experts",
                            f"0-{args.experts - 1}", "--source", addr, "--token", token, "--trust-issuer",
                            issuer.peer_id_str, "--identity", str(work / "worker.key"), "--out", str(shard),
                            "--streams", str(streams)], capture_output=True, text=True, env=env, check=True)
        reported[name].append(float(re.search(r"([\d.]+) MB/s", p.stdout).group(1)))

    def timed(name, fn):
        for p in (shard, out):
            p.unlink(missing_ok=True)
        subprocess.run(["sync"], check=True)
        t = time.perf_counter()
        fn()
        runs[name].append(time.perf_counter() - t)

    try:
        for _ in range(args.repeat):
            timed("fetch, 4 streams (wall)", lambda: fetch(4, "fetch, 4 streams (wall)"))
            assert shard.read_bytes() == ref.read_bytes()
            timed("fetch, 1 stream (wall)", lambda: fetch(1, "fetch, 1 stream (wall)"))
            timed("slice", lambda: (shard.unlink(missing_ok=True), slice_experts(model, shard, None, (0, args.experts))))
            timed("cp + sync", lambda: (subprocess.run(["cp", str(blob), str(out)], check=True),
                                        subprocess.run(["sync", str(out)], check=True)))
    finally:
        server.terminate()
        server.wait(30)
    med = {k: statistics.median(v) for k, v in runs.items()}
    text = header("Partial shard download vs local copy (geometry-122b)",
                  f"python bench/bench_download.py --layers {args.layers} --experts {args.experts}")
    text += (f"Slice: experts 0-{args.experts - 1} of {args.layers} layer(s), {n / 1e6:.0f} MB of tensor data, "
             f"{args.layers * 3 * args.experts} slabs of {res.nbytes // (args.layers * 3 * args.experts):,} bytes "
             f"(model {model.stat().st_size / 1e9:.2f} GB). Server and client are processes on this machine, over "
             f"libp2p (TCP + Noise + yamux) on 127.0.0.1; every slab is sha256-checked before it is written. "
             f"Median of {args.repeat}.\n\n| run | seconds | MB/s |\n|---|---|---|\n")
    for k, v in med.items():
        text += f"| {k} | {v:.2f} | {n / v / 1e6:.0f} |\n"
    for k, v in reported.items():
        text += f"| {k.replace('(wall)', '(transfer only, as reported)')} | | {statistics.median(v):.0f} |\n"
    text += (f"\nRatio fetch (4 streams, wall) / (cp + sync) throughput: "
             f"**{med['cp + sync'] / med['fetch, 4 streams (wall)']:.2f}**; fetch / slice: "
             f"{med['slice'] / med['fetch, 4 streams (wall)']:.2f}. Manifest of the whole model "
             f"({model.stat().st_size / 1e9:.2f} GB, sha256 of every tensor and expert slab, 2 threads): "
             f"{t_manifest:.1f} s ({model.stat().st_size / t_manifest / 1e6:.0f} MB/s).\n")
    print(text)
    for p in (shard, blob, out, ref):
        p.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
