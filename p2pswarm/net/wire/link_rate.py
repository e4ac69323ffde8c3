"""A link's delivery rate, measured from how the bytes of one message arrive.

Why: the lossless output coding (:mod:`p2pswarm.net.wire.codec`) takes ~17% off the float32
outputs for ~2 ms of the worker's CPU per MiB to code and ~1 ms of the backbone's to decode. On a
link of tens of Mbit/s that is time saved; on loopback or a LAN of Gbit/s it is CPU for nothing (by
the profile, 11% of a 0.3-core backbone's running samples with 4 workers, docs/benchmarks.md). So
the backbone asks for the coding per request only where the link it reads replies from is not
measured fast (:meth:`LinkRate.fast`).

How: a message (a frame on a plain socket, a sealed record on a direct lane) that arrives in more
than one read shows the link's pace: the bytes after its first read over the time from that read
to its last. Waiting on our own CPU (a throttled backbone) only makes a sample slower, never
faster, so a fast link is never mistaken for a slow one by a stall that is ours, only the other way
round, for a while (the estimate is the median of recent samples). A message that arrives in one
read gives no sample (it says nothing about the time it took). Until :data:`MIN_SAMPLES` samples
are in, the link is *not* called fast: the coding stays, as before this measurement.
"""
from __future__ import annotations

import collections
import statistics
import time

from p2pswarm import settings

#: bytes after a message's first read below which it gives no sample (a few packets' worth: the
#: read boundaries of shorter messages are mostly the kernel's, not the link's)
MIN_SAMPLE_BYTES = 16 * 1024
WINDOW = 16  # samples the estimate is the median of
MIN_SAMPLES = 3


class LinkRate:
    """Receive-side rate of one connection (kept across its reconnects: the same link).

    The reader of the raw bytes calls :meth:`read` after each read and :meth:`message_done` when a
    message is whole; :meth:`begin` when a new message starts with bytes already buffered."""

    def __init__(self):
        self._samples: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self._first_at: float | None = None  # when the current message's first bytes were read
        self._last_at = 0.0  # when the last read returned
        self._after_first = 0  # the current message's bytes read after its first read
        self._rate: float | None = None  # the median, updated with each sample (read per request)

    def begin(self, buffered: bool) -> None:
        """A new message starts; ``buffered``: some of its bytes came with the last read."""
        self._first_at = self._last_at if buffered else None
        self._after_first = 0

    def read(self, n: int) -> None:
        self._last_at = time.perf_counter()
        if self._first_at is None:
            self._first_at = self._last_at
        else:
            self._after_first += n

    def message_done(self) -> None:
        if self._after_first >= MIN_SAMPLE_BYTES and self._first_at is not None:
            span = self._last_at - self._first_at
            if span > 0:
                self._samples.append(self._after_first / span)
                if len(self._samples) >= MIN_SAMPLES:
                    self._rate = statistics.median(self._samples)
        self._first_at, self._after_first = None, 0

    def bytes_per_s(self) -> float | None:
        """The median of the recent samples (bytes/s); None before :data:`MIN_SAMPLES`."""
        return self._rate

    def fast(self) -> bool:
        """True when the link is measured at or above ``P2PSWARM_WIRE_CODEC_FAST_MBPS``: coding
        its replies would save less time than it costs."""
        rate = self.bytes_per_s()
        return rate is not None and rate * 8e-6 >= settings.WIRE_CODEC_FAST_MBPS.get()
