"""Fixtures of the benchmark tests: ``summary`` puts a text in pytest's terminal summary, where
CI's log shows it (the smoke test's table: CI runs the benchmark suite once, inside the tests)."""

from __future__ import annotations

from tests.support.summary import summary

__all__ = ["summary"]
