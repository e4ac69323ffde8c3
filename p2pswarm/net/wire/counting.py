"""Bytes on the wire of the expert RPC, counted where the framing hands them to the transport.

Why: bandwidth, not round trips, bounds this design on real networks: every routed
expert's input and output rows cross the wire each layer of each token. :class:`CountingStream`
wraps the trio byte stream a connection's frames travel on (a TCP socket, a
:class:`~p2pswarm.net.libp2p.stream.StreamAdapter` over a libp2p stream, a direct lane's sealed stream)
and adds every byte of ``send_all`` and ``receive_some`` to a :class:`WireBytes`: frame headers
(8 bytes a frame, :mod:`p2pswarm.net.wire.framing`), the handshake, echoes and receipts included. Over
a plain TCP connection that is exactly what the socket carries (a test checks it against a proxy
that counts what it forwards); below it are TCP/IP headers (~52 bytes a segment of up to ~1448) and,
on libp2p, Noise (16 bytes of MAC + 2 of length a message) and yamux (12 bytes a frame of up to
65,524), or the direct lane's sealing (:mod:`p2pswarm.net.wire.direct`), none of which is counted.

A :class:`WireBytes` may have a ``parent`` (the backbone's total over all its owners, past ones
included), to which everything counted is added too.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class WireBytes:
    """Bytes (and transport writes/reads) one way and the other, as seen from this end."""

    sent: int = 0
    received: int = 0
    writes: int = 0
    reads: int = 0
    parent: "WireBytes | None" = None

    def add_sent(self, n: int) -> None:
        w: WireBytes | None = self
        while w is not None:
            w.sent += n
            w.writes += 1
            w = w.parent

    def add_received(self, n: int) -> None:
        w: WireBytes | None = self
        while w is not None:
            w.received += n
            w.reads += 1
            w = w.parent

    def as_dict(self) -> dict:
        return {"sent": self.sent, "received": self.received}


class CountingStream:
    """A trio-style byte stream that counts what passes through it into a :class:`WireBytes`;
    everything else (``send_eof``, ``aclose``, ``supports_at_least``, ``peer_name``...) is the
    wrapped stream's."""

    def __init__(self, stream, wire: WireBytes):
        self.stream = stream
        self.wire = wire

    async def send_all(self, data) -> None:
        await self.stream.send_all(data)
        self.wire.add_sent(len(data))

    async def receive_some(self, *args, **kwargs) -> bytes:
        data = await self.stream.receive_some(*args, **kwargs)
        if data:
            self.wire.add_received(len(data))
        return data

    def __getattr__(self, name):
        return getattr(self.stream, name)

    def __setattr__(self, name, value):
        if name in ("stream", "wire"):
            object.__setattr__(self, name, value)
        else:  # (e.g. the backbone names a direct lane's peer after its handshake)
            setattr(self.stream, name, value)
