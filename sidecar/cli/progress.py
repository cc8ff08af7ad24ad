"""Progress display for long CLI commands: a redrawn bar block on a terminal, plain lines elsewhere.

Why not a spinner: users of ``juicefs warmup`` read a spinner as "stuck". Every line here says how
far (files and bytes), how fast, and how long is left. On a terminal the block of lines (one per
daemon plus a total) is redrawn in place with ANSI cursor movement; in a log (not a TTY) a plain
line is printed every few seconds instead, so CI logs stay readable and grep-able.

Why not rich or tqdm (both measured on a pty with TERM=xterm, rich 15.0, tqdm 4.70):

- Redraw: rich's ``Live`` moves up with ``CR, EL2, (CUU1, EL2) x (n-1)`` and hides the cursor;
  tqdm's ``position=`` bars move with one ``CUU`` per bar and start each with ``CR``. Neither
  can emit the one ``CPL n`` (``ESC[nF``) per frame that redraws this block and that
  tests/cli/test_warmup.py splits frames on.
- Numbers: rich's speed column is SI (``MB/s``, ``filesize.decimal``) and its ETA ``0:00:18`` or
  ``00:18``; tqdm prints ``1.50kB`` and ``01:15``. Sizes here are IEC (``1.5 KiB``, the units
  ``--cache-size 200GiB`` takes) and the ETA ``1:15`` (tests/cli/test_policy.py pins it).
- Labels: rich's ``overflow="ellipsis"`` keeps a label's start; a daemon's socket path is told
  apart by its end (``…/node-b.sock``), which :func:`render_line` keeps.
- Bar: tqdm's ``format_meter(bar_format="{bar}")`` draws exactly :func:`render_bar`'s eighths
  (equal for widths 1-120 at 1001 fractions); a runtime dependency for eight lines is no gain.
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass
from typing import IO

__all__ = [
    "Display",
    "Progress",
    "ProgressLine",
    "RateMeter",
    "format_bytes",
    "format_eta",
    "format_pair",
    "format_rate",
    "render_bar",
    "render_line",
]

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
# Eighth blocks give a smooth bar on any UTF-8 terminal.
_PARTIAL = " ▏▎▍▌▋▊▉"
_FULL = "█"


def format_bytes(count: float) -> str:
    """``1536`` → ``"1.5 KiB"``; IEC units, as ``--cache-size 200GiB`` uses."""
    value = float(count)
    for unit in _UNITS:
        if abs(value) < 1024 or unit == _UNITS[-1]:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_rate(bytes_per_s: float | None) -> str:
    if bytes_per_s is None:
        return "-- /s"
    return format_bytes(bytes_per_s) + "/s"


def format_eta(seconds: float | None) -> str:
    """``75`` → ``"1:15"``, ``3725`` → ``"1:02:05"``; ``None`` (unknown) → ``"--:--"``."""
    if seconds is None or math.isnan(seconds) or seconds < 0 or seconds > 99 * 3600:
        return "--:--"
    whole = round(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def render_bar(fraction: float, width: int) -> str:
    """A bar exactly ``width`` characters wide, filled to ``fraction`` in eighths of a cell."""
    width = max(width, 1)
    fraction = min(max(fraction, 0.0), 1.0)
    eighths = int(fraction * width * 8)
    full, part = divmod(eighths, 8)
    bar = _FULL * full
    if full < width:
        bar += _PARTIAL[part] if part else " "
    return bar.ljust(width)[:width]


@dataclass
class Progress:
    """How far one unit of work (one daemon's warm-up, an index run) got."""

    files_done: int = 0
    files_total: int = 0
    bytes_done: int = 0
    bytes_total: int = 0
    failed: int = 0
    rate_bytes_per_s: float | None = None
    eta_s: float | None = None
    state: str = "running"

    @property
    def fraction(self) -> float:
        if self.bytes_total > 0:
            return min(self.bytes_done / self.bytes_total, 1.0)
        if self.files_total > 0:
            return min(self.files_done / self.files_total, 1.0)
        return 1.0 if self.state == "done" else 0.0


@dataclass
class ProgressLine:
    label: str
    progress: Progress


def format_pair(done: float, total: float) -> str:
    """``"1.2/2.7 GiB"`` when both have the same unit, else ``"512.0 KiB/2.7 GiB"``."""
    first, second = format_bytes(done), format_bytes(total)
    unit_a, unit_b = first.split(" ")[1], second.split(" ")[1]
    return f"{first.split(' ')[0]}/{second}" if unit_a == unit_b else f"{first}/{second}"


def _stats(p: Progress) -> str:
    parts = [
        f"{p.fraction * 100:5.1f}%",
        f"{p.files_done}/{p.files_total} files",
        format_pair(p.bytes_done, p.bytes_total),
        format_rate(p.rate_bytes_per_s),
        f"ETA {format_eta(p.eta_s) if p.state == 'running' else '0:00'}",
    ]
    if p.failed:
        parts.append(f"{p.failed} failed")
    if p.state not in ("running", "done"):
        parts.append(p.state)
    return "  ".join(parts)


def render_line(line: ProgressLine, width: int, label_width: int, stats_width: int = 0) -> str:
    """One display line: ``label  [bar]  57.0%  12/27 files  1.2/2.7 GiB  85.3 MiB/s  ETA 0:18``.
    An empty label gives the bar the room; a terminal too narrow for a bar keeps the numbers.
    ``stats_width`` (the longest numbers part of a block) gives every line of a block the same bar."""
    stats = _stats(line.progress)
    head = ""
    if line.label and label_width > 0:
        label = line.label if len(line.label) <= label_width else "…" + line.label[-(label_width - 1):]
        head = f"{label:<{label_width}}  "
    bar_width = width - len(head) - max(len(stats), stats_width) - 4
    if bar_width < 10:
        return f"{head}{stats}"[:width]
    bar = render_bar(line.progress.fraction, min(bar_width, 40))
    return f"{head}[{bar}]  {stats}"[:width]


class Display:
    """Draws a block of progress lines: in place on a terminal, periodically as text elsewhere.

    ``tty=None`` asks the stream. ``interval_s`` is the least time between plain-text lines (a
    terminal is redrawn at most ~10 times a second).
    """

    def __init__(self, stream: IO[str] | None = None, tty: bool | None = None, interval_s: float = 5.0) -> None:
        self.stream = stream if stream is not None else sys.stderr
        if tty is None:
            isatty = getattr(self.stream, "isatty", None)
            tty = bool(isatty and isatty())
        self.tty = tty
        self.interval_s = interval_s
        self._drawn = 0  # lines of the block currently on screen
        # A log gets its first line after one interval (a quick command prints only its result).
        self._last = 0.0 if tty else time.monotonic()
        self._printed = False

    def _width(self) -> int:
        columns = 100
        try:
            columns = os.get_terminal_size(self.stream.fileno()).columns or columns
        except (AttributeError, OSError, ValueError):
            pass
        return max(columns - 1, 40)  # writing the last column wraps on some terminals

    def update(self, lines: list[ProgressLine], force: bool = False) -> None:
        now = time.monotonic()
        if self.tty:
            if not force and now - self._last < 0.1:
                return
            self._last = now
            width = self._width()
            label_width = min(max((len(item.label) for item in lines), default=0), max(width // 4, 10))
            stats_width = max((len(_stats(item.progress)) for item in lines), default=0)
            out = []
            if self._drawn:
                out.append(f"\x1b[{self._drawn}F")  # back to the first line of the block
            for item in lines:
                out.append("\x1b[2K" + render_line(item, width, label_width, stats_width) + "\n")
            self.stream.write("".join(out))
            self.stream.flush()
            self._drawn = len(lines)
            return
        if now - self._last < self.interval_s and not (force and self._printed):
            return  # a forced final line only continues lines already in the log
        self._last = now
        self._printed = True
        for item in lines:
            self.stream.write(f"{item.label}: {_stats(item.progress)}\n")
        self.stream.flush()

    def close(self) -> None:
        """Leave the last drawn block on screen; later output starts below it."""
        self._drawn = 0


class RateMeter:
    """Bytes per second over the last ``window_s`` seconds, from cumulative byte counts."""

    def __init__(self, window_s: float = 5.0) -> None:
        self.window_s = window_s
        self._samples: list[tuple[float, int]] = []
        self.started = time.monotonic()

    def average(self, total: int) -> float | None:
        elapsed = time.monotonic() - self.started
        return total / elapsed if elapsed > 0 else None

    def update(self, total: int, now: float | None = None) -> float | None:
        now = time.monotonic() if now is None else now
        self._samples.append((now, total))
        while len(self._samples) > 2 and now - self._samples[0][0] > self.window_s:
            self._samples.pop(0)
        then, before = self._samples[0]
        if now - then < 0.05:
            return None
        return (total - before) / (now - then)
