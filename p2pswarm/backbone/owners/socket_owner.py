"""A worker process reached over a local TCP socket: framed msgpack, handshake, timeouts.

One persistent connection per worker, (re)opened lazily; requests on it are *pipelined*: each is
sent as soon as the previous one is on the wire (a send lock), and replies are read in send order
(the worker answers one connection in order), matched by id. So several micro-batches can each
have a request in flight to the same worker, and a 50 ms link carries them in one round trip. Every failure (refused handshake, dead process, closed connection,
timeout, error reply, malformed reply) becomes a :class:`WorkerError`, which the dispatcher turns
into a fallback to the local replica.

A hung worker (SIGSTOP, a frozen phone) is not a dead one: its connection stays open and nothing
answers. So besides the fixed ``timeout_s`` every request has a *deadline* learnt from the worker's
own recent round trips: :data:`DEADLINE_FACTOR` x their p99 (scaled up for a request with more
rows than any recent one) + :data:`DEADLINE_MARGIN_S`, at least :data:`DEADLINE_MIN_S`, at most
``timeout_s``; the fixed timeout alone applies until :data:`DEADLINE_SAMPLES` round trips are
known. A miss raises :class:`WorkerSlow`: the dispatcher recomputes on the local replica at once
and avoids the worker for a short back-off. A step's extra delay from one hung worker is thus at
most its deadline plus the local recomputation of its groups, once: later layers skip it.

Two things keep a worker that was only *late* from being treated as hung. Time this process's own
event loop spent stalled is credited back to the deadline (:mod:`p2pswarm.backbone.owners.loop_watch`):
we could not have read the reply then. And a missed request keeps its place on the connection: a
background task reads its reply when it comes (dropped: its outputs were recomputed), widens the
deadline by that round trip (up to :data:`LATE_REMEMBER` deadlines) and sets :attr:`recovered_at`,
which ends the dispatcher's back-off; only a reply that never comes within ``timeout_s`` drops the
connection.
"""
from __future__ import annotations

import bisect
import collections
import contextlib
import itertools
import logging
import time
from functools import partial

from typing import Any

import numpy as np
import trio

from p2pswarm.backbone.owners.local_owners import LAYER_INPUTS, pack_rows
from p2pswarm.contracts import Groups, Owner
from p2pswarm.backbone.owners.loop_watch import loop_watch
from p2pswarm.engine import kernels
from p2pswarm.errors import FrameError, WorkerError, WorkerSlow, clip
from p2pswarm.net.wire import expert_protocol as proto
from p2pswarm.net.wire import precision as wire_precision
from p2pswarm.net.wire.framing import DEFAULT_MAX_FRAME, FrameReader, send_frame
from p2pswarm.net.wire.counting import CountingStream, WireBytes
from p2pswarm.net.wire.link_rate import LinkRate
from p2pswarm.offload import Offload

log = logging.getLogger("p2pswarm.backbone")

DEADLINE_FACTOR = 3.0
DEADLINE_MARGIN_S = 0.25
DEADLINE_MIN_S = 0.5
DEADLINE_SAMPLES = 8  # answered requests before the learnt deadline replaces the fixed timeout
LATENCY_WINDOW = 64
LATE_REMEMBER = 4.0  # a late reply within this many deadlines counts as a round trip (widens the deadline)


def reply_input_forms(reply: dict) -> frozenset[str]:
    """The input forms a worker's hello reply says it takes rows in (older workers: none)."""
    forms = reply.get("input_forms")
    if isinstance(forms, list):
        return frozenset(f for f in forms if isinstance(f, str) and (f in proto.INPUT_FORMS or f in proto.PACKED_FORMS))
    return frozenset()


def reply_families(reply: dict) -> tuple[str, ...]:
    """The kernel families a worker's hello reply says it answers in (older workers: its kernel's)."""
    fams = reply.get("families")
    if isinstance(fams, list) and all(isinstance(f, str) for f in fams):
        return tuple(fams)
    return (kernels.family(reply["kernel"]),) if isinstance(reply.get("kernel"), str) else ()


async def close_now(stream: Any) -> None:
    """:func:`trio.aclose_forcefully` for the trio-style streams we wrap (CountingStream,
    StreamAdapter, a direct lane): duck-typed, not subclasses of trio.abc.AsyncResource."""
    await trio.aclose_forcefully(stream)


class SocketOwner(Owner):
    layers: tuple[int, int]  # (always known: the shard it was started or found with)
    experts: tuple[int, int]

    def __init__(self, name: str, host: str, port: int, *, model_fingerprint: str, kernel: str,
                 layers: tuple[int, int], experts: tuple[int, int], timeout_s: float = 30.0,
                 max_frame: int = DEFAULT_MAX_FRAME, family: str | None = None):
        """``family``: ask the worker to answer every request of this connection in that kernel
        family (one of its hello's ``families``, e.g. ``portable-1``), whatever our own ``kernel``;
        None: the worker's kernel must be of our family. ``compute(..., family=...)`` asks per request."""
        self.name = name
        self.host, self.port = host, port
        self.model_fingerprint = model_fingerprint
        self.kernel = kernel
        self.family = family
        self.families: tuple[str, ...] = ()  # what the worker's last hello said it answers in
        self.layers = layers
        self.experts = experts
        self.timeout_s = timeout_s
        self.max_frame = max_frame
        #: the connection: a duck-typed trio stream (CountingStream over TCP, libp2p or a direct lane)
        self._stream: Any = None
        self._reader: FrameReader | None = None
        self._lock = trio.Lock()  # held while connecting and sending
        self._ids = itertools.count(1)
        self._gen = 0  # connection generation: a drop fails every request queued on the old one
        self._sent = 0  # requests sent on this connection
        self._served = 0  # replies read on this connection
        self._turn = trio.Event()
        self._latency: collections.deque[tuple[float, int]] = collections.deque(maxlen=LATENCY_WINDOW)
        self._sorted_s: list[float] = []  # the window's round trips, sorted (deadline_s)
        self._sorted_rows: list[int] = []  # and its request sizes
        #: time.monotonic() of the last late reply read (after a missed deadline): the dispatcher
        #: ends the worker's back-off then, instead of waiting it out
        self.recovered_at: float | None = None
        self.late_rows = 0  # rows of late replies read and dropped (recomputed locally instead)
        #: bytes sent to / received from this worker, every connection (p2pswarm.net.wire.counting);
        #: the dispatcher sets its parent (the backbone's total)
        self.wire = WireBytes()
        #: the worker's hello: the forms it takes input rows in besides float32; and the bank that
        #: turns our rows into them (the backbone's replica, when it computes in the worker's
        #: kernel: the dispatcher sets it), None: rows go as float32
        self.input_forms: frozenset[str] = frozenset()
        self.input_quantiser = None
        #: the backbone's --wire-precision (the dispatcher sets it): outputs asked for in 16 bits,
        #: and rounded here if a worker sends float32 anyway (p2pswarm.net.wire.precision)
        self.wire_precision: str | None = None
        #: the lossless output coding both ends take (p2pswarm.net.wire.codec), None: plain; asked
        #: for per request only while the link is not measured fast (:meth:`reply_coding`)
        self.output_coding: str | None = None
        #: how fast the worker's replies arrive (p2pswarm.net.wire.link_rate), every connection
        self.link = LinkRate()
        self.coded_replies = 0  # replies that came coded (the rest: plain or 16-bit)
        #: decoding a coded reply: inline when measured short, else in a thread (p2pswarm.offload).
        #: It was always a thread: with 8 workers a backbone made 8 thread hops a layer for replies
        #: that decode in a fraction of the hop's cost, 10% of a 0.3-core backbone's GIL samples
        #: (bench/device_swarm.py --py-spy, docs/benchmarks.md "Devices in CPU cgroups"). Measured
        #: in this thread's CPU time: decoding runs wholly in the calling thread (Offload's clock)
        self._decode = Offload(clock=time.thread_time)

    def deadline_s(self, rows: int = 0) -> float:
        """How long a request of ``rows`` rows may take before we call the worker hung."""
        if len(self._latency) < DEADLINE_SAMPLES:
            return self.timeout_s
        times = self._sorted_s  # kept sorted as the window moves: sorting it per request was ~3% of a backbone's CPU
        p99 = times[min(len(times) - 1, int(0.99 * len(times)))]
        scale = max(1.0, rows / max(1, self._sorted_rows[-1]))
        return min(self.timeout_s, max(DEADLINE_MIN_S, DEADLINE_FACTOR * p99 * scale + DEADLINE_MARGIN_S))

    def predict_s(self, rows: int) -> float | None:
        """The round trip a request of ``rows`` (expert, row) pairs should take, from a straight
        line fitted to the recent window (None before :data:`DEADLINE_SAMPLES` answers): a fixed
        part (latency, per-request costs) plus a part per row, which is where a link's bandwidth
        shows: every pair is an output row on the wire and a share of an input row. On a saturated
        link both grow; a big request then costs more than a small one (the hot-expert path reads
        this: bytes as well as round trips)."""
        if len(self._latency) < DEADLINE_SAMPLES:
            return None
        t = np.fromiter((x[0] for x in self._latency), float, len(self._latency))
        n = np.fromiter((x[1] for x in self._latency), float, len(self._latency))
        spread = n.var()
        per_row = max(0.0, float(((n - n.mean()) * (t - t.mean())).mean() / spread)) if spread > 0 else 0.0
        fixed = max(0.0, float(t.mean() - per_row * n.mean()))
        return fixed + per_row * rows

    def _record(self, seconds: float, rows: int) -> None:
        """One answered round trip into the deadline's window."""
        if len(self._latency) == self._latency.maxlen:
            old_s, old_rows = self._latency[0]
            del self._sorted_s[bisect.bisect_left(self._sorted_s, old_s)]
            del self._sorted_rows[bisect.bisect_left(self._sorted_rows, old_rows)]
        self._latency.append((seconds, rows))
        bisect.insort(self._sorted_s, seconds)
        bisect.insort(self._sorted_rows, rows)

    def holds(self, layer: int, expert: int) -> bool:
        return self.layers[0] <= layer < self.layers[1] and self.experts[0] <= expert < self.experts[1]

    async def _connect(self) -> None:
        stream = CountingStream(await trio.open_tcp_stream(self.host, self.port), self.wire)
        reader = FrameReader(stream, self.max_frame, rate=self.link)
        await send_frame(stream, proto.pack(self.hello()), self.max_frame)
        payload = await reader.read_frame()
        if payload is None:
            raise WorkerError(f"{self.name} closed the connection during the handshake")
        reply = proto.unpack(payload)
        if reply.get("op") == "error" or not reply.get("ok"):
            await close_now(stream)
            raise WorkerError(f"{self.name} refused the handshake: {reply.get('error', 'no reason given')}")
        # The worker says what it holds; trust only the intersection with what we were told.
        if reply.get("model") != self.model_fingerprint:
            await close_now(stream)
            raise WorkerError(f"{self.name} serves another model ({clip(reply.get('model'), 80)}), not {self.model_fingerprint}")
        self.families = reply_families(reply)
        self.input_forms = reply_input_forms(reply)
        self.output_coding = proto.reply_output_coding(reply)
        self._stream, self._reader = stream, reader

    def hello(self) -> dict:
        msg = {"op": "hello", "protocol": proto.PROTOCOL_VERSION, "model": self.model_fingerprint,
               "kernel": self.kernel}
        if self.family is not None:
            msg["family"] = self.family
        return msg

    async def _drop(self) -> None:
        if self._stream is not None:
            await close_now(self._stream)
        self._stream, self._reader = None, None
        self._gen += 1
        self._sent = self._served = 0
        self._turn.set()  # wake the queued readers: they see the new generation and fail
        self._turn = trio.Event()

    async def request(self, msg_bytes: bytes, rid: int, rows: int = 0) -> dict:
        """Send one framed request (connecting first if needed) and wait for its reply, while other
        requests may be in flight on the same connection; ``rows`` sizes its deadline.

        The deadline is credited with this process's own loop stalls (:mod:`loop_watch`): a reply
        we could not read because we were stalled is not the worker's lateness. A request that
        misses its deadline keeps its place on the connection: :meth:`_finish_late` reads its
        reply when it comes, and then the worker is used again (:attr:`recovered_at`)."""
        sent = on_wire = done = handed_off = False
        gen = None
        deadline = self.deadline_s(rows)
        t0 = time.perf_counter()
        watch = loop_watch()
        try:
            with trio.fail_after(deadline):
                async with self._lock:
                    if self._stream is None:
                        await self._connect()
                        self._gen += 1
                        self._sent = self._served = 0
                    gen, reader = self._gen, self._reader
                    assert reader is not None  # (connected just now, or before)
                    ticket = self._sent
                    sent = True  # from here a failure leaves the connection out of step: drop it
                    await send_frame(self._stream, msg_bytes, self.max_frame)
                    self._sent += 1
                    on_wire = True
            got = False
            while not got:  # waiting for the reply is cancel-safe: it may be resumed (or handed off)
                left = min(t0 + deadline + watch.stalled_since(t0), t0 + self.timeout_s) - time.perf_counter()
                if left <= 0:
                    raise trio.TooSlowError
                with trio.move_on_after(left):
                    payload = await self._await_reply(gen, reader, ticket)
                    got = True
            if payload is None:
                raise WorkerError(f"{self.name} closed the connection")
            reply = proto.unpack(payload)
            if reply["op"] == "error" and reply.get("id") in (rid, None):  # None: about the connection
                raise WorkerError(f"{self.name} refused: {reply.get('error')}")
            if reply.get("id") != rid:
                raise WorkerError(f"{self.name} answered request {reply.get('id')} to our {rid}")
            done = True
            self._record(time.perf_counter() - t0, rows)
            return reply
        except trio.TooSlowError:
            if deadline < self.timeout_s:
                if on_wire and gen == self._gen and getattr(self._stream, "cancel_safe_reads", True):
                    handed_off = True
                    trio.lowlevel.spawn_system_task(self._finish_late, gen, reader, ticket, rid, t0, rows,
                                                    deadline, name=f"late reply of {self.name}")
                raise WorkerSlow(f"{self.name} did not answer within its deadline of {deadline:.2f} s "
                                 f"({DEADLINE_FACTOR:.0f}x its recent p99 round trip): hung or overloaded") from None
            raise WorkerError(f"{self.name} timed out after {self.timeout_s:.0f} s") from None
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise WorkerError(f"{self.name} unreachable: {exc or type(exc).__name__}") from None
        finally:
            if sent and not done and not handed_off and gen == self._gen:  # not yet dropped by another request
                await self._drop()

    async def _await_reply(self, gen: int, reader: FrameReader, ticket: int) -> bytes | None:
        """The payload of request ``ticket`` of connection ``gen``: replies come in send order, so
        wait for our turn, then read one frame. Cancel-safe: a partly read frame stays buffered."""
        while gen == self._gen and self._served != ticket:
            await self._turn.wait()
        if gen != self._gen:
            raise WorkerError(f"{self.name}: the connection dropped while a request was in flight")
        payload = await reader.read_frame()
        self._served += 1
        self._turn.set()
        self._turn = trio.Event()
        return payload

    async def _finish_late(self, gen: int, reader: FrameReader, ticket: int, rid: int, t0: float, rows: int,
                           deadline: float) -> None:
        """A request that missed its deadline: read its reply when it comes (its outputs were
        recomputed locally, so they are dropped) and mark the worker recovered; drop the connection
        if nothing comes within ``timeout_s``. Why not drop at once: a worker that was only late
        (a busy phone, a loaded machine) would be avoided for seconds, and every request queued
        behind this one on the connection would fail too."""
        ok = False
        try:
            with trio.move_on_after(max(0.0, t0 + self.timeout_s - time.perf_counter())):
                payload = await self._await_reply(gen, reader, ticket)
                ok = payload is not None and proto.unpack(payload).get("id") == rid
        except Exception:  # whatever went wrong, the connection is no longer trusted
            ok = False
        if not ok:
            if gen == self._gen:  # (an exception here would end the whole trio run: a system task)
                with contextlib.suppress(Exception):
                    await self._drop()
            return
        late = time.perf_counter() - t0
        if late <= LATE_REMEMBER * deadline:  # a hiccup widens the deadline; a long hang must not
            self._record(late, rows)
        self.recovered_at = time.monotonic()
        self.late_rows += rows
        log.info("worker %s answered its request of %d rows %.2f s after it was sent (deadline %.2f s; "
                 "its outputs were recomputed here): using it again", self.name, rows, late, deadline)

    def wire_status(self) -> dict:
        """Bytes sent / received, the replies that came coded and the link's measured rate (Mbit/s,
        None before it is measured): the status page's ``wire`` of this worker."""
        rate = self.link.bytes_per_s()
        return dict(self.wire.as_dict(), coded_replies=self.coded_replies,
                    link_mbps=None if rate is None else round(rate * 8e-6, 1))

    def reply_coding(self) -> str | None:
        """The output coding this request asks for: the negotiated one, unless the link is
        measured fast (then the worker's coding and our decoding would cost more than the bytes
        they save: plain float32). The backbone alone decides, per request, so both ends agree and
        an older worker (which codes only when asked) needs nothing new."""
        return None if self.output_coding is None or self.link.fast() else self.output_coding

    async def compute(self, layer: int, cur: np.ndarray, groups: Groups, family: str | None = None) -> list[np.ndarray]:
        """The worker's outputs for ``groups`` (as the local replica's ``forward_groups``).

        ``family``: the kernel family the worker must answer this request in, one of
        :attr:`families` (e.g. ``kernels.portable_family()``: a ggml backbone recomputing a sample
        with its own portable replica gets the same bits from any honest worker, of any ISA);
        None: the connection's family. A worker that cannot raises WorkerError (an error reply)."""
        form = None
        q = self.input_quantiser
        if q is not None and family is None and self.family is None and q.input_form(layer) in self.input_forms:
            # what the worker's ggml would make of them: the layer's rows quantised once for all
            # its owners where the dispatcher shares them (LayerInputs), else this owner's rows
            layer_inputs = LAYER_INPUTS.get()
            whole = layer_inputs.quantised(q, layer, cur) if layer_inputs is not None else None
            if whole is not None:
                rows, local_groups = pack_rows(whole[0], groups)
                form = whole[1]
            else:
                rows, local_groups = pack_rows(cur, groups)
                rows, form = q.quantise_input(layer, rows)
        else:
            rows, local_groups = pack_rows(cur, groups)
        rid = next(self._ids)
        req = proto.ComputeRequest(rid, layer, rows, local_groups, family, form, self.wire_precision,
                                   proto.wants_packed(form, self.input_forms), self.reply_coding())
        try:
            reply = await self.request(req.to_wire(), rid, rows=int(sum(len(idx) for _, idx in local_groups)))
            if proto.result_coded(reply.get("out")):  # decoding: CPU work, off the loop unless short
                pairs = int(sum(len(idx) for _, idx in local_groups))
                self.coded_replies += 1
                out = await self._decode.run(partial(proto.result_from_wire, reply.get("out")), pairs, "decode")
            else:
                out = proto.result_from_wire(reply.get("out"))
            if self.wire_precision is not None and reply["out"].get("dtype") != self.wire_precision:
                out = wire_precision.round_to(out, self.wire_precision)  # an older worker: float32
        except FrameError as exc:
            raise WorkerError(f"{self.name}: {exc}") from None
        counts = [len(idx) for _, idx in groups]
        if out.ndim != 2 or out.shape != (sum(counts), cur.shape[1]) or out.dtype != np.float32:
            raise WorkerError(f"{self.name} returned an array of shape {out.shape}, expected ({sum(counts)}, {cur.shape[1]})")
        outs, at = [], 0
        for n in counts:  # views of the one reply array, one per group (np.split: ~8 us more a call)
            outs.append(out[at:at + n])
            at += n
        return outs

    async def echo(self, payload: bytes) -> bytes | None:
        rid = next(self._ids)
        try:
            reply = await self.request(proto.pack({"op": "echo", "id": rid, "payload": payload}), rid)
        except FrameError as exc:
            raise WorkerError(f"{self.name}: {exc}") from None
        return reply.get("payload")

    async def aclose(self) -> None:
        await self._drop()
