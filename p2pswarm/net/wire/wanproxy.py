"""A user-space TCP proxy that behaves like a WAN link: one-way delay per direction, optional jitter
and bandwidth cap. For tests and benchmarks (``tc netem`` does not exist on these kernels).

    async with open_wan_proxy(("127.0.0.1", worker_port), delay_s=0.025) as proxy:
        ...  # the worker runs with --announce /ip4/127.0.0.1/tcp/{proxy.port}

    python -m p2pswarm.net.wire.wanproxy --target 127.0.0.1:4001 --rtt-ms 50 [--jitter-ms 2] [--mbps 100]
    python -m p2pswarm.net.wire.wanproxy --target 127.0.0.1:4001 --target 127.0.0.1:4002 --rtt-ms 50
        [--up-mbps 100 --down-mbps 20] [--shared-up-mbps 100 --shared-down-mbps 100]

With several ``--target`` s one process emulates one link per target, each on a listening port of
its own (``READY HOST:PORT1 HOST:PORT2 ...``, in the order of the targets). Why offer that: the
emulated network should cost the machine running a whole swarm as little as possible (a real WAN
costs the nodes no CPU at all); one process per link means one more process to wake per link and
chunk, on the same cores as the nodes being measured.

Each accepted connection is paired with a fresh connection to the target; every chunk read from one
side is delivered to the other at ``arrival + delay (+ uniform jitter)``, never before the chunk
ahead of it (a TCP stream is in order, so jitter only ever adds), and, with a bandwidth cap, no
sooner than the link could have carried it. A 50 ms-RTT link is ``delay_s=0.025`` each way.

Caps (Mbit/s): ``--mbps`` caps each link both ways; ``--up-mbps`` / ``--down-mbps`` each direction of
each link ("up": from the connecting side to the target, e.g. backbone -> worker; "down": back,
e.g. a worker's upload); ``--shared-up-mbps`` / ``--shared-down-mbps`` cap all the links of this
process *together*, per direction, as one network card: the links are the workers', the connecting
side is one backbone, so that is the backbone's own line. A chunk leaves when both its
link and the shared card have carried what was queued before it.
"""
from __future__ import annotations

import argparse
import logging
import math
import random
import sys
import time
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field

import trio

from p2pswarm.errors import first_error

log = logging.getLogger("p2pswarm.wanproxy")

#: the most one read of a link takes: a whole expert request of a 64-sequence step of the bench's
#: model in one chunk (65.6 kB), not two, each its own delivery and wake-up of the node behind. Not
#: more: a read asking for 256 KiB or more allocates it afresh each time (~20 us a call here, 3 us
#: for 128 KiB). With a bandwidth cap, CAPPED_CHUNK (the pacing's grain).
CHUNK = 128 * 1024
CAPPED_CHUNK = 64 * 1024
#: how much of a delay the event loop's timer may leave to a blocking sleep (see sleep_until_precise)
TIMER_GRAIN_S = 0.001


async def sleep_until_precise(due: float) -> None:
    """Sleep until ``due`` (trio's clock), late by tens of microseconds rather than a millisecond.

    trio's timers end in ``epoll_wait``, whose timeout is whole milliseconds, rounded up by
    Python: a plain ``trio.sleep_until`` wakes 0-1 ms late, plus the wake-up itself. Measured on
    an idle machine, a 25 ms-RTT link through this proxy gave a 27.1 ms round trip, 8% slower
    than the link it claims to be, and the benchmarks' bound N / (L * RTT) counts the nominal
    25 ms. So the loop's timer is asked for a wake-up up to one grain early, and the rest is a
    blocking ``time.sleep`` (nanosecond timer, no CPU spent): the loop is held for under a
    millisecond, and only when a chunk is due.
    """
    await trio.sleep_until(due - TIMER_GRAIN_S)
    rest = due - trio.current_time()
    if rest > 0:
        time.sleep(rest)


@dataclass
class LinkSpec:
    """One direction of the emulated link."""

    delay_s: float = 0.0
    jitter_s: float = 0.0
    bytes_per_s: float | None = None  # None: unlimited

    def __post_init__(self):
        if self.delay_s < 0 or self.jitter_s < 0 or (self.bytes_per_s is not None and self.bytes_per_s <= 0):
            raise ValueError("delay and jitter must be >= 0 and a bandwidth cap > 0")


class SharedCap:
    """One direction of a link several emulated links share (a NIC): when it is next free."""

    def __init__(self, bytes_per_s: float):
        if not bytes_per_s > 0:
            raise ValueError("a bandwidth cap must be > 0")
        self.bytes_per_s = bytes_per_s
        self.free_at = 0.0


@dataclass
class ProxyStats:
    connections: int = 0
    bytes_up: int = 0  # client -> target
    bytes_down: int = 0
    chunks: int = 0


@dataclass
class WanProxy:
    target: tuple[str, int]
    up: LinkSpec = field(default_factory=LinkSpec)
    down: LinkSpec = field(default_factory=LinkSpec)
    seed: int | None = None
    host: str = "127.0.0.1"
    port: int = 0
    stats: ProxyStats = field(default_factory=ProxyStats)
    #: caps shared with other links, per direction (the backbone's line): SharedCap or None
    shared_up: SharedCap | None = None
    shared_down: SharedCap | None = None

    def __post_init__(self):
        self._rng = random.Random(self.seed)

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(self.port, host=self.host)
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started(self.port)
        await trio.serve_listeners(self._handle, listeners)

    async def _handle(self, client: trio.SocketStream) -> None:
        try:
            target = await trio.open_tcp_stream(*self.target)
        except OSError as exc:
            log.info("proxy to %s:%d: target unreachable (%s)", *self.target, exc)
            await client.aclose()
            return
        self.stats.connections += 1
        async with client, target:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._pipe, client, target, self.up, "bytes_up", nursery.cancel_scope,
                                   self.shared_up)
                nursery.start_soon(self._pipe, target, client, self.down, "bytes_down", nursery.cancel_scope,
                                   self.shared_down)

    def _count(self, counter: str, data: bytes) -> None:
        setattr(self.stats, counter, getattr(self.stats, counter) + len(data))
        self.stats.chunks += 1

    async def _pipe(self, src, dst, spec: LinkSpec, counter: str, scope: trio.CancelScope,
                    shared: SharedCap | None = None) -> None:
        """Read from src as fast as it sends; deliver each chunk to dst at its due time, in order.

        src's end of stream is passed on as a half-close once everything before it is delivered
        (what a TCP link does: the other direction may still be carrying data); a broken side
        ends the whole connection."""
        if not (spec.delay_s or spec.jitter_s or spec.bytes_per_s or shared):
            await self._wire(src, dst, counter, scope)
            return
        capped = bool(spec.bytes_per_s or shared)
        send, receive = trio.open_memory_channel(math.inf)

        async def deliver() -> None:
            free_at = 0.0  # when the link finishes carrying the previous chunk (bandwidth cap)
            last_due = 0.0
            async for due, data in receive:
                if data is None:  # src ended: the end of stream crosses the link after the data
                    await sleep_until_precise(max(due, last_due))
                    await _half_close(dst, scope)
                    return
                if capped:  # carried by this link and the shared card, each in its queue's order
                    start = max(due, free_at, shared.free_at if shared else 0.0)
                    done = start
                    if spec.bytes_per_s:
                        free_at = done = start + len(data) / spec.bytes_per_s
                    if shared:
                        shared.free_at = start + len(data) / shared.bytes_per_s
                        done = max(done, shared.free_at)
                    due = done
                due = max(due, last_due)
                last_due = due
                await sleep_until_precise(due)
                try:
                    await dst.send_all(data)
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    break
            scope.cancel()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(deliver)
            try:
                while True:
                    data = await src.receive_some(CAPPED_CHUNK if capped else CHUNK)
                    if not data:
                        send.send_nowait((trio.current_time() + spec.delay_s, None))
                        break
                    jitter = self._rng.uniform(0, spec.jitter_s) if spec.jitter_s else 0.0
                    self._count(counter, data)
                    send.send_nowait((trio.current_time() + spec.delay_s + jitter, data))
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass  # broken: deliver drains what is in flight, then ends the connection
            send.close()

    async def _wire(self, src, dst, counter: str, scope: trio.CancelScope) -> None:
        """A link with no delay, jitter or cap: each chunk is written as soon as it is read, by the
        reading task itself. The proxy then costs a 0 ms RTT run its two syscalls per chunk and not
        also a channel hand-off and a second task's wake-up; on a 2-core machine running a whole
        swarm that CPU was taken from the nodes being measured."""
        try:
            while True:
                data = await src.receive_some(CHUNK)
                if not data:
                    await _half_close(dst, scope)
                    return
                self._count(counter, data)
                await dst.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            scope.cancel()


async def _half_close(dst, scope: trio.CancelScope) -> None:
    """Pass an end of stream on; a side that cannot take it ends the connection."""
    try:
        await dst.send_eof()
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        scope.cancel()


@asynccontextmanager
async def open_wan_proxy(target: tuple[str, int], *, delay_s: float = 0.0, jitter_s: float = 0.0,
                         bytes_per_s: float | None = None, host: str = "127.0.0.1", port: int = 0,
                         seed: int | None = None, up_bytes_per_s: float | None = None,
                         down_bytes_per_s: float | None = None, shared_up: SharedCap | None = None,
                         shared_down: SharedCap | None = None):
    """A running :class:`WanProxy` for the duration of the block: ``bytes_per_s`` caps both
    directions, ``up_``/``down_bytes_per_s`` one (the tighter wins); ``shared_up``/``shared_down``
    are caps it shares with other proxies (one :class:`SharedCap` passed to each)."""
    def cap(a, b):
        caps = [c for c in (a, b) if c]
        return min(caps) if caps else None

    proxy = WanProxy((target[0], target[1]), up=LinkSpec(delay_s, jitter_s, cap(bytes_per_s, up_bytes_per_s)),
                     down=LinkSpec(delay_s, jitter_s, cap(bytes_per_s, down_bytes_per_s)), seed=seed,
                     host=host, port=port, shared_up=shared_up, shared_down=shared_down)
    async with trio.open_nursery() as nursery:
        await nursery.start(proxy.serve)
        yield proxy
        nursery.cancel_scope.cancel()


def _hostport(s: str) -> tuple[str, int]:
    host, _, port = s.rpartition(":")
    if not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {s!r}")
    return host, int(port)


def _nonneg(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None
    if not v >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {s!r}")
    return v


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m p2pswarm.net.wire.wanproxy",
                                 description="TCP proxy emulating a WAN link (delay, jitter, bandwidth cap). "
                                             "Prints READY HOST:PORT once listening.")
    ap.add_argument("--target", type=_hostport, action="append", required=True,
                    help="HOST:PORT to forward to (repeatable: one link per target, each on its own port)")
    ap.add_argument("--listen", type=_hostport, action="append", default=None,
                    help="HOST:PORT (default 127.0.0.1:0); with several targets, once with port 0 for "
                         "all of them or once per target, in order")
    ap.add_argument("--rtt-ms", type=_nonneg, default=0.0, help="round-trip delay added, split evenly each way")
    ap.add_argument("--jitter-ms", type=_nonneg, default=0.0, help="extra one-way delay, uniform in [0, J]")
    ap.add_argument("--mbps", type=_nonneg, default=0.0, help="bandwidth cap per direction in Mbit/s (0: none)")
    ap.add_argument("--up-mbps", type=_nonneg, default=0.0,
                    help="cap of each link's up direction (connecting side -> target, e.g. backbone -> worker)")
    ap.add_argument("--down-mbps", type=_nonneg, default=0.0,
                    help="cap of each link's down direction (target -> connecting side, e.g. a worker's upload)")
    ap.add_argument("--shared-up-mbps", type=_nonneg, default=0.0,
                    help="one cap for the up direction of all the links together (the backbone's uplink)")
    ap.add_argument("--shared-down-mbps", type=_nonneg, default=0.0,
                    help="one cap for the down direction of all the links together (the backbone's downlink)")
    args = ap.parse_args(argv)
    listens = args.listen or [("127.0.0.1", 0)]
    if len(listens) == 1 and len(args.target) > 1:
        if listens[0][1] != 0:
            ap.error("one --listen with a fixed port for several --target s: give one --listen per target")
        listens = listens * len(args.target)
    if len(listens) != len(args.target):
        ap.error(f"{len(listens)} --listen for {len(args.target)} --target: give one per target (or one with port 0)")
    def bps(mbps: float) -> float | None:
        return mbps * 1e6 / 8 if mbps else None

    shared_up = SharedCap(args.shared_up_mbps * 1e6 / 8) if args.shared_up_mbps else None
    shared_down = SharedCap(args.shared_down_mbps * 1e6 / 8) if args.shared_down_mbps else None

    async def run() -> None:
        async with AsyncExitStack() as stack:
            proxies = [await stack.enter_async_context(open_wan_proxy(
                target, delay_s=args.rtt_ms / 2000, jitter_s=args.jitter_ms / 1000, bytes_per_s=bps(args.mbps),
                up_bytes_per_s=bps(args.up_mbps), down_bytes_per_s=bps(args.down_mbps), shared_up=shared_up,
                shared_down=shared_down, host=host, port=port)) for target, (host, port) in zip(args.target, listens)]
            print("READY " + " ".join(f"{p.host}:{p.port}" for p in proxies), flush=True)
            await trio.sleep_forever()

    try:
        trio.run(run)
    except KeyboardInterrupt:
        return 0
    except (OSError, BaseExceptionGroup) as exc:  # a taken port surfaces through the proxies' nurseries
        err = first_error(exc) if isinstance(exc, BaseExceptionGroup) else exc
        if not isinstance(err, OSError):
            raise
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
