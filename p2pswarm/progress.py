"""Progress on long work: a bar on a terminal, a log line every few seconds otherwise."""
from __future__ import annotations

import logging
import sys
import time

log = logging.getLogger("p2pswarm")


class ProgressBar:
    def __init__(self, label: str, unit: str = "", stream=None, every_s: float = 5.0):
        self.label, self.unit = label, unit
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.every_s = every_s
        self.t0 = self._last = time.monotonic()
        self._drawn = False

    def update(self, done: int, total: int) -> None:
        now = time.monotonic()
        if self.tty:
            if now - self._last < 0.1 and done < total:
                return
            frac = done / total if total else 1.0
            width = 30
            bar = "#" * int(frac * width) + "-" * (width - int(frac * width))
            rate = done / max(now - self.t0, 1e-9)
            self.stream.write(f"\r{self.label} [{bar}] {frac * 100:5.1f}% {_human(done)}{self.unit}"
                              f" {_human(rate)}{self.unit}/s")
            self.stream.flush()
            self._drawn = True
        elif now - self._last >= self.every_s:
            log.info("%s: %.1f%% (%s%s of %s%s)", self.label, 100 * done / max(total, 1), _human(done), self.unit,
                     _human(total), self.unit)
        self._last = now

    def close(self) -> None:
        if self._drawn:
            self.stream.write("\n")
            self.stream.flush()


def _human(n: float) -> str:
    for unit in ("", "K", "M", "G", "T"):
        if abs(n) < 1000:
            return f"{n:.1f}{unit}" if unit else f"{n:.0f}"
        n /= 1000
    return f"{n:.1f}P"
