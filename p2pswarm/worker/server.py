"""Serve an :class:`ExpertWorker` over framed msgpack: on a TCP socket, or on libp2p streams.

One connection (or libp2p stream) carries a handshake, then any number of requests answered in
order. :func:`handle_connection` is transport-agnostic: it needs only ``receive_some``,
``send_all``, ``send_eof`` and ``aclose`` (a trio TCP stream, or
:class:`p2pswarm.net.libp2p.stream.StreamAdapter` over a libp2p stream). The math of a request measured to
take more than ``$P2PSWARM_INLINE_MS`` (1.5 ms) runs in a thread (``trio.to_thread``) so the event
loop keeps other connections flowing; a smaller one (a decode step's few rows) runs inline, because
the thread hop costs more than the work (:mod:`p2pswarm.offload`). A malformed or oversized
frame closes *that* connection with an error message; the server keeps serving every other one.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import partial

import trio

from p2pswarm.engine import kernels
from p2pswarm.errors import FrameError, SwarmError, clip
from p2pswarm.net.wire import expert_protocol as proto
from p2pswarm.net.wire import codec as wire_codec
from p2pswarm.net.wire.framing import DEFAULT_MAX_FRAME, FrameReader, send_frame
from p2pswarm.net.wire.counting import CountingStream, WireBytes
from p2pswarm.net.wire.direct import choose_aead
from p2pswarm.worker.expert_worker import ExpertWorker, worker_shard_hash
from p2pswarm.worker.peer_limits import PeerBudget, PeerLimits

log = logging.getLogger("p2pswarm.worker")


@dataclass
class ServeStats:
    """What a worker served (logged on shutdown: proof that a backbone used it)."""

    requests: int = 0
    rows: int = 0
    refused: int = 0
    peers: set = field(default_factory=set)
    #: bytes received from / sent to backbones, every connection (p2pswarm.net.wire.counting)
    wire: WireBytes = field(default_factory=WireBytes)
    # backbone peer -> why it does not use this worker (its ``refused`` notice; /health shows it)
    refused_by: dict = field(default_factory=dict)


def check_hello(msg: dict, worker: ExpertWorker, shard: str | None = None) -> str | None:
    """Why a peer's hello is refused, or None if we agree on protocol, model and kernel (and on
    the shard hash, when the peer names the shard it expects, e.g. from our DHT record).

    Kernels agree when the peer's kernel is of our family, or when the peer's hello names a
    ``family`` we answer in (``worker.families``: ours and portable): then every request on that
    connection is answered in it, e.g. a ggml backbone verifying a worker of another ISA portably."""
    info = worker.info
    if msg.get("protocol") != proto.PROTOCOL_VERSION:
        return f"protocol version mismatch: peer {msg.get('protocol')!r}, ours {proto.PROTOCOL_VERSION}"
    if msg.get("model") != info.model_fingerprint:
        return (f"model mismatch: peer serves model {clip(msg.get('model'), 80)}, "
                f"this shard is of model {info.model_fingerprint}")
    want_family = msg.get("family")
    if want_family is not None:  # the peer asks for answers in this family, whatever its own kernel
        if want_family not in worker.families:
            return (f"kernel family mismatch: peer asks for answers in {clip(want_family, 80)!r}, this worker "
                    f"answers in {', '.join(worker.families)}")
    elif not kernels.compatible(msg.get("kernel"), info.kernel):
        return f"kernel mismatch: peer computes with {msg.get('kernel')!r}, this worker with {info.kernel!r}"
    want = msg.get("shard")
    if want is not None and shard is not None and want != shard:
        return f"shard mismatch: peer expects shard {clip(want, 80)}, this worker serves {shard}"
    return None


async def handle_connection(stream, worker: ExpertWorker | None, max_frame: int = DEFAULT_MAX_FRAME,
                            shard: str | None = None, stats: ServeStats | None = None,
                            shards: dict[str, ExpertWorker] | None = None, receipts=None, direct=None,
                            budget: PeerBudget | None = None) -> None:
    """Serve one connection/stream until the peer closes it. ``shard``: our shard hash for the
    hello (default: derived from the worker's shard file). ``shards``: a node serving several
    shards (``node --auto``): shard hash -> worker, read at each hello (so shards can come and go);
    the peer's hello names the shard it wants, and the stream is served by that worker.
    ``receipts``: a :class:`p2pswarm.market.receipts.ReceiptStore` keeping the contribution
    receipts backbones send. ``direct``: a :class:`p2pswarm.net.wire.direct.DirectLane`: a hello that
    asks for it (on this authenticated stream) gets a ticket for a direct connection, served by
    this same function as the same peer. ``budget``: the per-peer caps (streams, bytes in flight)
    shared by all of this worker's streams; None: none."""
    again = None if direct is None else partial(handle_connection, worker=worker, max_frame=max_frame, shard=shard,
                                                stats=stats, shards=shards, receipts=receipts, budget=budget)
    served: ExpertWorker | None = None  # the worker this stream is served by, known after the hello
    if shards is None:
        if worker is None:
            raise ValueError("handle_connection needs a worker or a shards table")
        served = worker
        if shard is None:
            shard = worker_shard_hash(worker)
    else:
        shard = None
    if stats is not None:
        stream = CountingStream(stream, stats.wire)
    peer = _peer_name(stream)
    # a libp2p peer is its peer id; a TCP one its address without the port (one per connection)
    key = peer if isinstance(getattr(stream, "peer_name", None), str) else peer.rpartition(":")[0] or peer
    held = [0]  # bytes of the frame being answered, reserved in budget

    def admit(n: int) -> None:
        if budget is not None:
            budget.take(key, n)
            held[0] = n

    if budget is not None:
        why = budget.open(key)
        if why is not None:
            log.warning("refused a stream from %s: %s", peer, why)
            try:
                await _refuse_and_close(stream, proto.error_to_wire(None, why), max_frame)
            finally:
                await trio.aclose_forcefully(stream)
            return
    reader = FrameReader(stream, max_frame, admit)
    greeted = False
    conn_family = None
    try:
        while True:
            if budget is not None:  # the last frame is answered: its bytes are no longer in flight
                budget.give(key, held[0])
                held[0] = 0
            try:
                payload = await reader.read_frame()
                if payload is None:
                    return
                msg = proto.unpack(payload)
            except FrameError as exc:
                log.warning("closing connection from %s: %s", peer, exc)
                await _refuse_and_close(stream, proto.error_to_wire(None, str(exc)), max_frame)
                return
            op = msg["op"]
            rid = msg.get("id") if isinstance(msg.get("id"), int) else None
            if op == "hello":
                if shards is not None:
                    want = msg.get("shard")
                    if not isinstance(want, str) or want not in shards:
                        await _refuse_and_close(stream, proto.pack({
                            "op": "hello", "ok": False, "protocol": proto.PROTOCOL_VERSION,
                            "error": f"shard {clip(want, 80)} is not served here (any more)"}), max_frame)
                        if stats is not None:
                            stats.refused += 1
                        return
                    served, shard = shards[want], want
                assert served is not None  # set above: from the argument, or from shards by the hello
                reason = check_hello(msg, served, shard)
                info = served.info
                hello = {"op": "hello", "ok": reason is None, "protocol": proto.PROTOCOL_VERSION,
                         "model": info.model_fingerprint, "kernel": info.kernel, "families": list(served.families),
                         "input_forms": proto.hello_input_forms(served.input_forms()),  # rows it takes pre-quantised
                         "output_codings": [wire_codec.OUTPUT_CODING] if wire_codec.can_code() else [],
                         "shard": shard, "layers": [info.layer_begin, info.layer_end],
                         "experts": [info.expert_begin, info.expert_end]}
                if reason:
                    hello["error"] = reason
                    log.warning("refused %s at handshake: %s", peer, reason)
                    if stats is not None:
                        stats.refused += 1
                if not reason and direct is not None and msg.get("direct") is True:
                    aead, why = choose_aead(msg.get("direct_aeads"))
                    if aead is not None:
                        hello["direct"] = direct.offer(peer, again, aead)
                    else:  # the backbone keeps this stream, and can say why it has no direct lane
                        hello["direct_error"] = why
                        log.warning("no direct lane for %s: %s", peer, why)
                await send_frame(stream, proto.pack(hello), max_frame)
                if reason:
                    return
                greeted = True
                conn_family = msg.get("family")  # checked by check_hello: one of worker.families
            elif op == "echo":
                data = msg.get("payload")
                if not isinstance(data, bytes):
                    await send_frame(stream, proto.error_to_wire(rid, "echo needs a bytes payload"), max_frame)
                    continue
                await send_frame(stream, proto.pack({"op": "echo", "id": rid, "payload": data}), max_frame)
            elif op == "compute":
                if not greeted or served is None:
                    await _try_send(stream, proto.error_to_wire(rid, "handshake required before compute"), max_frame)
                    return
                reply: bytes
                try:
                    req = proto.ComputeRequest.from_msg(msg)
                    outputs = await served.compute_async(req.layer, req.rows, req.groups, req.family or conn_family,
                                                         req.form)
                    if req.coding is not None and req.out is None:  # coding: CPU work, off the loop
                        reply = await trio.to_thread.run_sync(proto.result_to_wire, req.id, outputs,
                                                              served.info.n_embd, None, req.coding)
                    else:
                        reply = proto.result_to_wire(req.id, outputs, served.info.n_embd, req.out)
                    log.debug("computed layer %d for %s: %d experts, %d rows", req.layer, peer, len(req.groups),
                              len(req.rows))
                    if stats is not None:
                        stats.requests += 1
                        stats.rows += sum(len(idx) for _, idx in req.groups)
                        stats.peers.add(peer)
                except (FrameError, SwarmError) as exc:
                    log.warning("bad request from %s: %s", peer, exc)
                    reply = proto.error_to_wire(rid, str(exc))
                await send_frame(stream, reply, max_frame)
            elif op == "refused":  # a backbone saying it does not use us, and why (refusal_notice.py)
                _note_refusal(peer, msg.get("reason"), stats)
                await _try_send(stream, proto.pack({"op": "refused", "ok": True}), max_frame)
                return
            elif op == "receipt":
                await send_frame(stream, await _store_receipt(msg, rid, peer, receipts), max_frame)
            else:
                await send_frame(stream, proto.error_to_wire(rid, f"unknown op {op!r}"), max_frame)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        log.info("connection from %s dropped", peer)
    finally:
        if budget is not None:
            budget.give(key, held[0])
            budget.close(key)
        await trio.aclose_forcefully(stream)


def _note_refusal(peer: str, reason: object, stats: ServeStats | None) -> None:
    reason = clip(reason if isinstance(reason, str) and reason else "no reason given", 300)
    if stats is not None:
        if stats.refused_by.get(peer) == reason:
            return
        stats.refused_by[peer] = reason
    log.warning("backbone %s does not use this worker: %s", peer, reason)


async def _store_receipt(msg: dict, rid: int | None, peer: str, receipts) -> bytes:
    """The reply to a ``receipt`` op: stored (durably, before we say so) or why not."""
    from p2pswarm.net.signed.envelope import SignedError  # only workers that keep receipts need it

    if receipts is None:
        return proto.error_to_wire(rid, "this worker keeps no receipts")
    try:
        r = await trio.to_thread.run_sync(receipts.save, msg.get("receipt"), peer)
    except (SignedError, OSError) as exc:
        log.warning("refused a receipt from %s: %s", peer, exc)
        return proto.error_to_wire(rid, f"receipt refused: {clip(exc, 200)}")
    log.info("stored receipt %d from backbone %s: %d rows, %d bytes (totals %d rows, %d bytes)", r.seq, r.backbone,
             r.rows, r.bytes, r.total_rows, r.total_bytes)
    return proto.pack({"op": "receipt", "id": rid, "ok": True, "seq": r.seq})


async def _refuse_and_close(stream, payload: bytes, max_frame: int, linger_s: float = 2.0) -> None:
    """Send a last error frame so the peer learns why, then close without resetting it.

    Closing a TCP socket with unread input sends a reset, which can destroy the error frame in
    flight. So: send it, half-close, and discard what the peer is still sending for a moment.
    """
    await _try_send(stream, payload, max_frame)
    with trio.move_on_after(linger_s):
        try:
            await stream.send_eof()
            while await stream.receive_some(1 << 16):
                pass
        except (trio.BrokenResourceError, trio.ClosedResourceError, AttributeError, FrameError):
            pass  # (FrameError: a sealed direct-lane record that does not authenticate: stop reading)


async def _try_send(stream, payload: bytes, max_frame: int) -> None:
    try:
        await send_frame(stream, payload, max_frame)
    except (trio.BrokenResourceError, trio.ClosedResourceError, FrameError):
        pass


def _peer_name(stream) -> str:
    name = getattr(stream, "peer_name", None)  # a libp2p stream adapter names its peer
    if isinstance(name, str):
        return name
    try:
        host, port = stream.socket.getpeername()[:2]
        return f"{host}:{port}"
    except Exception:
        return "peer"


async def serve_tcp(worker: ExpertWorker, host: str, port: int, *, ready=None, max_frame: int = DEFAULT_MAX_FRAME,
                    stats: ServeStats | None = None, budget: PeerBudget | None = None):
    """Serve until cancelled. ``ready(host, port)`` is called once listening (port 0 -> real port).
    ``budget``: per-peer caps (default :class:`PeerLimits`' defaults; a TCP peer is its address)."""
    budget = budget if budget is not None else PeerBudget(PeerLimits(max_frame=max_frame))
    listeners = await trio.open_tcp_listeners(port, host=host)
    bound = listeners[0].socket.getsockname()
    if ready is not None:
        ready(bound[0], bound[1])
    await trio.serve_listeners(partial(handle_connection, worker=worker, max_frame=max_frame, stats=stats,
                                       budget=budget), listeners)


def serve_libp2p_shards(net, shards: dict[str, ExpertWorker], *, max_frame: int = DEFAULT_MAX_FRAME,
                        stats: ServeStats | None = None, receipts=None, direct=None,
                        budget: PeerBudget | None = None) -> None:
    """Serve every worker of ``shards`` (shard hash -> worker; the dict may change while serving)
    on ``/p2pswarm/expert/1.0.0``: each stream's hello picks its shard."""
    budget = budget if budget is not None else PeerBudget(PeerLimits(max_frame=max_frame))
    net.set_handler(proto.PROTOCOL_EXPERT, partial(handle_connection, worker=None, max_frame=max_frame, stats=stats,
                                                   shards=shards, receipts=receipts, direct=direct, budget=budget))


def serve_libp2p(net, worker: ExpertWorker, *, max_frame: int = DEFAULT_MAX_FRAME, shard: str | None = None,
                 stats: ServeStats | None = None, receipts=None, direct=None,
                 budget: PeerBudget | None = None) -> None:
    """Serve ``worker`` on ``/p2pswarm/expert/1.0.0`` of a running :class:`p2pswarm.net.libp2p.host.NetHost`
    (until the host closes, or ``net.remove_handler(PROTOCOL_EXPERT)``). Each stream is one
    connection of :func:`handle_connection`; ``budget`` caps what one peer holds (default
    :class:`PeerLimits`' defaults)."""
    shard = worker_shard_hash(worker) if shard is None else shard
    budget = budget if budget is not None else PeerBudget(PeerLimits(max_frame=max_frame))
    net.set_handler(proto.PROTOCOL_EXPERT, partial(handle_connection, worker=worker, max_frame=max_frame,
                                                   shard=shard, stats=stats, receipts=receipts, direct=direct,
                                                   budget=budget))
