"""The progress display without a CLI around it. These tests pin what rich's ``Live`` and tqdm's
bars do differently (see sidecar/cli/progress.py): one ``ESC[nF`` per redrawn frame, IEC sizes,
labels that keep their end, and plain lines in a log."""

from __future__ import annotations

import io

from sidecar.cli.progress import Display, Progress, ProgressLine, format_bytes, format_pair, format_rate, render_line


def _lines(done: int) -> list[ProgressLine]:
    first = Progress(done, 4, done * 1024, 4096, 0, 2048.0, 1.0)
    second = Progress(done, 4, done * 1024, 4096, 0, None, None)
    return [ProgressLine("a", first), ProgressLine("b", second), ProgressLine("total", Progress(done * 2, 8))]


def test_a_terminal_gets_the_block_redrawn_in_place() -> None:
    out = io.StringIO()
    display = Display(out, tty=True)
    display.update(_lines(1), force=True)
    display.update(_lines(2), force=True)
    display.close()
    display.update(_lines(3), force=True)  # after close: a new block below the old one
    frames = out.getvalue().split("\x1b[3F")
    assert len(frames) == 2 and "\x1b[A" not in out.getvalue() and "\r" not in out.getvalue()
    assert frames[0].count("\x1b[2K") == 3 and frames[1].count("\x1b[2K") == 6
    assert all(line.startswith("\x1b[2K") for line in frames[1].splitlines())


def test_a_log_gets_plain_lines_and_no_escapes() -> None:
    out = io.StringIO()
    display = Display(out, tty=False, interval_s=0.0)
    display.update(_lines(2))
    text = out.getvalue()
    assert "\x1b" not in text
    assert text.splitlines()[0] == " 50.0%  2/4 files  2.0/4.0 KiB  2.0 KiB/s  ETA 0:01".join(["a: ", ""])
    assert text.splitlines()[1].endswith("-- /s  ETA --:--")


def test_a_quick_command_in_a_log_prints_no_progress() -> None:
    out = io.StringIO()
    display = Display(out, tty=False, interval_s=60.0)
    display.update(_lines(1))
    display.update(_lines(4), force=True)  # the final line only continues lines already printed
    assert out.getvalue() == ""


def test_sizes_are_iec_and_labels_keep_their_end() -> None:
    assert [format_bytes(n) for n in (0, 1023, 1536, 3 * 1024**3)] == ["0 B", "1023 B", "1.5 KiB", "3.0 GiB"]
    assert format_rate(89_443_532.8) == "85.3 MiB/s" and format_rate(None) == "-- /s"
    assert format_pair(512 * 1024, 2.7 * 1024**3) == "512.0 KiB/2.7 GiB"
    line = render_line(ProgressLine("unix:///run/shardcache/node-b.sock", Progress(1, 2)), 100, 12)
    assert line.startswith("…node-b.sock  [")  # 12 wide: "…" and the last 11
