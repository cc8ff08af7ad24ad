"""A create-job body parsed as it arrives, straight into a spec's columns.

Decoding a 1,000,000-shard body (~70 MB of JSON) with ``json.loads`` makes a million dicts,
~600 MB; this parser feeds the body's chunks to yajl (ijson's C backend) and keeps only what
the spec keeps (:class:`~loader.master.server.spec.TableBuilder`), so parsing costs the columns
plus ~64 bytes a shard for finding duplicate keys, and ~2 s of CPU on a worker thread.

Two more things bound what concurrent creates cost, since every trainer of a job sends the
same spec when it starts:

- *joining*: when the spec names a job that exists (``existing(name)`` gives its shard list) and
  its ``name`` precedes its ``shards`` (as every client sends it), the shards are compared with
  the job's as they stream by, nothing kept: a join costs no memory, whatever its size;
- *the build gate*: before building a shard list the parser pauses (``needs_gate``); the caller
  takes its one-at-a-time gate, then :meth:`SpecStream.resume`, which looks the job up again: a
  creation that held the gate meanwhile may have made it, and the rest is then a join.

Every problem is a :class:`~loader.master.errors.BadRequest` with the message
:meth:`JobSpec.from_json <loader.master.server.spec.JobSpec.from_json>` gives for the same
input, raised by :meth:`SpecStream.finish` in the same order (the whole body is read first, so
a syntax error anywhere wins, as with ``json.loads``). Differences: a field given twice is
refused (``json.loads`` kept the last); numbers beyond 64 bits are refused as out of range (yajl
stops there; no valid spec holds one) naming the field; ``NaN``/``Infinity`` are not JSON.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, Callable, Generator
from typing import Any

import ijson  # type: ignore[import-untyped]
from ijson.common import JSONError, ObjectBuilder  # type: ignore[import-untyped]

from loader.master.errors import BadRequest, MasterUnavailable
from loader.master.server.spec import (
    MAX_INT,
    MAX_KEY,
    SPEC_FIELDS,
    JobSpec,
    ShardTable,
    TableBuilder,
    check_head,
    check_opt_int,
    check_tail,
    duplicate_key_error,
    shard_key_error,
    shard_shape_error,
    shards_type_error,
    too_many_shards_error,
    unknown_fields_error,
)

__all__ = ["SpecStream", "read_spec"]

Event = tuple[str, Any]
Consumer = Generator[None, Any, Any]

_STARTS = ("start_map", "start_array")
_ENDS = ("end_map", "end_array")
# A field other than `shards` holding a container is an error: keep at most this many of its
# events, for the message (an attacker's 200 MB nested array must not become Python objects).
_MAX_VALUE_EVENTS = 256
_RESUME = object()
# ijson's fastest backend: yajl2_c where its wheels exist (everywhere CI runs); its pure Python
# one elsewhere (the same events, ~10x slower).
_BACKEND = ijson.get_backend(ijson.backend)


class _Large:
    """Stands in messages for a number yajl could not read (beyond 64 bits)."""

    def __init__(self, what: str) -> None:
        self.what = what

    def __str__(self) -> str:
        return self.what


class SpecStream:
    """Feed a create body's chunks (:meth:`feed`, on a worker thread), :meth:`resume` whenever
    :attr:`needs_gate` turns true, then :meth:`finish` for the :class:`JobSpec`."""

    def __init__(
        self,
        *,
        default_ttl_s: float = 30.0,
        default_max_failures: int = 3,
        max_shards: int = 1_000_000,
        existing: Callable[[str], ShardTable | None] = lambda name: None,
    ) -> None:
        self.needs_gate = False
        """Paused before building a shard list: take the build gate, then :meth:`resume`."""
        self.building = False
        """The shard list is being built (a new job, or a spec that differs from the job's):
        hold the gate until :meth:`finish` returns."""
        self._defaults = (default_ttl_s, default_max_failures)
        self._max_shards = max_shards
        self._existing = existing
        self._bytes = 0
        self._not_object = False
        self._fields: dict[str, Any] = {}
        self._seen: set[str] = set()
        self._twice: list[str] = []
        self._unknown: set[str] = set()
        self._where = ""
        self._in_shards = False
        self._at = 0
        self._shards_bad = True  # until a non-empty list arrives
        self._count = 0
        self._shard_error: BadRequest | None = None
        self._builder: TableBuilder | None = None
        self._joined: ShardTable | None = None
        self._resumed = True
        self._pending: list[Any] = []
        self._consumer = self._document()
        next(self._consumer)
        self._parser: Any = _BACKEND.basic_parse_basecoro(self._consumer, use_float=True)

    # -- driving --

    def feed(self, chunk: bytes) -> None:
        if not chunk:
            return
        self._bytes += len(chunk)
        try:
            self._parser.send(chunk)
        except JSONError as exc:
            raise self._json_error(exc) from None

    def resume(self) -> None:
        """Go on after a pause (the caller holds the build gate, or needs none: a small body)."""
        if not self.needs_gate:
            return
        self.needs_gate = False
        self._resumed = True
        pending, self._pending = self._pending, []
        self._consumer.send(_RESUME)
        for event in pending:
            self._consumer.send(event)

    def close(self) -> None:
        """Drop the parser and whatever it holds. Needed: yajl's C coroutine holds the consumer,
        whose frame holds this object, a cycle the collector cannot see through."""
        self._parser = None
        self._consumer.close()
        self._builder = None
        self._pending = []

    def finish(self) -> JobSpec:
        """The validated spec, once the whole body was fed; its JSON text made when the shard
        list was built (a join's is never needed: joining changes nothing)."""
        if self._bytes == 0:
            raise BadRequest("request body is empty: send a JSON object")
        try:
            self._parser.send(b"")  # end of input
        except StopIteration:
            pass
        except JSONError as exc:
            raise self._json_error(exc) from None
        self.resume()  # a pause at the very end (the body was cut short) has nothing left to gate
        if self._not_object:
            raise BadRequest("request body must be a JSON object")
        if self._twice:
            raise BadRequest(f"job spec field(s) {sorted(set(self._twice))} given twice: send each field once")
        if self._unknown:
            raise unknown_fields_error(self._unknown)
        name, dataset = check_head(self._fields)
        if self._shards_bad or self._count == 0:
            raise shards_type_error()
        if self._count > self._max_shards:
            raise too_many_shards_error(self._count, self._max_shards)
        if self._shard_error is not None:
            raise self._shard_error
        if self._joined is not None:
            table = self._joined
        else:
            assert self._builder is not None
            dup = self._builder.first_duplicate()
            if dup is not None:
                raise duplicate_key_error(*dup)
            table = self._builder.build()
            self._builder = None
        ttl, failures = self._defaults
        spec = check_tail(name, dataset, self._fields, table, default_ttl_s=ttl, default_max_failures=failures)
        if self._joined is None:
            spec.encode()
        return spec

    # -- the consumer of parse events --

    def _document(self) -> Consumer:
        # One flat generator for the whole document: ~8 events a shard, a million shards, and
        # each level of ``yield from`` costs every event a frame switch. Rare shapes (nested
        # values, pauses) go to sub-generators.
        ev, _ = yield
        if ev != "start_map":
            self._not_object = True
            while True:  # yajl still reads the rest: a syntax error there is the answer
                yield
        while True:
            ev, field = yield
            if ev == "end_map":
                break
            self._where = field
            twice = field in self._seen
            if twice:
                self._twice.append(field)
            self._seen.add(field)
            ev, value = yield
            if field != "shards" or twice:
                if field in SPEC_FIELDS:
                    self._fields[field] = yield from self._value(ev, value)
                else:
                    self._unknown.add(field)
                    yield from self._value(ev, value)
                continue
            if ev != "start_array":
                yield from self._value(ev, value)
                continue
            # -- the shard list --
            self._shards_bad = False
            self._in_shards = True
            job = self._lookup()
            if job is None:
                yield from self._pause()
                job = self._lookup()  # whoever held the gate may have created it meanwhile
            if job is None:
                self._start_build(None, 0)
                job_n = 0
            else:
                job_n, job_sizes, job_samples = len(job), job._sizes, job._samples
            max_shards = self._max_shards
            builder = self._builder
            i = 0
            while True:
                ev, value = yield
                if ev == "end_array":
                    break
                self._at = i
                key: Any = None
                size: Any = None
                samples: Any = None
                shaped = True
                if ev == "string":
                    key = value
                elif ev == "start_map":
                    while True:
                        ev, name = yield
                        if ev == "end_map":
                            break
                        ev, value = yield
                        if ev in _STARTS:
                            value = yield from self._value(ev, value)
                        if name == "key":
                            key = value
                        elif name == "size":
                            size = value
                        elif name == "samples":
                            samples = value
                        else:
                            shaped = False
                else:
                    shaped = False
                    if ev == "start_array":
                        yield from self._value(ev, value)
                if job is not None:
                    if (
                        i < job_n and shaped and type(key) is str and key == job.key(i)
                        and (job_sizes[i] < 0 and size is None or type(size) is int and size == job_sizes[i] >= 0)
                        and (job_samples[i] < 0 and samples is None or type(samples) is int and samples == job_samples[i] >= 0)
                    ):
                        i += 1
                        continue
                    # This spec differs from the job's from here on: build its list (under the
                    # gate), from the part that matched, to validate it and name what differs.
                    yield from self._pause()
                    self._start_build(job, i)
                    builder = self._builder
                    job = None
                i += 1
                if builder is None or i > max_shards:
                    continue  # an error already, or too many: only counted from here on
                if not shaped:
                    self._fail(builder, i - 1, shard_shape_error(i - 1))
                    builder = None
                elif type(key) is not str or not key or len(key) > MAX_KEY or "\x00" in key:
                    self._fail(builder, i - 1, shard_key_error(i - 1))
                    builder = None
                elif (size is None or type(size) is int and size >= 0) and (
                    samples is None or type(samples) is int and samples >= 0
                ):
                    builder.keys.append(key)
                    builder.sizes.append(-1 if size is None else size)
                    builder.samples.append(-1 if samples is None else samples)
                    if len(builder.keys) >= TableBuilder.BLOCK and builder.flush() is not None:
                        self._fail(builder, i - 1, None)
                        builder = None
                else:
                    builder.add(key, None, None)  # a repeat of an earlier key is the first error
                    try:
                        check_opt_int(size, f"shards[{i - 1}].size")
                        check_opt_int(samples, f"shards[{i - 1}].samples")
                    except BadRequest as exc:
                        self._fail(builder, i - 1, exc)
                    builder = None
            if job is not None and i != job_n:
                # Fewer shards than the job's, all matching: the spec differs (a shorter list).
                yield from self._pause()
                self._start_build(job, i)
                job = None
            self._joined = job
            self._count = i
            self._in_shards = False
        while True:  # nothing may follow the object (yajl refuses it)
            yield

    def _value(self, ev: str, value: Any) -> Consumer:
        """A field's value; a container is rebuilt only while small (it is an error anyway)."""
        if ev not in _STARTS:
            return value
        builder = ObjectBuilder()
        builder.event(ev, value)
        depth, events = 1, 1
        while depth:
            ev, value = yield
            events += 1
            if events <= _MAX_VALUE_EVENTS:
                builder.event(ev, value)
            if ev in _STARTS:
                depth += 1
            elif ev in _ENDS:
                depth -= 1
        # Cut short, it still begins as the whole would: messages quote a value's first characters.
        return builder.value

    def _pause(self) -> Consumer:
        """Hold every event until :meth:`resume` (the caller takes the build gate meanwhile)."""
        self.needs_gate = True
        self._resumed = False
        while not self._resumed:
            event = yield
            if event is not _RESUME:
                self._pending.append(event)

    def _lookup(self) -> ShardTable | None:
        name = self._fields.get("name")
        return self._existing(name) if isinstance(name, str) else None

    def _start_build(self, job: ShardTable | None, matched: int) -> None:
        self.building = True
        self._builder = TableBuilder(dedupe=True)
        if job is not None:
            self._builder.extend_from(job, matched)

    def _fail(self, builder: TableBuilder, i: int, exc: BadRequest | None) -> None:
        """Shard ``i`` is bad (``exc``), or a key repeated (``None``): keep the first error (a
        repeat before ``i`` is), and nothing more (the answer is this error)."""
        dup = builder.first_duplicate()
        if dup is not None and (exc is None or dup[0] <= i):
            exc = duplicate_key_error(*dup)
        assert exc is not None
        self._shard_error = exc
        self._builder = None

    # -- messages --

    def _json_error(self, exc: JSONError) -> BadRequest:
        text = exc.args[0] if exc.args else ""
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        first = str(text).strip().splitlines()[0] if str(text).strip() else "incomplete JSON"
        if "overflow" in first:
            # Events held by a pause are behind the error: take them in (at most one chunk's)
            # so that the location below is where yajl stopped.
            self.resume()
            return self._out_of_range()
        if "invalid bytes in UTF8" in first:
            return BadRequest("request body is not JSON: it is not UTF-8")
        return BadRequest(f"request body is not JSON: {first[:200]}")

    def _out_of_range(self) -> BadRequest:
        """yajl stopped at a number beyond 64 bits: name the field it was in."""
        if self._in_shards:
            return BadRequest(
                f"shards[{self._at}]: a number is out of range: 'size' and 'samples' are integers in [0, {MAX_INT}]"
            )
        where = self._where
        if where not in SPEC_FIELDS:
            return unknown_fields_error(self._unknown | {where})
        if where == "shards":
            return shards_type_error()
        raw = dict(self._fields)
        raw[where] = _Large("a number out of range")
        try:
            name, dataset = check_head(raw)
            ttl, failures = self._defaults
            check_tail(name, dataset, raw, ShardTable.of(()), default_ttl_s=ttl, default_max_failures=failures)
        except BadRequest as exc:
            return exc
        return BadRequest(f"'{where}' holds a number out of range")


async def read_spec(
    chunks: AsyncIterable[bytes], parser: SpecStream, gate: asyncio.Semaphore, *, inline: bool, gated: bool,
    gate_wait_s: float = 30.0,
) -> JobSpec:
    """Feed a body's ``chunks`` to ``parser`` as they arrive and return the spec.

    ``inline``: the body is small (parse on the event loop; a thread hop costs more).
    ``gated``: it may be large: build a shard list only while holding ``gate`` (one at a time:
    every trainer of a new job sends its spec at once, and a million-shard list costs ~130 MB
    while built); a join releases it at once. Waiting for the gate longer than ``gate_wait_s``
    is :class:`~loader.master.errors.MasterUnavailable` (a 503 clients retry).
    """

    loop = asyncio.get_running_loop()
    in_flight: asyncio.Future[Any] | None = None

    async def run(fn: Callable[..., Any], *args: Any) -> Any:
        nonlocal in_flight
        if inline:
            return fn(*args)
        in_flight = loop.run_in_executor(None, fn, *args)
        return await in_flight

    held = False
    try:
        async for chunk in chunks:
            await run(parser.feed, chunk)
            if parser.needs_gate:
                if gated and not held:
                    try:
                        await asyncio.wait_for(gate.acquire(), gate_wait_s)
                    except TimeoutError:
                        raise MasterUnavailable(
                            f"the master has been busy building another large job spec for {gate_wait_s:g}s; retry shortly"
                        ) from None
                    held = True
                await run(parser.resume)
                if held and not parser.building:
                    gate.release()  # a join: the gate is for building lists only
                    held = False
        spec: JobSpec = await run(parser.finish)
        return spec
    finally:
        if in_flight is not None and not in_flight.done():
            # Cancelled while a thread still feeds the parser: close it when the thread is done.
            in_flight.add_done_callback(lambda _: parser.close())
        else:
            parser.close()
        if held:
            gate.release()
