"""Benchmarks of shardcache. Each reports ratios against a baseline measured in the same run.

Run them as modules from the repository root, e.g. ``python -m bench.daemon_bench --quick``;
results land in ``bench/results/<name>.json``. Speed targets are measured here, never asserted in
tests.
"""

__all__: list[str] = []
