"""Texts a test puts in pytest's terminal summary (the benchmark smoke test's table, for CI's log).

A test adds ``(SUMMARY_PROPERTY, [title, text])`` to its user properties (the :func:`summary`
fixture; ``tests/bench/conftest.py`` offers it); the report carries them, from a pytest-xdist worker too, to the process
that prints the summary, where :class:`Summaries` keeps and prints them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

__all__ = ["SUMMARY_PROPERTY", "Summaries", "register", "summary"]

SUMMARY_PROPERTY = "shardcache_summary"


class Summaries:
    """The plugin (registered by tests/conftest.py) that keeps the texts of every test's call
    report, as the reports reach this process, and prints them at the end."""

    def __init__(self) -> None:
        self._texts: list[tuple[str, str]] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when != "call":
            return
        for name, value in report.user_properties:
            if name == SUMMARY_PROPERTY and isinstance(value, (list, tuple)) and len(value) == 2:
                self._texts.append((str(value[0]), str(value[1])))

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        for title, text in self._texts:
            terminalreporter.write_sep("=", title)
            terminalreporter.write_line(text.rstrip("\n"))


def register(config: pytest.Config) -> None:
    """Print the texts at the end of this run (a conftest's ``pytest_configure``)."""
    config.pluginmanager.register(Summaries(), "shardcache-summaries")


@pytest.fixture
def summary(request: pytest.FixtureRequest) -> Callable[[str, str], None]:
    """``summary(title, text)``: show ``text`` under ``title`` at the end of the run. It travels
    on the test's report (its user properties), so that pytest-xdist's workers' texts reach the
    controller, which prints the summary."""

    def show(title: str, text: str) -> None:
        request.node.user_properties.append((SUMMARY_PROPERTY, [title, text]))

    return show
