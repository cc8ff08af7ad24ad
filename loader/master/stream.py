"""Dynamic mode: the trainer's side of the lease protocol (``docs/master-api.md``).

:class:`LeaseStream` turns lease answers into a stream of held shards for one epoch (or across
epochs in continuous mode), waiting while others hold the last leases of an epoch and taking over
the ones that expire. :class:`Renewer` is the background thread that keeps every held lease alive
and tells the master how far into each shard this trainer has handed out samples, so that a
killed trainer costs at most the samples since its last renew.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from loader.errors import LoaderError
from loader.master.errors import LeaseLost, MasterError, MasterUnavailable, NoSuchJob, NotLeaseHolder
from loader.master.protocol import LeaseGrant

__all__ = ["Held", "LeaseCalls", "Renewer", "LeaseStream"]

log = logging.getLogger("loader.master.stream")


@dataclass(eq=False)
class Held:
    """A lease this trainer holds. ``position`` is the sample offset handed out so far
    (absolute within the shard); the renewer reports it, the reader advances it."""

    lease: str
    shard: int
    key: str
    epoch: int
    start: int
    ttl_s: float
    position: int = 0
    lost: bool = False
    done: bool = False  # completed or failed: no longer renewed
    deferred: bool = False
    """The samples go to a DataLoader's iterating process, which reports what it received and
    completes the lease (``loader.torch.DataLoader``): this process only keeps the lease alive,
    reporting no progress of its own."""
    read_through: bool = False
    """Every sample was read (deferred mode): the iterating process completes the lease."""
    renewed_at: float = field(default_factory=time.monotonic)  # last time the master confirmed it
    asked_at: float = field(default_factory=time.monotonic)  # last renewal attempt, answered or not
    stamp: tuple[int, int | None] | None = None
    """(position, clock): the loop had received up to ``position`` at the trainer's ``clock``
    (loader/checkpoint.py). One attribute, set at once, so the renewer never pairs a position
    with an older clock."""

    def reach(self, position: int, clock: int | None) -> None:
        self.position = position
        self.stamp = (position, clock)

    def report(self) -> tuple[int, int | None]:
        """The offset this process may report to the master and the clock it was received at:
        what it handed out, or in deferred mode only where the lease started (the iterating
        process reports what it received)."""
        if self.deferred:
            return self.start, None
        if self.stamp is not None:
            return self.stamp
        return self.position, None

    def report_offset(self) -> int:
        return self.report()[0]

    def stale(self) -> bool:
        """True when the master has not confirmed this lease for a whole TTL (e.g. the process was
        paused) and nobody asked it lately: it may have been re-issued, so check before handing
        out more of its samples. (Not on every sample while the master is unreachable.)"""
        now = time.monotonic()
        return now - self.renewed_at > self.ttl_s and now - self.asked_at > self.ttl_s / 3

    @classmethod
    def from_answer(cls, item: dict[str, Any]) -> Held:
        grant = LeaseGrant.from_answer(item)
        return cls(
            lease=grant.lease, shard=grant.shard, key=grant.key, epoch=grant.epoch, start=grant.offset,
            ttl_s=grant.ttl_s, position=grant.offset,
        )


@dataclass(frozen=True)
class LeaseCalls:
    """The one place a trainer makes the calls of a lease it holds (renew, complete, release,
    fail), with what :meth:`Held.report` says: a field the protocol adds to them is added here."""

    client: Any
    job: str
    trainer: str

    def renew(self, held: Held) -> float:
        position, clock = held.report()
        return float(self.client.renew(self.job, held.lease, self.trainer, position, clock))

    def complete(self, held: Held) -> None:
        self.client.complete(self.job, held.lease, self.trainer, held.report()[1])

    def release(self, held: Held) -> str:
        return str(self.client.release(self.job, held.lease, self.trainer, *held.report()))

    def fail(self, held: Held, error: str) -> str:
        return str(self.client.fail(self.job, held.lease, self.trainer, error[:2000]))


class Renewer:
    """Renews held leases every ``ttl * fraction`` seconds from a named daemon thread.

    A lease the master reports lost (expired and re-issued, or held by another trainer) is marked
    ``lost``; the reader stops handing out its samples at the next one.
    """

    def __init__(self, client: Any, job: str, trainer: str, fraction: float) -> None:
        self.calls = LeaseCalls(client, job, trainer)
        self._job = job
        self._fraction = fraction
        self._held: list[Held] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None

    def add(self, held: Held) -> None:
        with self._lock:
            self._held.append(held)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"shardcache-renew-{self._job}", daemon=True)
            self._thread.start()

    def discard(self, held: Held) -> None:
        with self._lock:
            if held in self._held:
                self._held.remove(held)

    def positions(self) -> list[tuple[str, int]]:
        """Each lease held and not closed, at the position its samples reached (a checkpoint's)."""
        with self._lock:
            return [(h.lease, h.report()[0]) for h in self._held if not h.done and not h.lost]

    def awaiting_delivery(self) -> bool:
        """Deferred mode: some lease was read through and its last samples may still sit in a
        batch that is not complete; only ending this stream hands that batch over."""
        with self._lock:
            return any(h.read_through and not h.lost for h in self._held)

    def _interval(self) -> float:
        with self._lock:
            ttls = [h.ttl_s for h in self._held]
        return max(0.05, min(ttls, default=30.0) * self._fraction)

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._wake.wait(self._interval())
                self._wake.clear()
                if self._stopping:
                    return
                self.renew_all()
        except Exception:  # a crashed renewer must be loud: leases would silently expire
            log.exception("lease renewer for job %s crashed; leases will expire and be re-issued", self._job)

    def renew_all(self) -> None:
        with self._lock:
            snapshot = [h for h in self._held if not h.done and not h.lost]
        for held in snapshot:
            self.renew(held)

    def renew(self, held: Held) -> bool:
        """Renew one lease with the offset reached; False when it is lost (or could not be renewed)."""
        position = held.report()[0]
        asked = held.asked_at = time.monotonic()
        try:
            ttl = self.calls.renew(held)
        except (LeaseLost, NotLeaseHolder, NoSuchJob) as exc:
            if held.read_through:
                # The iterating process completed (or gave back) what this process read through.
                log.debug("lease on %s closed by the iterating process", held.key)
                held.lost = True
            elif not held.done and not held.lost:
                held.lost = True
                log.warning(
                    "lease on %s (epoch %d) lost at offset %d: %s; %s",
                    held.key, held.epoch, position, exc,
                    "the job is gone from the master" if isinstance(exc, NoSuchJob) else "another trainer continues it",
                )
            self.discard(held)
            return False
        except MasterError as exc:
            log.warning("renewing the lease on %s failed (%s); retrying", held.key, exc)
            return False
        held.ttl_s = ttl
        held.renewed_at = asked
        log.debug("renewed lease %s shard %s epoch %d offset %d", held.lease, held.key, held.epoch, position)
        return True

    def stop(self, give_back: bool) -> None:
        """Stop the thread. ``give_back`` (the reader stopped before its epoch ended): release every
        held lease at the offset reached, so another trainer continues it right away; a master
        without ``release`` gets the offsets by one last renew instead, so whoever is re-issued
        these leases after they expire resumes exactly where we stopped."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if not give_back:
            return
        with self._lock:
            snapshot = [h for h in self._held if not h.done and not h.lost]
        for held in snapshot:
            outcome = self._release(held)
            if outcome == "unreachable":
                return  # nor would a renew get through (each call retries for master_deadline_s)
            if outcome == "unsupported":
                try:
                    self.renew(held)
                except Exception:  # leaving anyway: the lease expires after its TTL
                    log.debug("final lease renewal failed", exc_info=True)

    def _release(self, held: Held) -> str:
        """``released`` (or nothing left to give back), ``unreachable`` (no master answered: the
        lease expires after its TTL, at the offset last renewed), or ``unsupported`` (a master from
        before ``release``: the caller reports the offset by renewing)."""
        try:
            self.calls.release(held)
        except (LeaseLost, NotLeaseHolder, NoSuchJob):
            held.lost = True  # gone already: nothing to give back
        except MasterUnavailable as exc:
            log.warning("could not release the lease on %s (%s); it expires after its TTL", held.key, exc)
            return "unreachable"
        except MasterError as exc:
            log.info("the master cannot release the lease on %s (%s); reporting its offset instead", held.key, exc)
            return "unsupported"
        else:
            log.info("released the lease on %s (epoch %d) at sample %d", held.key, held.epoch, held.report_offset())
        held.done = True
        self.discard(held)
        return "released"


class LeaseStream:
    """Held leases for one epoch (``epoch`` given) or for the whole job (``epoch=None``).

    Ends when the master answers ``epoch_done`` (``next_epoch`` then says the current epoch) or
    ``finished`` (``finished`` is set).
    """

    def __init__(
        self,
        client: Any,
        job: str,
        trainer: str,
        node: str,
        epoch: int | None,
        ahead: int,
        renewer: Renewer,
        wait_max_s: float,
        on_granted: Callable[[list[Held]], None],
        should_stop: Callable[[], bool],
        yield_to_siblings: Callable[[], bool] | None = None,
        stream: str | None = None,
        deferred: bool = False,
    ) -> None:
        self._client = client
        self._job = job
        self._trainer = trainer
        self._node = node
        self._epoch = epoch
        self._ahead = ahead
        self._renewer = renewer
        self._wait_max = wait_max_s
        self._on_granted = on_granted
        self._should_stop = should_stop
        self._yield_to_siblings = yield_to_siblings
        self._stream = stream
        self._deferred = deferred
        self.queue: deque[Held] = deque()
        self.finished = False
        self.next_epoch: int | None = None

    def __iter__(self) -> Iterator[Held]:
        exhausted = False
        waited_since: float | None = None
        while not self._should_stop():
            want = 1 + self._ahead - len(self.queue)
            if want > 0 and not exhausted:
                # Long-poll only with nothing left to read, and never as one of several DataLoader
                # workers (a worker blocked in a request holds up its siblings' samples).
                wait_s = self._wait_max if not self.queue and self._yield_to_siblings is None else 0.0
                answer = self._client.lease(
                    self._job, self._trainer, self._node, count=want, epoch=self._epoch, wait_s=wait_s,
                    stream=self._stream,
                )
                status = answer.get("status")
                older = answer.get("epoch")
                if status == "wait" and self._epoch is not None and isinstance(older, int) and older < self._epoch:
                    # Our next epoch waits for an older one whose shards others let go (expired,
                    # released) while every trainer moved on: take those first, or nobody will.
                    drain = self._client.lease(
                        self._job, self._trainer, self._node, count=want, epoch=older, stream=self._stream
                    )
                    if drain.get("status") == "ok" and drain.get("leases"):
                        answer, status = drain, "ok"
                if status == "ok" and answer.get("leases"):
                    waited_since = None
                    granted = [Held.from_answer(item) for item in answer["leases"]]
                    for held in granted:
                        held.deferred = self._deferred
                        self._renewer.add(held)
                        self.queue.append(held)
                        log.debug(
                            "leased shard %s epoch %d offset %d lease %s", held.key, held.epoch, held.start, held.lease
                        )
                    ahead = [h for h in self.queue][1:]
                    if ahead:
                        self._on_granted([h for h in ahead if h in granted])
                elif status in ("ok", "wait") or (status == "epoch_done" and self._epoch is None):
                    # Nothing to hand out now: others hold the last leases (one may expire and come
                    # back to us), or, in continuous mode, the next epoch is being opened.
                    if not self.queue:
                        if status == "wait" and self._epoch is None:
                            # Continuous mode waits only at the job's end (every epoch is leased
                            # out). A rank waiting for its peers' last shards would stall them
                            # when they are in a collective with it: it ends instead (the
                            # training loop joins its peers, DDP's Join, until they finish),
                            # unless some lease looks abandoned (its holder stopped renewing: a
                            # dead rank, e.g. before an elastic restart), whose shard comes back
                            # at expiry. It waits long enough for a just-dead holder's leases to
                            # look abandoned: a bounded stall of a live peer, never a deadlock.
                            if waited_since is None:
                                waited_since = time.monotonic()
                            patience = answer.get("stale_after_s")
                            patience = float(patience) if isinstance(patience, (int, float)) else 0.0
                            if not answer.get("stale_leases") and time.monotonic() - waited_since >= patience:
                                log.info("job %s: every shard of its last epoch is leased; this stream ends", self._job)
                                return
                        elif status == "wait" and self._renewer.awaiting_delivery():
                            # Our last samples may sit in a batch still being filled: end the
                            # stream so that it is handed over and its leases can complete.
                            log.debug("job %s: nothing to lease while our last batch is incomplete; stream ends", self._job)
                            return
                        elif status == "wait" and self._yield_to_siblings is not None and self._yield_to_siblings():
                            log.debug("job %s: sibling workers hold the last leases; worker's epoch ends", self._job)
                            return
                        if waited_since is None:
                            waited_since = time.monotonic()
                            log.info("job %s: waiting for other trainers to finish their shards", self._job)
                        if answer.get("waited_s") is not None:
                            continue  # the master already waited for a change: ask again now
                        retry = answer.get("retry_after_s")
                        delay = float(retry) if isinstance(retry, (int, float)) and retry > 0 else 0.5
                        time.sleep(min(delay, self._wait_max))
                        continue
                elif status == "epoch_done":
                    exhausted = True
                    epoch = answer.get("epoch")
                    self.next_epoch = int(epoch) if isinstance(epoch, int) else None
                elif status == "finished":
                    exhausted = True
                    self.finished = True
                else:
                    raise LoaderError(f"the master answered an unknown lease status {status!r}")
            if not self.queue:
                if exhausted:
                    return
                continue
            held = self.queue.popleft()
            if held.lost:
                continue
            yield held
