"""JSON from the network, decoded: one rule for what a decoding failure is.

``json.loads`` raises ``RecursionError``, not ``ValueError``, for text nested deeper than the
interpreter's recursion limit (a few kilobytes of ``[``): a parser that catches only
``ValueError`` lets hostile input crash its handler or its task. :func:`loads` makes every
undecodable text a ``ValueError``.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["loads"]


def loads(data: str | bytes | bytearray) -> Any:
    """``json.loads(data)``; ValueError for text that is not JSON, not UTF-8, or nested too deeply."""
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
