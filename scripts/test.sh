#!/usr/bin/env bash
# Install everything the tests need on a fresh Debian machine (Python 3.11, root), run the static
# checks (import layering, types, lint), then run every test.
# Usage: scripts/test.sh [--fast] [pytest args...]
#   --fast: the fast tier only (pytest -m "not slow"): what a developer runs while working.
#   SHARDCACHE_TEST_WORKERS=N: test processes (default 2; 0: one, no xdist).
set -euo pipefail
cd "$(dirname "$0")/.."

# The real etcd server (v3 API) for the master's high-availability tests; the tests start it.
if [ ! -x /usr/bin/etcd ]; then
    if [ "$(id -u)" = 0 ]; then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server >/dev/null
    else
        echo "scripts/test.sh: /usr/bin/etcd missing; install etcd-server (sudo apt-get install etcd-server)" >&2
    fi
fi

# rclone, one of the real S3 clients tests/clients reads through the cache with (Debian's package).
if ! command -v rclone >/dev/null; then
    if [ "$(id -u)" = 0 ]; then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq rclone >/dev/null
    else
        echo "scripts/test.sh: rclone missing; install it (sudo apt-get install rclone)" >&2
    fi
fi

# ip and tc (iproute2) build the benchmark's far host: a network namespace behind a tc cap.
if ! command -v tc >/dev/null || ! command -v ip >/dev/null; then
    if [ "$(id -u)" = 0 ]; then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 >/dev/null
    else
        echo "scripts/test.sh: ip/tc missing; install iproute2 (sudo apt-get install iproute2)" >&2
    fi
fi

# Debian's chromium, the real headless browser tests/master/test_master_page.py drives the
# master's status page with (over its DevTools protocol).
if ! command -v chromium >/dev/null; then
    if [ "$(id -u)" = 0 ]; then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
    else
        echo "scripts/test.sh: chromium missing; install it (sudo apt-get install chromium)" >&2
    fi
fi

# promtool (Debian's prometheus package): tests/k8s/test_k8s_alerts.py checks and unit-tests the
# chart's alerting rules with it. Without its recommended node exporter: the tests need promtool only.
if ! command -v promtool >/dev/null; then
    if [ "$(id -u)" = 0 ]; then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
    else
        echo "scripts/test.sh: promtool missing; install it (sudo apt-get install prometheus)" >&2
    fi
fi

# torch pinned to the CPU build (an unpinned torch pulls several GB of CUDA wheels); the bench
# extra brings the peers the benchmark suite's smoke test runs (s3fs, webdataset,
# mosaicml-streaming, s3torchconnector); constraints.txt keeps their versions resolvable.
python3 -m pip install -q --disable-pip-version-check -c constraints.txt torch==2.13.0
python3 -m pip install -q --disable-pip-version-check -c constraints.txt -e '.[test,tf,bench]'

# Static checks before any test runs: the layering contracts of docs/design.md (.importlinter),
# types (mypy, configured in pyproject.toml) and lint (ruff). Each stops the run on a finding.
echo "scripts/test.sh: lint-imports, mypy, ruff" >&2
lint-imports
python3 -m mypy
python3 -m ruff check .

# The peers were just installed: the benchmark smoke test must run, not skip.
export SHARDCACHE_BENCH_PEERS=required
# Two worker processes (pytest-xdist): every test starts its own servers on free ports and its own
# namespaces, so tests share nothing, and one process left the two cores half idle (a CI run,
# installs and static checks included: 31.6-34.1 min in one process, 16.9-17.1 in two).
# SHARDCACHE_TEST_WORKERS=0 runs them in this process.
args=(-n "${SHARDCACHE_TEST_WORKERS:-2}")
for arg in "$@"; do
    if [ "$arg" = "--fast" ]; then
        args+=(-m "not slow")
    else
        args+=("$arg")
    fi
done
exec python3 -m pytest "${args[@]+"${args[@]}"}"
