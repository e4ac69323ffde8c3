"""Stop strings (OpenAI's ``stop``): end generation where one occurs, never emit it.

Tokens do not line up with stop strings: ``"END"`` may arrive as ``"E"`` + ``"ND"``, or inside one
token together with text before it. So streamed text is held back while its tail could still be
the start of a stop string, and released once it cannot; when a stop string completes, the text
before it is the last piece emitted and generation ends (``finish_reason: "stop"``).
"""
from __future__ import annotations

MAX_STOPS = 4  # OpenAI's limit
MAX_STOP_CHARS = 256


def parse_stop(value) -> list[str]:
    """``stop`` as the API accepts it (null, a string, or a list of up to 4 strings) -> a list.
    Raises ValueError with the reason (a 400 upstream)."""
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ValueError("'stop' must be a string or a list of strings")
    if len(stops) > MAX_STOPS:
        raise ValueError(f"'stop' has {len(stops)} strings; at most {MAX_STOPS}")
    if any(not s for s in stops):
        raise ValueError("'stop' strings must not be empty")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise ValueError(f"'stop' strings must be at most {MAX_STOP_CHARS} characters")
    return list(dict.fromkeys(stops))


class StopMatcher:
    """Feed text pieces in order; get back what may be emitted now.

    >>> m = StopMatcher(["END"])
    >>> m.push("abc E"), m.push("ND tail"), m.stopped
    ('abc ', '', True)
    """

    def __init__(self, stops: list[str]):
        self.stops = list(stops)
        self._held = ""
        self.stopped = False

    def push(self, piece: str) -> str:
        """The text that is safe to emit after ``piece``; '' once a stop string has matched."""
        if self.stopped:
            return ""
        buf = self._held + piece
        if not self.stops:
            self._held = ""
            return buf
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            self._held = ""
            return buf[:min(hits)]
        keep = self._partial_tail(buf)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep]

    def flush(self) -> str:
        """Generation ended without a stop string: the held-back tail is plain text after all."""
        out, self._held = ("" if self.stopped else self._held), ""
        return out

    def _partial_tail(self, buf: str) -> int:
        """Length of the longest tail of ``buf`` that is a proper prefix of some stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:n]):
                    best = n
                    break
        return best
