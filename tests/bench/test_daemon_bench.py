"""``bench.daemon_bench``'s cold methods end to end on a small dataset (moto, real daemons, the
splice relay), and the relay itself: every byte through it unchanged, both ways, a refused
upstream closing the client's connection instead of hanging it. Speed is measured, never
asserted: the machine is shared."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from bench.common import REPO, free_port
from bench.daemon_bench import COLD_METHODS
from bench.splice_relay import SpliceRelay


def _echo_server() -> tuple[socket.socket, int]:
    """A TCP server answering each connection with what it reads."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return

            def echo(conn: socket.socket = conn) -> None:
                with conn:
                    while data := conn.recv(1 << 16):
                        conn.sendall(data)

            threading.Thread(target=echo, daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return listener, listener.getsockname()[1]


@pytest.mark.timeout(60)
def test_the_relay_moves_every_byte_both_ways(tmp_path: Path) -> None:
    listener, port = _echo_server()
    try:
        with SpliceRelay(f"127.0.0.1:{port}", tmp_path / "relay.log") as relay:
            chunks = [os.urandom(n) for n in (1, 4096, 65536, 1000)]
            with socket.create_connection(("127.0.0.1", relay.port), timeout=10) as conn:
                for chunk in chunks:
                    conn.sendall(chunk)
                    got = b""
                    while len(got) < len(chunk):
                        part = conn.recv(len(chunk) - len(got))
                        assert part, "the relay closed the connection"
                        got += part
                    assert got == chunk
    finally:
        listener.close()


@pytest.mark.timeout(60)
def test_a_refused_upstream_closes_the_clients_connection(tmp_path: Path) -> None:
    with SpliceRelay(f"127.0.0.1:{free_port()}", tmp_path / "relay.log") as relay, \
            socket.create_connection(("127.0.0.1", relay.port), timeout=10) as conn:
        assert conn.recv(1) == b""  # closed, not left waiting


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_quick_cold_run_measures_every_method_and_the_relay_bound(tmp_path: Path) -> None:
    output = tmp_path / "daemon.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.daemon_bench", "--quick", "--cold-only", "--size", "48MiB", "--shard-sizes", "8MiB",
         "--no-drop-caches", "--output", str(output), "--workdir", str(tmp_path / "work")],
        cwd=REPO, capture_output=True, text=True, timeout=280,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(output.read_text())
    assert result["config"]["stock_moto"] is False and "S3_LIKE_MOTO" in result["config"]["origin"]
    (layout,) = result["layouts"].values()
    assert set(layout["methods"]) == set(COLD_METHODS)
    for method, figures in layout["methods"].items():
        assert figures["median_mb_s"] > 0, method
    assert layout["methods"]["relay_x4"]["cpu_s_per_gb"]["relay"] >= 0
    x4 = layout["targets"]["daemon_cold_x4_vs_plain_boto3_x4"]
    assert x4["bound"] == layout["ratios"]["relay_x4/origin_get_object_x4"] > 0
    assert layout["ratios"]["daemon_cold/daemon_cold_buffered"] > 0
