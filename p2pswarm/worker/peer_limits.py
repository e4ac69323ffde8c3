"""A worker's limits per peer: how many expert streams one peer may hold open, and how many request
bytes it may have in flight (frames being read, computed and answered) at once.

Why: every stream is served concurrently, and each may carry a frame of up to ``max_frame`` bytes
(128 MiB), so without a cap one peer opening many streams (a flood, or a broken backbone) could
make the worker buffer gigabytes and starve the backbones it serves. Over a cap the stream gets an
error frame and is closed, as a malformed frame is; the other peers' streams go on. A backbone
uses a few streams to a worker (one per lane, more while a connection is replaced), far below the
defaults.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from p2pswarm.errors import FrameError, UserError
from p2pswarm.net.wire.framing import DEFAULT_MAX_FRAME


@dataclass(frozen=True)
class PeerLimits:
    """The caps (``node --role worker`` flags ``--max-streams-per-peer``, ``--max-peer-mib``)."""

    max_streams_per_peer: int = 64
    max_bytes_per_peer: int = 512 << 20  # request bytes in flight, one peer, all its streams
    max_frame: int = DEFAULT_MAX_FRAME

    def check(self) -> PeerLimits:
        if self.max_streams_per_peer < 1:
            raise UserError(f"--max-streams-per-peer must be >= 1, got {self.max_streams_per_peer}")
        if self.max_bytes_per_peer < 1 << 20:
            raise UserError(f"--max-peer-mib must be >= 1, got {self.max_bytes_per_peer / (1 << 20):g}")
        return self


@dataclass
class PeerBudget:
    """What each peer holds now; shared by every stream of one worker process."""

    limits: PeerLimits = field(default_factory=PeerLimits)
    streams: dict[str, int] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)
    refused: int = 0  # streams and frames refused over a cap

    def open(self, peer: str) -> str | None:
        """Count a new stream of ``peer``; why it is refused (and not counted) when over the cap."""
        n = self.streams.get(peer, 0)
        if n >= self.limits.max_streams_per_peer:
            self.refused += 1
            return (f"too many streams from one peer: {n} open, the limit is {self.limits.max_streams_per_peer} "
                    f"(--max-streams-per-peer)")
        self.streams[peer] = n + 1
        return None

    def close(self, peer: str) -> None:
        n = self.streams[peer] - 1
        if n:
            self.streams[peer] = n
        else:
            del self.streams[peer]  # bounded by the peers connected now

    def take(self, peer: str, n: int) -> None:
        """Reserve a frame's ``n`` bytes before its body is read; a FrameError over the cap."""
        held = self.bytes.get(peer, 0)
        if held + n > self.limits.max_bytes_per_peer:
            self.refused += 1
            raise FrameError(f"a frame of {n} bytes would put this peer's requests in flight at {held + n} bytes, "
                             f"over the limit of {self.limits.max_bytes_per_peer} (--max-peer-mib)")
        self.bytes[peer] = held + n

    def give(self, peer: str, n: int) -> None:
        if not n:
            return
        left = self.bytes[peer] - n
        if left:
            self.bytes[peer] = left
        else:
            del self.bytes[peer]
