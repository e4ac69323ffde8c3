"""A seeded frame mutator and a driver that throws its cases at a live node's protocol handler.

Why seeded and home-made rather than hypothesis: the cases must be *protocol-shaped* to reach deep
code (a compute request past the handshake, a chunk request past the token check), reproducible
from one integer, and cheap enough that 100,000 of them fit a benchmark run; hypothesis's
shrinking buys nothing against a remote process. Each case is the raw bytes one stream carries:
zero or more valid frames (e.g. a hello), then one mutated frame or raw garbage. The driver sends a
case on a fresh stream, half-closes, and reads until the node closes the stream; a stream the node
leaves open past the timeout counts as ``hung``.

Used by tests/test_fuzz_protocols.py (a few thousand cases) and bench/fuzz_protocols.py (100,000).
"""
from __future__ import annotations

import random
import struct
from collections import Counter
from dataclasses import dataclass, field

import msgpack
import numpy as np
import trio

from p2pswarm.net.wire import expert_protocol as proto

HEADER = struct.Struct("!Q")


def frame(payload: bytes) -> bytes:
    return HEADER.pack(len(payload)) + payload


class Mutator:
    """Deterministic mutations of msgpack messages and of their framing (one ``random.Random``)."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)

    def value(self, depth: int = 0):
        r = self.rng
        kind = r.randrange(12 if depth < 3 else 8)
        if kind == 0:
            return None
        if kind == 1:
            return r.choice([True, False])
        if kind == 2:
            return r.choice([0, 1, -1, 2**31 - 1, 2**31, -(2**31), 2**63 - 1, -(2**63), 2**64 - 1, r.randrange(-999, 999)])
        if kind == 3:
            return r.choice([0.0, -0.0, float("nan"), float("inf"), 1e308, r.random()])
        if kind == 4:
            return r.choice(["", "hello", "compute", "chunk", "x" * r.randrange(1, 300), "\u00e9\u2603", "<f4", "<i4", "|u1"])
        if kind == 5:
            return r.randbytes(r.choice([0, 1, 3, 4, 12, 256, 4096]))
        if kind == 6:
            return [r.randrange(-2, 10**6) for _ in range(r.randrange(0, 5))]
        if kind == 7:
            return r.choice([[], {}, [[]], {"": None}])
        if kind in (8, 9):
            return [self.value(depth + 1) for _ in range(r.randrange(0, 4))]
        return {str(self.value(depth + 1))[:20]: self.value(depth + 1) for _ in range(r.randrange(0, 4))}

    def message(self, msg: dict) -> dict:
        """Replace, delete or add fields (recursing into nested maps such as wire arrays)."""
        out = dict(msg)
        for _ in range(self.rng.randrange(1, 4)):
            keys = list(out)
            action = self.rng.randrange(5)
            if action == 0 or not keys:
                out[str(self.value())[:16]] = self.value()
            elif action == 1:
                del out[self.rng.choice(keys)]
            elif action == 2:
                k = self.rng.choice(keys)
                out[k] = self.message(out[k]) if isinstance(out[k], dict) else self.value()
            else:
                out[self.rng.choice(keys)] = self.value()
        return out

    def raw(self, data: bytes) -> bytes:
        """Byte-level damage: flips, cuts, inserts, duplications."""
        b = bytearray(data)
        for _ in range(self.rng.randrange(1, 6)):
            op = self.rng.randrange(4)
            if op == 0 and b:
                b[self.rng.randrange(len(b))] ^= 1 << self.rng.randrange(8)
            elif op == 1 and b:
                i = self.rng.randrange(len(b))
                del b[i : i + self.rng.randrange(1, 16)]
            elif op == 2:
                i = self.rng.randrange(len(b) + 1)
                b[i:i] = self.rng.randbytes(self.rng.randrange(1, 16))
            elif b:
                i = self.rng.randrange(len(b))
                b[i:i] = b[i : i + self.rng.randrange(1, 64)]
        return bytes(b)

    def framed(self, payload: bytes, max_frame: int) -> bytes:
        """Usually an honest frame; sometimes a length that lies (short, long, over the maximum, 2**64-1)."""
        r = self.rng.randrange(10)
        if r < 6:
            return frame(payload)
        n = len(payload)
        lie = [n + 1, max(0, n - 1), n + 10_000, max_frame + 1, 2**63, 2**64 - 1][r - 6 if r < 9 else self.rng.randrange(6)]
        return HEADER.pack(lie) + payload

    def case(self, prefix: list[bytes], seeds: list[dict], max_frame: int) -> bytes:
        """One stream's bytes: maybe the valid prefix frames, then one bad frame (or raw garbage)."""
        head = b"".join(frame(p) for p in prefix) if prefix and self.rng.random() < 0.7 else b""
        style = self.rng.randrange(10)
        if style == 0:
            return head + self.rng.randbytes(self.rng.randrange(0, 600))
        seed = self.rng.choice(seeds)
        if style < 6:
            payload = msgpack.packb(self.message(seed), use_bin_type=True)
        elif style < 9:
            payload = self.raw(msgpack.packb(seed, use_bin_type=True))
        else:
            payload = msgpack.packb(self.value(), use_bin_type=True)
        return head + self.framed(payload, max_frame)


# -- the protocols' valid messages, to mutate -----------------------------------------------------
def expert_seeds(model: str, kernel: str, shard: str, n_embd: int, layer: int, experts: list[int]) -> tuple[list[bytes], list[dict]]:
    """(valid prefix: a hello, seeds: hello / echo / compute messages) of /p2pswarm/expert/1.0.0."""
    hello = {"op": "hello", "protocol": proto.PROTOCOL_VERSION, "model": model, "kernel": kernel, "shard": shard}
    rows = np.random.default_rng(0).standard_normal((3, n_embd), dtype=np.float32)
    compute = msgpack.unpackb(proto.ComputeRequest(7, layer, rows, [(e, np.array([0, 2], np.int32)) for e in experts])
                              .to_wire(), raw=False)
    return [proto.pack(hello)], [hello, {"op": "echo", "id": 1, "payload": b"ping"}, compute]


def shard_seeds(model: str, token: str) -> tuple[list[bytes], list[dict]]:
    hello = {"op": "hello", "v": 1, "model": model, "layers": [0, 4], "experts": [0, 16], "token": token}
    chunk = {"op": "chunk", "tensor": "blk.0.ffn_up_exps.weight", "expert": 3, "offset": 0, "length": 1024}
    return [msgpack.packb(hello)], [hello, {"op": "manifest"}, {"op": "header"}, chunk]


def token_seeds(token: str) -> tuple[list[bytes], list[dict]]:
    return [], [{"token": token, "scope": "relay"}]


# -- the driver --------------------------------------------------------------------------------------
@dataclass
class FuzzStats:
    cases: int = 0
    outcomes: Counter = field(default_factory=Counter)  # closed / reset / hung / open_failed
    reply_bytes: int = 0

    def line(self) -> str:
        return f"{self.cases} cases: " + ", ".join(f"{k} {v}" for k, v in sorted(self.outcomes.items()))


async def send_case(net, addr: str, protocol: str, data: bytes, timeout_s: float) -> tuple[str, int]:
    """Send one case on a fresh stream; how the node ended it, and how many bytes it answered."""
    try:
        stream = await net.open_stream(addr, protocol, timeout_s=timeout_s)
    except Exception:
        return "open_failed", 0
    got = 0
    try:
        with trio.move_on_after(timeout_s) as scope:
            try:
                if data:
                    await stream.send_all(data)
                await stream.send_eof()
                while chunk := await stream.receive_some(1 << 16):
                    got += len(chunk)
                return "closed", got
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return "reset", got
        if scope.cancelled_caught:
            return "hung", got
        return "closed", got
    finally:
        await trio.aclose_forcefully(stream)


async def fuzz(net, addr: str, protocol: str, cases, *, concurrency: int = 8, timeout_s: float = 15.0,
               every=None, every_n: int = 1000) -> FuzzStats:
    """Throw every case of ``cases`` (an iterable of bytes) at ``protocol`` on ``addr``,
    ``concurrency`` streams at a time; ``await every(stats)`` after each ``every_n`` cases (a
    liveness probe, a memory reading)."""
    stats = FuzzStats()
    it = iter(cases)
    lock = trio.Lock()

    async def runner() -> None:
        while True:
            async with lock:
                data = next(it, None)
                if data is None:
                    return
            outcome, n = await send_case(net, addr, protocol, data, timeout_s)
            stats.cases += 1
            stats.outcomes[outcome] += 1
            stats.reply_bytes += n
            if every is not None and stats.cases % every_n == 0:
                await every(stats)

    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(runner)
    return stats


def rss_kb(pid: int) -> int:
    """Resident set size of a process, from /proc."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


# -- the whole storm: three node processes, three protocols ----------------------------------------
@dataclass
class StormReport:
    stats: dict  # protocol -> FuzzStats
    rss_kb: dict  # process log name -> (at start, peak)
    logs: dict  # process log name -> log text (after the processes stopped)
    alive: dict  # process log name -> still running at the end of the storm
    seconds: float = 0.0


async def _call(stream, reader, msg: dict) -> dict:
    from p2pswarm.net.wire.framing import send_frame

    await send_frame(stream, msgpack.packb(msg, use_bin_type=True))
    return msgpack.unpackb(await reader.read_frame(), raw=False)


async def run_storm(model_path, workdir, env: dict, cases: int, *, concurrency: int = 8,
                    probe_every: int = 250) -> StormReport:
    """A worker, a shard source and a relay as processes; ``cases`` fuzz cases on each one's protocol,
    with a good stream (or, for the one-shot token protocol, a fresh valid token) probed every
    ``probe_every`` cases and each process's RSS read then."""
    import time
    from pathlib import Path

    from p2pswarm.model.layout import ModelLayout
    from p2pswarm.model.manifest import build_manifest, write_manifest
    from p2pswarm.model.slicer import slice_experts
    from p2pswarm.net.wire.framing import FrameReader
    from p2pswarm.net.wire.expert_protocol import PROTOCOL_EXPERT
    from p2pswarm.net.libp2p.host import open_host
    from p2pswarm.net.signed.identity import load_or_create_identity
    from p2pswarm.net.shards.wire import PROTOCOL_SHARD
    from p2pswarm.net.signed.tokens import issue_token
    from p2pswarm.net.libp2p.relay_token import PROTOCOL_TOKEN

    from helpers.procs import Proc, start_relay

    workdir = Path(workdir)
    issuer = load_or_create_identity(workdir / "issuer.key")
    client = load_or_create_identity(workdir / "client.key")
    man = build_manifest(model_path, issuer)
    write_manifest(man, workdir / "model.manifest")
    shard_token = issue_token(issuer, client.peer_id_str, [f"shard:{man.fingerprint}:0-3:0-15"], 3600).encode()
    relay_token = issue_token(issuer, client.peer_id_str, ["relay"], 3600).encode()
    shard = workdir / "shard.gguf"
    slice_experts(model_path, shard, None, (0, 8))
    n_embd = ModelLayout.open(model_path).hparam("embedding_length", required=True)

    def start():
        worker = Proc(["node", "--role", "worker", "--shard", str(shard), "--identity", str(workdir / "w.key")],
                      workdir / "worker.log", env)
        source = Proc(["serve-shards", "--model", str(model_path), "--manifest", str(workdir / "model.manifest"),
                       "--trust-issuer", issuer.peer_id_str, "--identity", str(workdir / "s.key")],
                      workdir / "source.log", env)
        return [worker, source, start_relay(workdir, env, issuer=issuer)]

    procs = await trio.to_thread.run_sync(start)
    worker, source, relay = procs
    rss = {p.log.name: [rss_kb(p.proc.pid)] * 2 for p in procs}

    def read_rss(p) -> None:
        rss[p.log.name][1] = max(rss[p.log.name][1], rss_kb(p.proc.pid))

    t0 = time.perf_counter()
    stats: dict[str, FuzzStats] = {}
    try:
        async with open_host(client) as net:
            # expert protocol: learn what the worker is, keep one good stream open throughout
            s = await net.open_stream(worker.addr, PROTOCOL_EXPERT, timeout_s=20)
            me = await _call(s, FrameReader(s), {"op": "hello", "protocol": 0})
            await s.aclose()
            good = await net.open_stream(worker.addr, PROTOCOL_EXPERT, timeout_s=20)
            good_reader = FrameReader(good)
            prefix, seeds = expert_seeds(me["model"], me["kernel"], me["shard"], n_embd, 1, [0, 5])
            if (await _call(good, good_reader, seeds[0]))["ok"] is not True:
                raise AssertionError("the worker refused a valid hello")
            want = await _call(good, good_reader, seeds[2])
            if want.get("op") != "result":
                raise AssertionError(f"the worker did not compute a valid request: {want}")

            async def probe_expert(st) -> None:
                if await _call(good, good_reader, seeds[2]) != want:
                    raise AssertionError(f"the good expert stream broke after {st.line()}")
                read_rss(worker)

            m = Mutator(1)
            stats["expert"] = await fuzz(net, worker.addr, PROTOCOL_EXPERT,
                                         (m.case(prefix, seeds, 128 << 20) for _ in range(cases)),
                                         concurrency=concurrency, every=probe_expert, every_n=probe_every)
            # shard protocol: a granted session stays good
            sgood = await net.open_stream(source.addr, PROTOCOL_SHARD, timeout_s=20)
            sreader = FrameReader(sgood)
            prefix, seeds = shard_seeds(man.fingerprint, shard_token)
            if (await _call(sgood, sreader, seeds[0]))["ok"] is not True:
                raise AssertionError("the shard source refused a valid hello")
            chunk = await _call(sgood, sreader, seeds[3])

            async def probe_shard(st) -> None:
                if await _call(sgood, sreader, seeds[3]) != chunk:
                    raise AssertionError(f"the good shard stream broke after {st.line()}")
                read_rss(source)

            m = Mutator(2)
            stats["shard"] = await fuzz(net, source.addr, PROTOCOL_SHARD,
                                        (m.case(prefix, seeds, 64 << 10) for _ in range(cases)),
                                        concurrency=concurrency, every=probe_shard, every_n=probe_every)
            # token protocol: one request per stream; a valid token is still accepted
            prefix, seeds = token_seeds(relay_token)

            async def probe_token(st) -> None:
                t = await net.open_stream(relay.addr, PROTOCOL_TOKEN, timeout_s=20)
                if (await _call(t, FrameReader(t), seeds[0])).get("ok") is not True:
                    raise AssertionError(f"the relay refused a valid token after {st.line()}")
                await t.aclose()
                read_rss(relay)

            m = Mutator(3)
            stats["token"] = await fuzz(net, relay.addr, PROTOCOL_TOKEN,
                                        (m.case(prefix, seeds, 16 << 10) for _ in range(cases)),
                                        concurrency=concurrency, every=probe_token, every_n=probe_every)
            for p in procs:
                read_rss(p)
        alive = {p.log.name: p.proc.poll() is None for p in procs}
        seconds = time.perf_counter() - t0
    finally:
        for p in procs:
            p.stop()
    return StormReport(stats, {k: tuple(v) for k, v in rss.items()}, {p.log.name: p.text() for p in procs}, alive,
                       seconds)
