"""Waiting on a condition instead of sleeping a fixed time: a test waits exactly as long as the
thing takes, and a failure says what never happened."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable

from bench.common import http_ok
from bench.common import wait_until as _wait_until

__all__ = ["http_ok", "inside", "wait_until"]


def wait_until(predicate: Callable[[], bool], timeout: float = 20.0, interval: float = 0.05, what: str = "condition") -> None:
    """Poll ``predicate`` until it is true (an exception counts as not yet); ``TimeoutError``
    naming ``what`` after ``timeout`` seconds."""
    _wait_until(predicate, timeout, what, interval)



def inside(thread: threading.Thread, function: str) -> bool:
    """Whether ``thread`` is running a Python function named ``function`` (anywhere in its stack):
    a test's way to know another thread reached a blocking call (``readinto``) before it acts."""
    frame = sys._current_frames().get(thread.ident or -1)
    while frame is not None:
        if frame.f_code.co_name == function:
            return True
        frame = frame.f_back
    return False
