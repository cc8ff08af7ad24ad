"""The nonces of the peer requests a member took: a signed request is good once.

A request's timestamp is accepted while it is within ``max_skew_s`` of this daemon's clock, so
its nonce must be remembered until then (``t + max_skew_s``) and can be forgotten after: the
clock check refuses it from there on. The memory is bounded (``max_entries``; about 180 bytes
each, 18 MB for the default 100,000): when full, the nonce taken first is forgotten early and
every request stamped at or before its second is refused from then on (:attr:`Nonces.floor`), so
a forgotten nonce can never be replayed. A member that takes more than ``max_entries`` requests
within the window thus refuses only requests stamped earlier than the last ``max_entries`` it
took, which at 100,000 is more than a second of 100,000 requests a second; a refused asker reads
the origin instead (:mod:`.origin`). Loop-only: checked where requests are (:mod:`.http`).
"""

from __future__ import annotations

from collections import OrderedDict

from sidecar.errors import SidecarError

__all__ = ["Nonces", "Replayed"]


class Replayed(SidecarError, PermissionError):
    """A nonce seen before, or one stamped before what the cache still reaches back to."""


class Nonces:
    def __init__(self, max_entries: int, window_s: float) -> None:
        if max_entries < 1:
            raise ValueError("the replay cache needs room for at least one nonce")
        self.max_entries = max_entries
        self.window_s = window_s
        self._seen: OrderedDict[str, int] = OrderedDict()  # nonce -> its request's timestamp, in arrival order
        self.floor = -1
        """Requests stamped at or before this second are refused: nonces of that age were forgotten early."""
        self.replays = 0
        self.forgotten_early = 0

    def __len__(self) -> int:
        return len(self._seen)

    def admit(self, member: str, nonce: str, t: int, now: float) -> None:
        """Remember ``nonce`` (of a request stamped ``t`` by ``member``, already checked against
        the clock), or :class:`Replayed`."""
        self._expire(now)
        if nonce in self._seen:
            self.replays += 1
            raise Replayed(f"{member}: replayed peer request (its nonce was used {max(0, int(now) - self._seen[nonce])} s ago)")
        if t <= self.floor:
            raise Replayed(f"{member}: peer request stamped {int(now) - t} s ago, before what this daemon's replay cache "
                           f"still reaches back to ({self.max_entries} requests): check the members' clocks")
        if len(self._seen) >= self.max_entries:
            _, oldest = self._seen.popitem(last=False)
            self.forgotten_early += 1
            self.floor = max(self.floor, oldest)
            if t <= self.floor:
                raise Replayed(f"{member}: peer request stamped {int(now) - t} s ago, before what this daemon's replay "
                               f"cache still reaches back to ({self.max_entries} requests): check the members' clocks")
        self._seen[nonce] = t

    def _expire(self, now: float) -> None:
        # In arrival order, which is nearly timestamp order (members' clocks agree within the
        # skew): one ahead of the others only keeps those behind it a little longer, within the bound.
        seen = self._seen
        while seen:
            nonce = next(iter(seen))
            if seen[nonce] + self.window_s >= now:
                return
            del seen[nonce]
