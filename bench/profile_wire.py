"""Where the Python time of an expert request goes: py-spy on the backbone and one worker.

    python bench/profile_wire.py --rtt 0 --n 64 [--tokens 8] [--rounds 3] [--out DIR]

The swarm of bench/bench_throughput.py (bootstrap, 4 workers each behind a WAN proxy, backbone with
the HTTP API). After a warm-up, ``py-spy record --gil`` samples the backbone and worker 0 (only
threads holding the GIL: the Python work, which the GIL serialises) while ``--rounds`` rounds of N concurrent
requests run. py-spy's raw ("collapsed") stacks are written to DIR, and the samples by activity
(sending, receiving, (de)serialisation, expert math, dense path, thread hand-offs, trio), by
library, and the top frames by self and inclusive time are printed (``--report DIR`` again later), with CPU ms per expert request of each process (from /proc). Needs ptrace (py-spy).
"""
from __future__ import annotations

import argparse
import collections
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
from bench_throughput import RANGES, measure
from wan_swarm import WanSwarm, cpu_seconds

from p2pswarm.model.synth import make_model

BUCKETS = (  # (label, substring of a frame's "function (file:line)") - first match wins, leaf upwards
    ("noise (cryptography AEAD)", "cryptography/"),
    ("noise (py-libp2p)", "libp2p/security/"),
    ("yamux", "libp2p/stream_muxer/"),
    ("libp2p other", "libp2p/"),
    ("msgpack", "msgpack"),
    ("framing/stream adapter", "p2pswarm/net/"),
    ("worker server/compute", "p2pswarm/worker/"),
    ("expert kernel", "p2pswarm/engine/"),
    ("dispatch/owners", "p2pswarm/backbone/"),
    ("trio", "trio/"),
    ("numpy", "numpy/"),
)


ACTIVITIES = (  # (label, substrings of a frame); see activities()
    ("msgpack + array (de)serialisation", ("msgpack", "to_wire", "from_wire", "expert_protocol.py:", "pack_rows")),
    ("expert math (worker, or local/verify on the backbone)", ("ExpertWorker.compute", "GgmlExpertBank", "Verifier")),
    ("dense path (backbone threads)", ("forward_batch.<locals>", "runner.py")),
    ("send: framing, yamux, Noise, socket", ("send_frame", "YamuxStream.write", "_write_frame", "send_window_update")),
    ("receive: yamux reader, Noise, read-ahead, frame reader", ("Yamux.handle_incoming", "_handle_incoming", "StreamAdapter._pump",
                                                               "FrameReader", "receive_some", "read_stream")),
    ("thread hand-off (to_thread, thread cache)", ("_threads.py", "_thread_cache.py")),
    ("HTTP API (hypercorn, handlers)", ("hypercorn", "http_api", "h11")),
    ("dispatch / scheduler / owners (ours)", ("p2pswarm/backbone/", "p2pswarm/worker/")),
    ("trio scheduler, epoll, wake-ups", ("trio/",)),
)


def activities(stacks: list[tuple[list[str], int]]) -> collections.Counter:
    """Samples per activity: the innermost frame matching one of ours wins (a lock taken inside
    ``YamuxStream.write`` is sending); the last (trio) only where no other matches."""
    specific, (fallback, fb_keys) = ACTIVITIES[:-1], ACTIVITIES[-1]
    out: collections.Counter = collections.Counter()
    for frames, n in stacks:
        lab = next((lab for f in reversed(frames) for lab, keys in specific if any(k in f for k in keys)), None)
        if lab is None:
            lab = fallback if any(k in f for f in frames for k in fb_keys) else "other"
        out[lab] += n
    return out


def parse(path: Path) -> list[tuple[list[str], int]]:
    out = []
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if stack:
            out.append((stack.split(";"), int(n)))
    return out


def report(name: str, stacks: list[tuple[list[str], int]], top: int = 25) -> str:
    total = sum(n for _, n in stacks) or 1
    self_t: collections.Counter = collections.Counter()
    incl: collections.Counter = collections.Counter()
    bucket: collections.Counter = collections.Counter()
    for frames, n in stacks:
        self_t[frames[-1]] += n
        for f in set(frames):
            incl[f] += n
        for f in reversed(frames):
            lab = next((lab for lab, key in BUCKETS if key in f), None)
            if lab:
                bucket[lab] += n
                break
        else:
            bucket["other"] += n
    lines = [f"== {name}: {total} samples holding the GIL", "-- by activity (innermost matching frame):"]
    lines += [f"  {100 * n / total:5.1f}%  {lab}" for lab, n in activities(stacks).most_common()]
    lines.append("-- by library of the leaf-most known frame:")
    lines += [f"  {100 * n / total:5.1f}%  {lab}" for lab, n in bucket.most_common()]
    lines.append("-- self time:")
    lines += [f"  {100 * n / total:5.1f}%  {f[:150]}" for f, n in self_t.most_common(top)]
    lines.append("-- inclusive (p2pswarm, libp2p, msgpack, trio frames):")
    keys = ("p2pswarm/", "libp2p/", "msgpack", "trio/_core/_run", "trio/_threads")
    lines += [f"  {100 * n / total:5.1f}%  {f[:150]}" for f, n in incl.most_common(400)
              if any(k in f for k in keys)][:top]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rtt", type=float, default=0.0)
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kernel", default="ggml")
    ap.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    ap.add_argument("--out", help="directory for the raw stacks (default: a temporary one)")
    ap.add_argument("--report", metavar="DIR", help="only print the report of the raw stacks in DIR (no run)")
    args = ap.parse_args()
    if args.report:
        for f in sorted(Path(args.report).glob("*.txt")):
            print(report(f.stem, parse(f)))
        return
    work = Path(tempfile.mkdtemp(prefix="profile-wire-"))
    out = Path(args.out) if args.out else work
    out.mkdir(parents=True, exist_ok=True)
    model = work / "tiny-q8.gguf"
    make_model(model, preset="tiny", qtype="q8_0", seed=2, layers=4)
    with WanSwarm(model, ranges=RANGES, rtt_ms=args.rtt, workdir=work / "swarm", kernel=args.kernel,
                  timeout_s=30) as sw:
        sw.wait_covered()
        measure(sw, 2, 2)
        measure(sw, args.n, args.tokens)  # warm-up at this concurrency
        targets = {"backbone": sw.backbone.pid, "worker0": sw.workers[0].pid}
        spies = {k: subprocess.Popen(["py-spy", "record", "--pid", str(pid), "--rate", str(args.rate), "--format", "raw",
                                      "--nonblocking", "--gil", "-o", str(out / f"{k}.txt")],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                 for k, pid in targets.items()}
        time.sleep(1.5)  # py-spy attaches
        h0 = httpx.get(sw.base_url + "/health", timeout=60).json()
        cpu0 = {k: cpu_seconds(p) for k, p in targets.items()}
        toks = 0
        t0 = time.perf_counter()
        for _ in range(args.rounds):
            toks += measure(sw, args.n, args.tokens)["tokens"]
        wall = time.perf_counter() - t0
        cpu1 = {k: cpu_seconds(p) for k, p in targets.items()}
        h1 = httpx.get(sw.base_url + "/health", timeout=60).json()
        for p in spies.values():
            p.send_signal(2)  # SIGINT: py-spy writes its output
        for k, p in spies.items():
            _, err = p.communicate(timeout=60)
            if p.returncode not in (0, None) and not (out / f"{k}.txt").exists():
                raise SystemExit(f"py-spy failed on {k}: {err.decode()[-500:]}")
    reqs = h1["expert_requests"] - h0["expert_requests"]
    print(f"rtt {args.rtt:g} ms, N={args.n}: {toks} tokens in {wall:.2f} s ({toks / wall:.1f} tok/s), "
          f"{reqs} expert requests ({reqs / max(1, toks):.2f} per token)")
    for k in targets:
        cpu = cpu1[k] - cpu0[k]
        served = reqs if k == "backbone" else reqs / len(RANGES)  # ~ a quarter of them reach one worker
        per = f"{1000 * cpu / served:.2f} ms per expert request, " if reqs else ""
        print(f"{k}: {cpu:.2f} s CPU ({per}{1000 * cpu / toks:.2f} ms per token)")
    for k in targets:
        print(report(k, parse(out / f"{k}.txt")))
    print(f"raw stacks: {out}")


if __name__ == "__main__":
    main()
