"""Telling a worker that this backbone does not use it, and why.

A backbone refuses a worker for reasons only the backbone knows: its signed record names another
kernel family, block size, protocol or model (``CoverageResolver``), its hello does not match its
record (``Libp2pOwner``), or it is banned (``BanKeeper``). The worker used to go on logging
"serving" for ever while getting no requests, so its operator had nothing to act on.

Now the backbone sends the worker one ``refused`` notice per reason on the expert protocol
(``{"op": "refused", "reason": str}``, no hello needed: it asks nothing of the worker) and the
worker logs it and shows it on its ``/health`` (:mod:`p2pswarm.worker.health`). The notice is a
courtesy, not part of any decision: a worker that cannot be reached, or an older one that answers
"unknown op", changes nothing; a forged notice can only make a worker's log say something.
"""
from __future__ import annotations

import logging

import multiaddr
import trio
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo

from p2pswarm.errors import SwarmError, clip
from p2pswarm.net.wire import expert_protocol as proto
from p2pswarm.net.wire.framing import DEFAULT_MAX_FRAME, FrameReader, send_frame

log = logging.getLogger("p2pswarm.backbone")

NOTICE_TIMEOUT_S = 5.0
MAX_PENDING = 256  # notices waiting to be sent; more are dropped (the next refusal says it again)


class RefusalNotices:
    """Queue and send refusal notices, once per (worker, reason). ``addrs_of(peer)`` gives the
    worker's addresses (from its record)."""

    def __init__(self, net, addrs_of, *, timeout_s: float = NOTICE_TIMEOUT_S):
        self.net, self.addrs_of, self.timeout_s = net, addrs_of, timeout_s
        self.told: dict[str, str] = {}  # peer -> the reason last sent
        self.sent = self.failed = 0
        self._send, self._recv = trio.open_memory_channel(MAX_PENDING)

    def note(self, peer: str, reason: str) -> None:
        """From any (sync) code on the event loop: tell ``peer`` soon, unless already told this."""
        if self.told.get(peer) == reason:
            return
        self.told[peer] = reason
        try:
            self._send.send_nowait((peer, reason))
        except trio.WouldBlock:
            self.told.pop(peer, None)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        async with trio.open_nursery() as nursery:
            async for peer, reason in self._recv:
                nursery.start_soon(self._tell, peer, reason)

    async def _tell(self, peer: str, reason: str) -> None:
        addrs = [multiaddr.Multiaddr(a) for a in (self.addrs_of(peer) or ())]
        stream = None
        try:
            with trio.fail_after(self.timeout_s):
                stream = await self.net.open_stream(PeerInfo(ID.from_base58(peer), addrs), proto.PROTOCOL_EXPERT,
                                                    timeout_s=self.timeout_s)
                await send_frame(stream, proto.pack({"op": "refused", "reason": reason}), DEFAULT_MAX_FRAME)
                reply = await FrameReader(stream, DEFAULT_MAX_FRAME).read_frame()
            ok = reply is not None and proto.unpack(reply).get("ok") is True
            self.sent += ok
            log.info("told worker %s why it is not used%s", peer, "" if ok else " (it did not acknowledge)")
        except (SwarmError, trio.TooSlowError, trio.BrokenResourceError, trio.ClosedResourceError, ValueError) as exc:
            self.failed += 1
            log.info("could not tell worker %s why it is not used: %s", peer, clip(exc, 200))
        finally:
            if stream is not None:
                await trio.aclose_forcefully(stream)
