"""Deferred leases: offsets that mean "received by the training loop".

A DataLoader's workers read the leased shards, but the batches they make wait in the DataLoader's
queues before the training loop takes them; if a worker reported (and completed) what it read, a
rank's death would count its queued batches as trained and skip them on resume. So with
``loader.torch.DataLoader`` the workers only keep their leases alive (:class:`Ledger` records
how far each lease was read when each batch was made, and the batch carries that record), and
the process that iterates the DataLoader, the trainer, renews each lease with the offset its
training loop has received and completes it once the lease's last sample arrived
(:class:`Delivery`). A rank's death then costs at most the samples received since its last
renew, which are trained twice, never skipped.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any

from loader.checkpoint import Clock
from loader.master.errors import LeaseLost, MasterError
from loader.master.stream import Held, Renewer

__all__ = ["Ledger", "Delivery", "Progress"]

log = logging.getLogger("loader.master.delivery")

Progress = dict[str, tuple[str, int, int, int, bool, float]]
"""lease id -> (key, shard, epoch, position reached, read through, ttl_s)."""


class Ledger:
    """In the reading process: each lease's position as the batches are made (one thread: the
    dataset's iterator and the collate function that drains it run on the same one)."""

    def __init__(self) -> None:
        self._changes: Progress = {}

    def note(self, held: Held, finished: bool) -> None:
        self._changes[held.lease] = (held.key, held.shard, held.epoch, held.position, finished, held.ttl_s)

    def drain(self) -> Progress:
        changes, self._changes = self._changes, {}
        return changes

    def __getstate__(self) -> dict[str, Any]:
        return {"_changes": {}}  # a copy in another process starts empty


class Delivery:
    """In the process that iterates: the leases its training loop has received samples of,
    renewed at the offset received and completed (from a thread, off the training loop) once
    their last sample was received. :meth:`close` completes what is due and gives the rest back
    at the offset received."""

    def __init__(self, client: Any, job: str, trainer: str, renew_fraction: float, clock: Clock | None = None) -> None:
        self._client = client
        self._job = job
        self._trainer = trainer
        self._renewer = Renewer(client, job, trainer, renew_fraction)
        self._known: dict[str, Held] = {}
        self._due: queue.Queue[Held | None] = queue.Queue()
        self._closer: threading.Thread | None = None
        self._clock = clock if clock is not None else Clock(laps=False)
        self.completed = 0

    def received(self, progress: Progress, tick: bool = True) -> None:
        """A batch reached the training loop carrying ``progress``; ``tick``: it counts as one
        more item on the clock (False: a dropped partial batch, received at the last one's)."""
        epochs = [item[2] for item in progress.values()]
        clock = self._clock.tick(max(epochs, default=None)) if tick else self._clock.value
        for lease, (key, shard, epoch, position, finished, ttl_s) in progress.items():
            held = self._known.get(lease)
            if held is None:
                held = Held(lease=lease, shard=shard, key=key, epoch=epoch, start=position, ttl_s=ttl_s, position=position)
                self._known[lease] = held
                if not finished:
                    self._renewer.add(held)
            held.reach(max(held.position, position), clock)
            if finished:
                held.done = True
                self._renewer.discard(held)
                del self._known[lease]
                self._complete_later(held)

    def _complete_later(self, held: Held) -> None:
        if self._closer is None:
            self._closer = threading.Thread(target=self._run, name=f"shardcache-complete-{self._job}", daemon=True)
            self._closer.start()
        self._due.put(held)

    def _run(self) -> None:
        while True:
            held = self._due.get()
            try:
                if held is None:
                    return
                self._complete(held)
            finally:
                self._due.task_done()

    def _complete(self, held: Held) -> None:
        try:
            self._renewer.calls.complete(held)
        except LeaseLost as exc:
            log.warning("completion of %s (epoch %d) refused: %s", held.key, held.epoch, exc)
        except MasterError as exc:
            # It expires and is re-issued at the offset last renewed: its tail is read twice.
            log.error("could not complete %s (epoch %d): %s", held.key, held.epoch, exc)
        except Exception:  # a crashed closer would leave every later lease to expire
            log.exception("completing %s failed", held.key)
        else:
            self.completed += 1
            log.debug("completed shard %s epoch %d lease %s", held.key, held.epoch, held.lease)

    def flush(self) -> None:
        """Wait until every completion due so far was sent."""
        if self._closer is not None:
            self._due.join()

    def positions(self) -> list[tuple[str, int]]:
        """For a checkpoint: each lease the loop received samples of and has not finished, at the
        position received (completions due are sent first: :meth:`flush`)."""
        self.flush()
        return [(held.lease, held.position) for held in list(self._known.values())]

    def close(self) -> None:
        """The iteration ended: complete what is due, release the rest at the offset received."""
        self.flush()
        if self._closer is not None:
            self._due.put(None)
            self._closer.join(timeout=30)
            self._closer = None
        self._renewer.stop(give_back=True)
        self._known.clear()
