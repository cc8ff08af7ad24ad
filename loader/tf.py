"""TensorFlow adapter: :func:`dataset` returns a ``tf.data.Dataset`` reading a ShardLoader.

    import loader.tf
    ds = loader.tf.dataset("s3://bucket/train/", fields=("jpg", "cls"), rank=0, world_size=8, seed=1)
    ds = ds.map(decode).batch(64).prefetch(2)

Each sample becomes a dict of scalar ``tf.string`` tensors (``__key__`` and the named fields),
or, with ``transform``, whatever ``transform(sample)`` returns, described by ``output_signature``.
Iterating the dataset again (``for epoch in ...: for x in ds``) reads the next epoch.

In dynamic mode the offsets reported to the master are the samples the generator handed to
tf.data, which its ``batch``/``prefetch`` buffers may still hold: a trainer's death can skip up
to what those buffers hold (``loader.torch.DataLoader`` closes that gap for PyTorch; tf.data
offers no hook in the iterating process for it).

Checkpoints. ``loader.tf.checkpoint_state(ds)`` is a ``tf.train.Checkpoint`` dependency (a
``tf.train.experimental.PythonState``) that saves the loader's ``state_dict()`` as JSON and
loads it on restore; ``loader.tf.loader_of(ds)`` is the :class:`~loader.ShardLoader` itself::

    ds = loader.tf.dataset(url, fields=("jpg", "cls"), rank=r, world_size=w, seed=1, readahead=False)
    ckpt = tf.train.Checkpoint(model=model, optimizer=opt, data=loader.tf.checkpoint_state(ds))
    ckpt.restore(tf.train.latest_checkpoint(ckpt_dir))  # before iterating ds
    ... ckpt.save(prefix)  # where the model is saved

What it saves is the generator's position: what tf.data has pulled from the loader. Static mode:
the exact next sample; restored, the dataset's next iteration goes on from there, the ones after
it read the next epochs. Dynamic mode: a mark on the master (``ShardLoader.state_dict``); restored
in any trainer, the job hands out exactly what the generators had not handed to tf.data. That is
what the model trained when tf.data holds nothing it pulled but has not delivered:

* a pipeline of plain ``map``/``filter``/``batch`` (no ``prefetch``, ``shuffle``, ``cache``,
  ``num_parallel_calls`` or ``interleave``) over ``dataset(..., readahead=False)``, which turns
  off tf.data's default optimizations for the pipeline (they read ahead: an injected prefetch, a
  parallelised ``map``, ``map`` and ``batch`` fused into one that prefetches): saves anywhere are
  exact, also from a Keras callback's ``on_train_batch_end`` under ``model.fit`` (with
  ``steps_per_execution=1``);
* any pipeline saved after an iteration ran to its end (an epoch end, Keras's ``on_epoch_end``).

Otherwise a resumed job skips what the buffers held at the save (``prefetch(n)``: up to n
elements; ``shuffle(n)``: n samples; the default optimizations: a few elements): buffers make a
resumed job skip samples, never read one twice. tf.data's own iterator checkpoints would save those buffers, but cannot save a
``from_generator`` pipeline. A save waits for a sample the generator is reading at that moment;
a state saved after the epoch's last element but before its iteration ended resumes an empty
rest of that epoch (that iteration ends at once; the next reads the next epoch).
"""

from __future__ import annotations

import json
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import tensorflow as tf

from loader.errors import ConfigError
from loader.shardindex import ShardIndex
from loader.shardloader import ShardLoader

__all__ = ["dataset", "indexed_dataset", "loader_of", "checkpoint_state", "LoaderState"]

_STATE_KIND = "shardcache-tf"
_ATTRIBUTE = "_shardcache_loader"  # on the dataset dataset() returns: its ShardLoader
_GUARDS: weakref.WeakKeyDictionary[ShardLoader, threading.Lock] = weakref.WeakKeyDictionary()
_GUARDS_LOCK = threading.Lock()


def _guard(shard_loader: ShardLoader) -> threading.Lock:
    """The lock that the generator holds while it takes a sample from ``shard_loader``, and a
    checkpoint while it reads (or sets) its position: tf.data runs the generator in its own
    threads."""
    with _GUARDS_LOCK:
        guard = _GUARDS.get(shard_loader)
        if guard is None:
            guard = _GUARDS[shard_loader] = threading.Lock()
        return guard


def dataset(
    url: str,
    *,
    fields: Sequence[str] | None = None,
    output_signature: Any = None,
    transform: Callable[[dict[str, Any]], Any] | None = None,
    readahead: bool = True,
    **loader_args: Any,
) -> tf.data.Dataset:
    """A ``tf.data.Dataset`` of the samples of ``ShardLoader(url, **loader_args)``.

    Without ``transform``: give ``fields`` (e.g. ``("jpg", "cls")``); each element is
    ``{"__key__": tf.string, "jpg": tf.string, "cls": tf.string}``. With ``transform``: give the
    ``output_signature`` of what it returns (``tf.TensorSpec`` structure).

    ``readahead=False`` turns off tf.data's default optimizations for the pipeline (options
    apply downstream too), which read ahead of what the pipeline delivers: then a pipeline with
    no buffering step of its own pulls from the loader only what it delivers, and checkpoints
    (:func:`checkpoint_state`) are exact anywhere in an epoch. It costs the overlap of reading
    with training. :func:`loader_of` gives the dataset's ShardLoader.
    """
    loader = ShardLoader(url, **loader_args)
    if transform is None:
        if output_signature is None:
            if not fields:
                raise ConfigError("give fields=('jpg', 'cls', ...) (or transform= with output_signature=)")
            names = ["__key__", *[f for f in fields if f != "__key__"]]
            output_signature = {name: tf.TensorSpec(shape=(), dtype=tf.string) for name in names}
        if not isinstance(output_signature, dict):
            raise ConfigError("without transform=, output_signature must be a dict of field name to tf.TensorSpec")
        wanted = list(output_signature)

        def pick(sample: dict[str, Any]) -> dict[str, Any]:
            try:
                picked = {name: sample[name] for name in wanted}
            except KeyError as exc:
                raise ConfigError(
                    f"sample {sample.get('__key__')!r} of {sample.get('__url__')} has no field {exc.args[0]!r} "
                    f"(it has {sorted(k for k in sample if not k.startswith('__'))}); choose fields= that every "
                    "sample has"
                ) from None
            # tf.string takes bytes, not buffers: zero_copy views are copied here
            return {name: bytes(v) if isinstance(v, memoryview) else v for name, v in picked.items()}

        transform = pick
    elif output_signature is None:
        raise ConfigError("transform= needs output_signature= describing what it returns")

    guard = _guard(loader)
    convert = transform

    def generate() -> Iterator[Any]:
        # tf.data calls this once per iteration of the dataset: one ShardLoader epoch each time.
        # It runs in tf.data's threads: a checkpoint reads the position between two samples.
        with guard:
            samples = iter(loader)
        try:
            while True:
                with guard:
                    try:
                        sample = next(samples)
                    except StopIteration:
                        return
                yield convert(sample)
        finally:
            close = getattr(samples, "close", None)
            if close is not None:
                with guard:
                    close()  # an iteration left early: dynamic mode gives its leases back now

    ds = tf.data.Dataset.from_generator(generate, output_signature=output_signature)
    if not readahead:
        options = tf.data.Options()
        options.experimental_optimization.apply_default_optimizations = False
        options.experimental_optimization.inject_prefetch = False
        ds = ds.with_options(options)
    setattr(ds, _ATTRIBUTE, loader)
    return ds


def indexed_dataset(
    url: str,
    *,
    fields: Sequence[str],
    indices: Sequence[int] | None = None,
    **index_args: Any,
) -> tf.data.Dataset:
    """Samples by index as a ``tf.data`` pipeline: ``from_tensor_slices(indices).map(lookup)``,
    each element ``{"__key__": tf.string, field: tf.string, ...}`` of sample ``i`` of the dataset
    (:class:`~loader.ShardIndex`, with ``index_args``: ``endpoint``, ``settings``...).

    ``indices``: which samples, in which order (default: all, in the dataset's order); shuffle or
    shard them before (``np.random.default_rng(seed).permutation(n)``, every ``world_size``-th
    for a rank) rather than ``shuffle`` the samples after: the samples are then never buffered.
    The map may run in parallel (``num_parallel_calls``); each lookup holds the GIL while it
    copies its sample out of the shard's mapping."""
    if not fields:
        raise ConfigError("give fields=('jpg', 'cls', ...): the members each element carries")
    index = ShardIndex(url, **index_args)
    names = ["__key__", *[f for f in fields if f != "__key__"]]

    def lookup(i: Any) -> list[bytes]:
        sample = index.sample(int(i.numpy()))
        try:
            return [sample[name] if name != "__key__" else sample[name].encode() for name in names]
        except KeyError as exc:
            raise ConfigError(
                f"sample {sample.get('__key__')!r} of {sample.get('__url__')} has no field {exc.args[0]!r} (it has "
                f"{sorted(k for k in sample if not k.startswith('__'))}); choose fields= that every sample has"
            ) from None

    def fetch(i: Any) -> dict[str, Any]:
        values = tf.py_function(lookup, [i], Tout=[tf.string] * len(names))
        return {name: tf.ensure_shape(value, ()) for name, value in zip(names, values, strict=True)}

    chosen = list(range(len(index))) if indices is None else [int(i) for i in indices]
    for i in chosen:
        index.locate(i)  # an index out of range fails here, with the dataset's size, not in a tf.data thread
    return tf.data.Dataset.from_tensor_slices(tf.constant(chosen, dtype=tf.int64)).map(fetch)


def loader_of(ds: tf.data.Dataset) -> ShardLoader:
    """The :class:`~loader.ShardLoader` behind ``ds``: a dataset :func:`dataset` returned, or one
    made from it (``map``, ``batch``, ``prefetch``, ...). While tf.data may be running its
    generator, take its state with ``checkpoint_state(ds).state_dict()`` (and load one with
    ``.load_state_dict(state)``, before iterating): those wait for a sample being read."""
    found: list[ShardLoader] = []
    todo, seen = [ds], set()
    while todo:
        node = todo.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        mine = getattr(node, _ATTRIBUTE, None)
        if isinstance(mine, ShardLoader):
            if all(mine is not other for other in found):
                found.append(mine)
            continue
        inputs = getattr(node, "_inputs", None)
        if callable(inputs):
            try:
                todo.extend(inputs())
            except Exception:  # a dataset kind without inputs to walk
                pass
    if len(found) == 1:
        return found[0]
    if not found:
        raise ConfigError(
            "this dataset reads no ShardLoader made by loader.tf.dataset() (or tf.data cannot say what it is made "
            "from): pass the dataset loader.tf.dataset() returned"
        )
    raise ConfigError(
        f"this dataset reads {len(found)} ShardLoaders: pass the dataset loader.tf.dataset() returned for the one "
        "to checkpoint (one checkpoint_state each)"
    )


class LoaderState(tf.train.experimental.PythonState):
    """A ``tf.train.Checkpoint`` dependency holding a ShardLoader's state: ``serialize()`` is
    its ``state_dict()`` as JSON (in dynamic mode a mark made on the master), ``deserialize()``
    loads it (restore before iterating the dataset). See the module's docstring for what a
    state resumes exactly."""

    def __init__(self, shard_loader: ShardLoader) -> None:
        super().__init__()
        self.loader = shard_loader

    def state_dict(self) -> dict[str, Any]:
        with _guard(self.loader):
            return self.loader.state_dict()

    def load_state_dict(self, state: Any) -> None:
        with _guard(self.loader):
            self.loader.load_state_dict(state)

    def serialize(self) -> str:
        return json.dumps({"kind": _STATE_KIND, "version": 1, "loader": self.state_dict()}, sort_keys=True)

    def deserialize(self, string_value: Any) -> None:
        if hasattr(string_value, "numpy"):
            string_value = string_value.numpy()
        text = string_value.decode() if isinstance(string_value, bytes) else str(string_value)
        try:
            saved = json.loads(text)
        except ValueError as exc:
            raise ConfigError(f"not a loader.tf checkpoint state: {exc}") from exc
        if not isinstance(saved, dict) or saved.get("kind") != _STATE_KIND or saved.get("version") != 1:
            raise ConfigError("not a loader.tf checkpoint state (version 1): save it with loader.tf.checkpoint_state()")
        self.load_state_dict(saved.get("loader"))


def checkpoint_state(source: tf.data.Dataset | ShardLoader) -> LoaderState:
    """The ``tf.train.Checkpoint`` dependency of ``source`` (a dataset :func:`dataset` returned,
    one made from it, or its ShardLoader): ``tf.train.Checkpoint(model=..., data=checkpoint_state(ds))``."""
    return LoaderState(source if isinstance(source, ShardLoader) else loader_of(source))
