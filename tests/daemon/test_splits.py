"""When a fill is split into parallel ranged GETs: the judge that learns it from whole fills
(sidecar.daemon.splits), and the origin-stream budget fills share (Fetcher.grant_streams)."""

from __future__ import annotations

import threading

from sidecar.daemon.fills import Fetcher, FetchSettings
from sidecar.daemon.metrics import Metrics
from sidecar.daemon.splits import SplitJudge

MB = 1e6
THRESHOLD = 200 * MB
SIZE = 64 * 2**20


def seconds_at(rate: float) -> float:
    return SIZE / rate


def test_a_slow_start_splits_while_nothing_is_known():
    judge = SplitJudge(THRESHOLD)
    assert judge.should_split(50 * MB)
    assert not judge.should_split(300 * MB)


def test_a_slow_start_on_an_origin_whose_single_streams_are_fast_is_noise():
    """moto behind the suite's proxy: whole fills on one stream reach 300-1,200 MB/s, while the
    first MiBs of one now and then look slow."""
    judge = SplitJudge(THRESHOLD)
    judge.record(False, SIZE, seconds_at(600 * MB))
    assert not judge.should_split(40 * MB)
    # The origin slows down for good: the average falls below the threshold and splits resume.
    for _ in range(6):
        judge.record(False, SIZE, seconds_at(80 * MB))
    assert judge.should_split(40 * MB)


def test_a_capped_origin_keeps_splitting_while_splits_win():
    """S3 over a WAN: every connection is capped at ~90 MB/s; split fills reach the link."""
    judge = SplitJudge(THRESHOLD)
    for _ in range(20):
        assert judge.should_split(85 * MB)
        judge.record(True, SIZE, seconds_at(190 * MB))
    judge.record(False, SIZE, seconds_at(90 * MB))  # a fill that could not get more streams
    assert judge.should_split(85 * MB)


def test_losing_splits_stop_but_are_probed_less_and_less_often():
    judge = SplitJudge(THRESHOLD)
    judge.record(False, SIZE, seconds_at(150 * MB))
    judge.record(True, SIZE, seconds_at(45 * MB))  # a split cost what it was to save
    decisions = []
    for _ in range(8 + 16 + 4):
        split = judge.should_split(100 * MB)
        decisions.append(split)
        if split:  # the probe loses again
            judge.record(True, SIZE, seconds_at(45 * MB))
        else:
            judge.record(False, SIZE, seconds_at(150 * MB))
    probes = [i for i, split in enumerate(decisions) if split]
    assert probes == [7, 23], "one probe after 8 held back, the next after 16 more"
    assert judge.stats().probe_every == 32


def test_a_winning_probe_resumes_splitting():
    judge = SplitJudge(THRESHOLD)
    judge.record(False, SIZE, seconds_at(150 * MB))
    judge.record(True, SIZE, seconds_at(45 * MB))
    for _ in range(7):
        assert not judge.should_split(100 * MB)
    assert judge.should_split(100 * MB)  # the probe
    for _ in range(5):  # the link got congested per connection: splits pay now
        judge.record(True, SIZE, seconds_at(400 * MB))
    assert judge.stats().probe_every == 8
    assert judge.should_split(100 * MB)


def test_the_configured_extremes_are_obeyed():
    always, never = SplitJudge(float("inf")), SplitJudge(0)
    for judge in (always, never):
        judge.record(False, SIZE, seconds_at(900 * MB))
        judge.record(True, SIZE, seconds_at(10 * MB))
    assert always.should_split(899 * MB)
    assert not never.should_split(0.001)


def test_fills_deciding_at_once_never_take_more_streams_than_the_budget():
    """Four fills judged slow at the same moment each took every free stream before (the budget
    was read, not taken), and the origin got 4 x 7 more ranged GETs."""
    fetcher = Fetcher(None, object(), FetchSettings(parts_per_object=8), Metrics())  # type: ignore[arg-type]
    for _ in range(4):
        fetcher.grant_streams(1, force=True)  # four fills' first streams
    granted: list[int] = []
    barrier = threading.Barrier(4)

    def decide() -> None:
        barrier.wait()
        granted.append(fetcher.grant_streams(7))

    threads = [threading.Thread(target=decide) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sum(granted) == 4 and fetcher.streams == 8
    fetcher.release_streams(sum(granted) + 4)
    assert fetcher.streams == 0
