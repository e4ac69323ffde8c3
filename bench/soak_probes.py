"""bench/soak.py's probes from outside the swarm: the monolithic references (the same requests on a
backbone computing alone), an expert echo to a worker at its announced address, garbage frames on an
expert stream, a process's resident memory and descriptors, and the periodic sample of the
backbones and the long-lived workers. Split from soak.py to keep each
module readable; used only by it."""
from __future__ import annotations

import os
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers.procs import Proc  # the tests' process helper
from soak_check import LONG_LIVED, MAX_TOKENS, PROMPTS, SAMPLINGS, _now, _request


def _http(proc: Proc) -> str:
    return next(w for w in proc.ready if w.startswith("http="))[5:].replace("0.0.0.0", "127.0.0.1")


def monolithic_references(model: Path, workdir: Path, env: dict, prompts: int = len(PROMPTS)) -> dict:
    """Every (prompt, sampling, max_tokens) the load may send, answered by a backbone computing
    alone (no swarm): the reference the checker compares against."""
    import openai

    mono = Proc(["node", "--role", "backbone", "--model", str(model), "--http", "127.0.0.1:0",
                 "--identity", str(workdir / "mono.key"), "--served-model-name", "tiny"], workdir / "mono.log", env)
    try:
        base = next(w for w in mono.ready if w.startswith("http="))[5:].replace("0.0.0.0", "127.0.0.1")
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
        refs = {}
        for p in range(prompts):
            for s in SAMPLINGS:
                for m in MAX_TOKENS:
                    r = client.chat.completions.create(model="tiny", **_request(p, s, m))
                    refs[(p, s, m)] = (r.choices[0].message.content, r.usage.completion_tokens,
                                       r.choices[0].finish_reason)
        return refs
    finally:
        mono.stop()


def _echo(addr: str, timeout_s: float = 10) -> bool:
    """Whether the worker at ``addr`` answers an expert ``echo`` (a libp2p peer of our own)."""
    import trio

    from p2pswarm.net.wire import expert_protocol as proto
    from p2pswarm.net.wire.framing import FrameReader, send_frame
    from p2pswarm.net.libp2p.host import open_host
    from p2pswarm.net.signed.identity import Identity

    async def main() -> bool:
        with trio.move_on_after(timeout_s):
            async with open_host(Identity.generate()) as net:
                s = await net.open_stream(addr, proto.PROTOCOL_EXPERT)
                await send_frame(s, proto.pack({"op": "echo", "id": 1, "payload": b"soak"}))
                frame = await FrameReader(s).read_frame()
                return frame is not None and proto.unpack(frame).get("payload") == b"soak"
        return False

    try:
        return trio.run(main)
    except Exception:
        return False


def _garbage_frames(addr: str, rng: random.Random) -> str:
    """Open expert streams to ``addr`` and send a malformed message, an oversized length and random
    bytes; returns what came back (each should be an error frame or a close, never a hang)."""
    import trio

    from p2pswarm.net.wire import expert_protocol as proto
    from p2pswarm.net.wire.framing import HEADER, FrameReader
    from p2pswarm.net.libp2p.host import open_host
    from p2pswarm.net.signed.identity import Identity

    answers = []

    async def main() -> None:
        async with open_host(Identity.generate()) as net:
            for payload in (HEADER.pack(12) + rng.randbytes(12), HEADER.pack(1 << 40), rng.randbytes(300)):
                with trio.move_on_after(10) as waited:
                    s = await net.open_stream(addr, proto.PROTOCOL_EXPERT)
                    await s.send_all(payload)
                    try:
                        frame = await FrameReader(s).read_frame()
                        answers.append("closed" if frame is None else proto.unpack(frame).get("op", "?"))
                    except Exception as exc:
                        answers.append(type(exc).__name__)
                    await s.aclose()
                if waited.cancelled_caught:
                    answers.append("HUNG")

    trio.run(main)
    return ",".join(answers)


def _proc_sample(pid: int) -> dict:
    with open(f"/proc/{pid}/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return {"rss_mb": rss / 1024, "fds": len(os.listdir(f"/proc/{pid}/fd"))}


def sample(swarm) -> dict:
    """One sample of the backbone and the long-lived workers: RSS, descriptors, and (from their
    /health) trio tasks and DHT records held."""
    import httpx

    out = {"t": _now(), "load1": os.getloadavg()[0]}
    for name, base in zip(("backbone", "backbone2"), swarm.bases):
        h = httpx.get(base + "/health", timeout=30).json()
        out[name] = {**_proc_sample(swarm.nodes[name].pid), "tasks": h.get("trio_tasks"),
                     "records": h.get("dht_records")}
    for name in LONG_LIVED:
        node = swarm.nodes[name]
        s = _proc_sample(node.pid)
        if node.proc.health:
            wh = httpx.get(node.proc.health, timeout=10).json()
            s.update(tasks=wh.get("trio_tasks"), records=wh.get("dht_records"))
        out[name] = s
    return out
