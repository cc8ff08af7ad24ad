"""wire.retry: the delays' bounds, growth, cap and count, and the sync and async helpers."""

from __future__ import annotations

import asyncio
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from wire.retry import Backoff, retry_async, retry_sync


@given(
    initial=st.floats(0, 10, allow_nan=False),
    cap=st.floats(0, 60, allow_nan=False),
    retry=st.integers(1, 5000),
    seed=st.integers(0, 2**32),
)
def test_every_delay_lies_between_zero_and_its_capped_bound(initial: float, cap: float, retry: int, seed: int) -> None:
    backoff = Backoff(initial, cap)
    bound = backoff.bound(retry)
    assert bound == min(cap, initial * 2.0 ** min(retry - 1, 1000))
    assert 0.0 <= backoff.delay(retry, random.Random(seed)) <= bound <= cap


def test_the_bound_doubles_from_the_first_delay_up_to_the_cap() -> None:
    backoff = Backoff(0.1, 1.0)
    assert [backoff.bound(n) for n in range(1, 7)] == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0])


def test_a_long_running_loop_does_not_overflow() -> None:
    assert Backoff(0.05, 2.0).bound(10**9) == 2.0


def test_attempts_count_the_first_one_so_there_is_one_delay_fewer() -> None:
    assert len(list(Backoff(0.01, 0.1, attempts=5).delays())) == 4
    assert list(Backoff(0.01, 0.1, attempts=1).delays()) == []


def test_unbounded_attempts_give_endless_delays() -> None:
    delays = Backoff(0.0, 0.0).delays()
    assert [next(delays) for _ in range(1000)] == [0.0] * 1000


def test_the_jitter_is_full_jitter() -> None:
    """Uniform in [0, bound]: the mean is half the bound, and short delays occur."""
    rng = random.Random(7)
    draws = [Backoff(1.0, 1.0).delay(1, rng) for _ in range(20_000)]
    assert sum(draws) / len(draws) == pytest.approx(0.5, abs=0.02)
    assert min(draws) < 0.01 and max(draws) > 0.99


def test_delays_grow_on_average() -> None:
    rng = random.Random(3)
    backoff = Backoff(0.1, 100.0, attempts=8)
    runs = [list(backoff.delays(rng)) for _ in range(2000)]
    means = [sum(run[i] for run in runs) / len(runs) for i in range(7)]
    assert means == sorted(means)
    assert means[-1] == pytest.approx(0.1 * 2**6 / 2, rel=0.1)


@pytest.mark.parametrize(
    ("initial", "cap", "attempts"),
    [(-0.1, 1.0, None), (0.1, -1.0, None), (float("nan"), 1.0, None), (0.1, 1.0, 0)],
)
def test_nonsense_settings_are_refused(initial: float, cap: float, attempts: int | None) -> None:
    with pytest.raises(ValueError):
        Backoff(initial, cap, attempts)


def test_retries_are_numbered_from_one() -> None:
    with pytest.raises(ValueError):
        Backoff(0.1, 1.0).bound(0)


class _Flaky:
    def __init__(self, failures: int, exc: type[Exception] = ConnectionError) -> None:
        self.failures = failures
        self.exc = exc
        self.calls = 0

    def __call__(self) -> str:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.exc(f"failure {self.calls}")
        return "done"


def test_retry_sync_retries_until_it_succeeds() -> None:
    call = _Flaky(3)
    slept: list[float] = []
    seen: list[tuple[str, float]] = []
    result = retry_sync(
        call, Backoff(0.1, 1.0, attempts=4), lambda exc: isinstance(exc, ConnectionError),
        on_retry=lambda exc, delay: seen.append((str(exc), delay)), sleep=slept.append,
    )
    assert result == "done" and call.calls == 4
    assert [message for message, _ in seen] == ["failure 1", "failure 2", "failure 3"]
    assert slept == [delay for _, delay in seen]
    assert all(0 <= d <= b for d, b in zip(slept, (0.1, 0.2, 0.4), strict=True))


def test_retry_sync_raises_the_last_error_once_the_attempts_are_spent() -> None:
    call, slept = _Flaky(10), list[float]()
    with pytest.raises(ConnectionError, match="failure 3"):
        retry_sync(call, Backoff(0.1, 1.0, attempts=3), lambda exc: True, sleep=slept.append)
    assert call.calls == 3 and len(slept) == 2


def test_retry_sync_does_not_retry_what_is_not_retryable() -> None:
    call, slept = _Flaky(1, KeyError), list[float]()
    with pytest.raises(KeyError):
        retry_sync(call, Backoff(0.1, 1.0, attempts=5), lambda exc: isinstance(exc, ConnectionError), sleep=slept.append)
    assert call.calls == 1 and slept == []


def test_retry_async_retries_a_coroutine_function() -> None:
    flaky = _Flaky(2)

    async def call() -> str:
        return flaky()

    assert asyncio.run(retry_async(call, Backoff(0.001, 0.002, attempts=3), lambda exc: True)) == "done"
    assert flaky.calls == 3

    flaky = _Flaky(5)
    with pytest.raises(ConnectionError, match="failure 3"):
        asyncio.run(retry_async(call, Backoff(0.001, 0.002, attempts=3), lambda exc: True))


def test_retry_async_lets_cancellation_through() -> None:
    calls = 0

    async def call() -> None:
        nonlocal calls
        calls += 1
        raise asyncio.CancelledError

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(retry_async(call, Backoff(0.001, 0.002, attempts=5), lambda exc: True))
    assert calls == 1
