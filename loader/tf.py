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
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import tensorflow as tf

from loader.errors import ConfigError
from loader.shardloader import ShardLoader

__all__ = ["dataset"]


def dataset(
    url: str,
    *,
    fields: Sequence[str] | None = None,
    output_signature: Any = None,
    transform: Callable[[dict[str, Any]], Any] | None = None,
    **loader_args: Any,
) -> tf.data.Dataset:
    """A ``tf.data.Dataset`` of the samples of ``ShardLoader(url, **loader_args)``.

    Without ``transform``: give ``fields`` (e.g. ``("jpg", "cls")``); each element is
    ``{"__key__": tf.string, "jpg": tf.string, "cls": tf.string}``. With ``transform``: give the
    ``output_signature`` of what it returns (``tf.TensorSpec`` structure).
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

    def generate() -> Iterator[Any]:
        # tf.data calls this once per iteration of the dataset: one ShardLoader epoch each time.
        for sample in loader:
            yield transform(sample)

    return tf.data.Dataset.from_generator(generate, output_signature=output_signature)
