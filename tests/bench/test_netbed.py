"""The far host the suite can put its store on (``bench.netbed.FarHost``): a transfer through it is
held to its link cap, and nothing it made (namespace, veth pair, processes) outlives it, whether
the ``with`` ends normally, with an exception, or a set-up step fails. Loose bounds: this checks a
property of the bed, not a timing."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from bench import netbed
from bench.common import wait_until
from bench.netbed import FarHost, FarHostUnavailable, link_exists, listening, measure_mb_s, netns_exists, sender_command

pytestmark = pytest.mark.slow

MBPS = 200.0
CAP_MB_S = MBPS / 8  # tbf counts frames; TCP payload gets ~95% of this
PORT = 9000

needs_far_host = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
    reason="a far host needs root and iproute2's ip and tc",
)


def _running(pid: int) -> bool:
    """Alive and not a zombie (a killed orphan waits for init to reap it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def _gone(far: FarHost) -> bool:
    return not netns_exists(far.name) and not link_exists(far.host_veth)


@needs_far_host
@pytest.mark.timeout(60)
def test_a_transfer_through_the_far_host_is_held_to_its_cap(tmp_path: Path) -> None:
    with FarHost(MBPS) as far:
        assert far.name.startswith(netbed.NETNS_PREFIX) and netns_exists(far.name) and link_exists(far.host_veth)
        assert far.address != far.host_address and far.address.startswith("10.")
        sender = far.spawn(sender_command(far.address, PORT), tmp_path / "sender.log")
        wait_until(lambda: listening(far.address, PORT), timeout=10, what="the sender inside the far host")
        # ~1.5 s each at the cap: one stream, then four sharing the link
        for streams in (1, 4):
            got = measure_mb_s(far.address, PORT, streams, int(CAP_MB_S * 1e6 * 1.5), timeout=20)
            assert 0.5 * CAP_MB_S <= got <= 1.3 * CAP_MB_S, (streams, got)
    assert _gone(far)
    assert sender.poll() is not None


@needs_far_host
@pytest.mark.timeout(60)
def test_an_exception_inside_the_with_still_removes_everything(tmp_path: Path) -> None:
    far = FarHost(MBPS)
    with pytest.raises(RuntimeError, match="boom"), far:
        sleeper = far.spawn(["sleep", "60"], tmp_path / "sleep.log")
        # a process that left its process group: only the namespace's pid list still finds it
        orphan = far.spawn(["sh", "-c", "setsid sleep 60 & wait"], tmp_path / "orphan.log")
        wait_until(lambda: len(far.pids_inside()) >= 3, timeout=10, what="the processes to start")
        inside = far.pids_inside()
        raise RuntimeError("boom")
    assert _gone(far)
    assert sleeper.poll() is not None and orphan.poll() is not None
    assert not [pid for pid in inside if _running(pid)], inside


@needs_far_host
@pytest.mark.timeout(60)
def test_a_failed_set_up_step_undoes_the_earlier_ones() -> None:
    far = FarHost(MBPS, burst="not-a-size")  # tc refuses it: after the namespace and veth exist
    with pytest.raises(RuntimeError, match="tc"):
        far.__enter__()
    assert _gone(far)


def test_without_root_it_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netbed.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(netbed.shutil, "which", lambda name: f"/usr/sbin/{name}")
    with pytest.raises(FarHostUnavailable, match="root"):
        FarHost(MBPS).__enter__()
    monkeypatch.setattr(netbed.shutil, "which", lambda name: None if name == "tc" else f"/usr/sbin/{name}")
    with pytest.raises(FarHostUnavailable, match="tc"):
        netbed.check_available()
