"""Properties of the per-epoch shuffle (the master's and static mode's): a permutation,
reproducible from (seed, epoch), different across epochs and seeds, and not degenerate."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from wire.shuffle import EpochOrder, permutation

seeds = st.integers(min_value=-(2**63) + 1, max_value=2**63 - 1)
epochs = st.integers(min_value=0, max_value=10**6)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(min_value=0, max_value=3000), seed=seeds, epoch=epochs)
def test_is_a_permutation(n: int, seed: int, epoch: int) -> None:
    order = permutation(n, seed, epoch)
    assert sorted(order) == list(range(n))


@settings(max_examples=100, deadline=None)
@given(n=st.integers(min_value=0, max_value=500), seed=seeds, epoch=epochs)
def test_reproducible_and_indexable(n: int, seed: int, epoch: int) -> None:
    order = EpochOrder(n, seed, epoch)
    again = permutation(n, seed, epoch)
    assert [order[i] for i in range(n)] == again == list(EpochOrder(n, seed, epoch))


@settings(max_examples=200, deadline=None)
@given(n=st.integers(min_value=12, max_value=400), seed=seeds, epoch=st.integers(min_value=0, max_value=10**6))
def test_differs_across_epochs_and_seeds(n: int, seed: int, epoch: int) -> None:
    base = permutation(n, seed, epoch)
    assert base != permutation(n, seed, epoch + 1)
    other_seed = seed + 1 if seed < 2**63 - 1 else seed - 1
    assert base != permutation(n, other_seed, epoch)


@given(n=st.integers(min_value=0, max_value=200), seed=seeds, epoch=epochs)
def test_no_shuffle_is_identity(n: int, seed: int, epoch: int) -> None:
    assert permutation(n, seed, epoch, shuffle=False) == list(range(n))


def test_order_is_pinned_across_versions() -> None:
    """The order is part of the durable state (recomputed after a restart), so the algorithm must
    not drift: these values were produced by the first release of the shuffle."""
    assert permutation(10, 1, 0) == [5, 1, 3, 7, 0, 8, 2, 6, 4, 9]
    assert permutation(10, 1, 1) == [3, 9, 6, 2, 1, 0, 4, 7, 5, 8]
    # larger domains (more half bits, more cycle walking), indexed lazily as the master does
    order = EpochOrder(1000, 2**40 + 3, 17)
    assert [order[i] for i in range(8)] == [420, 750, 990, 210, 919, 14, 202, 855] and order[999] == 212
    big = EpochOrder(1_000_003, -5, 0)
    assert [big[i] for i in range(5)] == [25877, 329564, 952806, 324253, 266696]


def test_first_position_is_roughly_uniform() -> None:
    """A degenerate network (e.g. too few rounds) would favour some shards at the start."""
    n, trials = 7, 7000
    counts = Counter(permutation(n, seed, 0)[0] for seed in range(trials))
    expected = trials / n
    chi2 = sum((counts[i] - expected) ** 2 / expected for i in range(n))
    assert chi2 < 30, counts  # 6 degrees of freedom: p < 1e-4 for a uniform source
