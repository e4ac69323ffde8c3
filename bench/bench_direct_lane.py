"""CPU per frame through a direct lane: ``send_frame`` into a ``SealedStream`` and ``FrameReader``
out of one, over a loopback socket pair, both ends in this thread (so the figure is the sender's
and the receiver's work together: sealing, the socket calls, opening, the copies).

Why: a 0.3-core backbone with 4 workers reads every expert reply through this path (0.2-0.8 MB
each at the 122B geometry's N=16 / N=64 decode); each copy of a reply is fresh pages to fault in
(docs/benchmarks.md, issue 46). ``malloc_trim(0)`` before each frame gives malloc's free memory
back, as a busy backbone's allocations do between replies. A/B: run it once per tree with
``PYTHONPATH=TREE`` from a directory outside both.

    python bench/bench_direct_lane.py [--bytes 786000] [--frames 60] [--rounds 3]
                                      [--aead chacha20-poly1305|aes-256-gcm]

``--aead`` picks the lane's AEAD (default: what this machine's direct lanes negotiate first, or
ChaCha20-Poly1305 on a tree without the choice); the output line names it.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import time

import trio

from p2pswarm.net.wire import direct
from p2pswarm.net.wire.direct import SealedStream
from p2pswarm.net.wire.framing import FrameReader, send_frame

MAX = 128 << 20


async def run(size: int, frames: int, rounds: int, aead: str | None) -> list[float]:
    libc = ctypes.CDLL("libc.so.6")
    a, b = trio.socket.socketpair()
    key = os.urandom(32)
    kw = {} if aead is None else {"aead": aead}
    tx = SealedStream(trio.SocketStream(a), key, initiator=True, max_record=MAX, **kw)
    reader = FrameReader(SealedStream(trio.SocketStream(b), key, initiator=False, max_record=MAX, **kw), MAX)
    payload = os.urandom(size)
    out = []
    for _ in range(rounds):
        cpu = 0.0
        for _ in range(frames):
            libc.malloc_trim(0)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(send_frame, tx, payload, MAX)
                t = time.process_time()
                got = await reader.read_frame()
                cpu += time.process_time() - t
            assert got == payload
        out.append(1e3 * cpu / frames)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bytes", type=int, default=786_000, help="payload bytes a frame (default 786000: a 64-pair reply)")
    ap.add_argument("--frames", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--aead", choices=["chacha20-poly1305", "aes-256-gcm"], default=None,
                    help="the sealing (default: the first this machine negotiates)")
    args = ap.parse_args()
    local = getattr(direct, "local_aeads", None)  # (a tree from before the choice: ChaCha20-Poly1305 only)
    if args.aead is None and local is not None:
        args.aead = local()[0]
    if local is None and args.aead not in (None, "chacha20-poly1305"):
        ap.error("this tree's direct lane seals with chacha20-poly1305 only")
    ms = trio.run(run, args.bytes, args.frames, args.rounds, args.aead)
    print(f"{args.aead or 'chacha20-poly1305'}, {args.bytes} B a frame: CPU {min(ms):.3f} ms a frame, send and receive (rounds: {', '.join(f'{m:.3f}' for m in ms)})")


if __name__ == "__main__":
    main()
