"""Progress on long work (slice, manifest, fetch / worker download, make-model, the demo's model).

Why one helper: every long command reports progress the same way, and a user sees it both on a
terminal and in a log file or CI output. On a terminal it is a tqdm bar (done, total, rate, ETA);
otherwise (stderr is a pipe or a file) tqdm's own numbers go out as whole lines, one each time the
work crosses another 10 % and at least every ``every_s`` seconds, so a log shows a download moving
without being flooded by carriage returns.

Work that ends within ``after_s`` seconds prints no lines off a terminal: a quick ``slice`` of a
tiny model stays quiet, and a refused run still ends with its single error line.
``$P2PSWARM_PROGRESS_AFTER`` overrides ``after_s`` (0: lines from the start).

A bar is fed absolute positions, ``update(done, total)``, from any thread (the manifest hashes in
several), and is usable as ``progress(done, total, what)`` by :func:`p2pswarm.model.synth.make_model`.
"""
from __future__ import annotations

import sys
import threading
import time

from tqdm import tqdm

from p2pswarm import settings

#: Off a terminal: a line each time the work crosses another 1/LINE_STEPS of the total.
LINE_STEPS = 10


def _after_s(default: float) -> float:
    after = settings.PROGRESS_AFTER.get()
    return default if after is None else after


class ProgressBar:
    """``label``'s progress on ``stream`` (default stderr); ``unit="B"`` counts bytes (k/M/G)."""

    def __init__(self, label: str, unit: str = "B", stream=None, every_s: float = 5.0, after_s: float = 1.0):
        self.label = label
        self.unit = unit.strip() or "items"
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every_s = every_s
        self.after_s = _after_s(after_s)
        self.t0 = time.monotonic()
        self._lock = threading.Lock()
        self._bar: tqdm | None = None
        self._last_line = self.t0
        self._steps_shown = 0
        self._printed = False
        self._printed_done = -1
        self._done = 0
        self._total = 0
        self._closed = False

    # --- feeding ---------------------------------------------------------------------------
    def __call__(self, done: int, total: int, what: str | None = None) -> None:
        self.update(done, total, what)

    def update(self, done: int, total: int, what: str | None = None) -> None:
        with self._lock:
            if self._closed:
                return
            if int(done) < self._done:  # a new phase (make-model: writing, then quantising)
                self._steps_shown = 0
            self._done, self._total = int(done), int(total)
            if self.tty:
                self._draw(what)
            else:
                self._maybe_line(what)

    def close(self) -> None:
        """End the bar (a newline after it); off a terminal, a final line if any line was printed."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._bar is not None:
                self._bar.close()
            elif self._printed and self._total and self._done >= self._total and self._printed_done != self._done:
                self._line(None)

    def __enter__(self) -> "ProgressBar":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- a terminal: tqdm's bar ------------------------------------------------------------
    def _draw(self, what: str | None) -> None:
        if self._bar is None:
            self._bar = tqdm(total=self._total or None, desc=self.label, unit=self.unit,
                             unit_scale=self.unit == "B", file=self.stream, mininterval=0.1, leave=True,
                             dynamic_ncols=True)
        bar = self._bar
        if self._total and bar.total != self._total:
            bar.total = self._total
        if what is not None:
            bar.set_postfix_str(what[:40], refresh=False)
        bar.update(self._done - bar.n)

    # --- not a terminal: whole lines -------------------------------------------------------
    def _maybe_line(self, what: str | None) -> None:
        now = time.monotonic()
        if now - self.t0 < self.after_s or self._total <= 0:
            return
        steps = self._done * LINE_STEPS // self._total  # integers: exact at every tenth
        if steps > self._steps_shown or now - self._last_line >= self.every_s:
            self._line(what)
            self._last_line = now
            self._steps_shown = max(self._steps_shown, steps)

    def _line(self, what: str | None) -> None:
        elapsed = time.monotonic() - self.t0
        if self.unit == "B":
            fmt = "{desc}: {percentage:3.0f}% {n_fmt}B of {total_fmt}B, {rate_fmt}, {elapsed} elapsed, ETA {remaining}"
        else:
            fmt = "{desc}: {percentage:3.0f}% {n_fmt}/{total_fmt} {unit}, {rate_fmt}, {elapsed} elapsed, ETA {remaining}"
        text = tqdm.format_meter(self._done, self._total or None, elapsed, unit=self.unit,
                                 unit_scale=self.unit == "B", prefix=self.label, bar_format=fmt)
        if what:
            text += f" ({what})"
        self.stream.write(text + "\n")
        self.stream.flush()
        self._printed = True
        self._printed_done = self._done
