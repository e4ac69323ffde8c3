"""A worker's last receipts, fetched when it stops cleanly.

Backbones hand receipts out every ``--receipt-period`` (60 s) on the expert stream
(:class:`p2pswarm.market.receipts.ReceiptIssuer`). A worker that stopped between two periods used
to lose the work done since its last receipt: nobody was left to take it. So a worker stopped by
SIGINT/SIGTERM, once its record is withdrawn, asks every backbone it served for its receipts now,
on ``/p2pswarm/receipt/1.0.0``:

    worker -> backbone   {"op": "receipts"}
    backbone -> worker   {"op": "receipts", "receipts": [bin, ...]}   (signed, oldest first)
    worker -> backbone   {"op": "stored", "seqs": [int, ...]}          (on disk, fsync'd)

The backbone signs a receipt for the work since the last one (``ContributionLedger.issue``) and
answers with every undelivered receipt of *the stream's authenticated peer* (nobody can ask for
another worker's); what the worker stored is marked delivered, the rest is sent again later as
before. Bounded by a few seconds in all: a backbone that does not answer costs the worker only
that wait.
"""
from __future__ import annotations

import logging

import trio

from p2pswarm.errors import SwarmError, clip
from p2pswarm.net.wire import expert_protocol as proto
from p2pswarm.net.wire.framing import DEFAULT_MAX_FRAME, FrameReader, send_frame

log = logging.getLogger("p2pswarm.market")

PROTOCOL_RECEIPT = "/p2pswarm/receipt/1.0.0"
LAST_RECEIPT_TIMEOUT_S = 5.0
#: how long a worker waits for the backbone to close the exchange after its "stored" frame
STORED_LINGER_S = 1.0


def serve_receipt_requests(net, ledger) -> None:
    """Backbone side: answer workers asking for their receipts (see the module doc)."""

    async def handle(stream) -> None:
        peer = stream.peer_name
        reader = FrameReader(stream, DEFAULT_MAX_FRAME)
        try:
            with trio.fail_after(LAST_RECEIPT_TIMEOUT_S):
                msg = proto.unpack(await reader.read_frame() or b"")
                if msg.get("op") != "receipts":
                    return
                ledger.issue()
                pending = ledger.pending().get(peer, [])
                await send_frame(stream, proto.pack({"op": "receipts", "receipts": [r.signed for r in pending]}),
                                 DEFAULT_MAX_FRAME)
                reply = proto.unpack(await reader.read_frame() or b"")
            stored = reply.get("seqs") if reply.get("op") == "stored" else None
            for seq in stored if isinstance(stored, list) else ():
                if isinstance(seq, int):
                    ledger.delivered(peer, seq)
            log.info("handed worker %s its last %d receipts as it left", peer, len(pending))
        except (SwarmError, trio.TooSlowError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            log.info("worker %s asked for its receipts but the exchange failed: %s", peer, clip(exc, 200))
        finally:
            await trio.aclose_forcefully(stream)

    net.set_handler(PROTOCOL_RECEIPT, handle)


async def collect_last_receipts(net, backbones, store, *, timeout_s: float = LAST_RECEIPT_TIMEOUT_S) -> int:
    """Worker side: ask each of ``backbones`` (peer ids it served) for its receipts and store them
    in ``store`` (a :class:`p2pswarm.market.receipts.ReceiptStore`). Returns how many were stored."""
    from libp2p.peer.id import ID

    stored = 0

    async def one(peer: str) -> None:
        nonlocal stored
        stream = None
        try:
            stream = await net.open_stream(ID.from_base58(peer), PROTOCOL_RECEIPT, timeout_s=timeout_s)
            reader = FrameReader(stream, DEFAULT_MAX_FRAME)
            await send_frame(stream, proto.pack({"op": "receipts"}), DEFAULT_MAX_FRAME)
            msg = proto.unpack(await reader.read_frame() or b"")
            seqs = []
            for data in msg.get("receipts") or ():
                r = await trio.to_thread.run_sync(store.save, data, peer)
                seqs.append(r.seq)
            await send_frame(stream, proto.pack({"op": "stored", "seqs": seqs}), DEFAULT_MAX_FRAME)
            stored += len(seqs)
            # The backbone closes once it has read that frame: wait for it. Closing first let our
            # close overtake the frame (py-libp2p's yamux delivered the end of stream before it), and
            # the backbone never learnt what was stored (it would send those receipts again).
            with trio.move_on_after(STORED_LINGER_S):
                try:
                    await reader.read_frame()
                except (SwarmError, trio.BrokenResourceError, trio.ClosedResourceError):
                    pass  # a reset instead of a close: the backbone is gone either way
        except Exception as exc:  # a courtesy on the way out: never blocks the exit
            log.info("no last receipts from backbone %s: %s", peer, clip(exc, 200))
        finally:
            if stream is not None:
                await trio.aclose_forcefully(stream)

    with trio.move_on_after(timeout_s):
        async with trio.open_nursery() as nursery:
            for peer in backbones:
                nursery.start_soon(one, peer)
    if stored:
        log.info("stored %d last receipts from %d backbones before leaving", stored, len(backbones))
    return stored
