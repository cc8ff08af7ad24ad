"""Fixtures of the benchmark tests: ``summary`` puts a text in pytest's terminal summary, where
CI's log shows it (the smoke test's table: CI runs the benchmark suite once, inside the tests)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

__all__ = ["summary"]

_SUMMARY = pytest.StashKey[list[tuple[str, str]]]()


@pytest.fixture
def summary(request: pytest.FixtureRequest) -> Callable[[str, str], None]:
    """``summary(title, text)``: show ``text`` under ``title`` at the end of the run."""

    def show(title: str, text: str) -> None:
        request.config.stash.setdefault(_SUMMARY, []).append((title, text))

    return show


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, exitstatus: int, config: pytest.Config) -> None:
    for title, text in config.stash.get(_SUMMARY, []):
        terminalreporter.write_sep("=", title)
        terminalreporter.write_line(text.rstrip("\n"))
