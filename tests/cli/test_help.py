"""Every operator command explains itself: --help with examples and the env variables it reads."""

from __future__ import annotations

import pytest

from tests.support.cli import run_cli


@pytest.mark.parametrize("command", ["index", "warmup", "status", "demo"])
def test_help_has_examples_and_env_vars(command: str):
    result = run_cli([command, "--help"])
    assert result.returncode == 0, result.stderr
    assert "examples:" in result.stdout
    assert f"shardcache {command}" in result.stdout.split("examples:", 1)[1]
    assert "[env SHARDCACHE_" in result.stdout


def test_top_level_help_lists_the_commands():
    result = run_cli(["--help"])
    assert result.returncode == 0
    for command in ("index", "warmup", "status", "demo"):
        assert command in result.stdout
