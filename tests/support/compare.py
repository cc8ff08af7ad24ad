"""Field-by-field comparison of what a client reported from the origin and from the cache."""

from __future__ import annotations

from typing import Any

__all__ = ["SHOWN", "assert_same", "differences", "report", "scrub"]

SHOWN = 40  # differences listed in a failure message; the rest are counted


def differences(direct: Any, cached: Any, path: str = "") -> list[str]:
    """One line per field where the cache's answer differs from the origin's: ``path: origin=... cache=...``."""
    if isinstance(direct, dict) and isinstance(cached, dict):
        out = []
        for name in sorted(set(direct) | set(cached), key=str):
            here = f"{path}.{name}" if path else str(name)
            if name not in cached:
                out.append(f"{here}: origin={direct[name]!r} cache=<absent>")
            elif name not in direct:
                out.append(f"{here}: origin=<absent> cache={cached[name]!r}")
            else:
                out += differences(direct[name], cached[name], here)
        return out
    if isinstance(direct, list) and isinstance(cached, list):
        out = [line for i, (a, b) in enumerate(zip(direct, cached, strict=False)) for line in differences(a, b, f"{path}[{i}]")]
        if len(direct) != len(cached):
            out.append(f"{path}: origin has {len(direct)} items, cache {len(cached)}")
        return out
    return [] if direct == cached else [f"{path}: origin={direct!r} cache={cached!r}"]


def report(diffs: list[str]) -> str:
    more = f"\n... and {len(diffs) - SHOWN} more" if len(diffs) > SHOWN else ""
    return f"{len(diffs)} differences from the origin:\n" + "\n".join(diffs[:SHOWN]) + more


def assert_same(direct: Any, cached: Any) -> None:
    diffs = differences(direct, cached)
    assert not diffs, report(diffs)


def scrub(text: str, *urls: str) -> str:
    """A client's message with the endpoint it talked to taken out (the one thing that must differ)."""
    for url in urls:
        text = text.replace(url, "<endpoint>").replace(url.split("://", 1)[-1], "<endpoint>")
    return text
