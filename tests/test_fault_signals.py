"""Signals sent to a server at any moment: it ends with one line and an exit code that says
which signal, stops the processes it started, and leaves nothing behind in the temporary
folder. Run with the rest of the fault suite: `pytest -m fault`."""

import signal
from pathlib import Path

import pytest

from tests.harness import Cluster, all_exit, wait_for_log

pytestmark = [pytest.mark.fault, pytest.mark.timeout(180)]
LENET = ["--model", "lenet", "--train-limit", "640", "--test-limit", "100"]


def children_of(pid: int) -> list[int]:
    return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads children from /proc")
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_terminated_leader_stops_its_followers_and_removes_their_secret(
    cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, signum: int
) -> None:
    """kill (or ps-local stopping its server) sent the leader SIGTERM, which killed it at
    once: its followers died with it, but the folder of their shard secret stayed in the
    temporary folder, and the leader said nothing. It now unwinds as on Ctrl-C."""
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    monkeypatch.setenv("TMPDIR", str(temporary))
    leader, _ = cluster.start_server(*LENET, "--workers", "1", "--num-shards", "2")
    wait_for_log(leader, "shard 1 of 2 joined", timeout=60)
    followers = children_of(leader.process.pid)
    assert len(followers) == 1 and list(temporary.glob("ps-shard-*")), followers
    leader.process.send_signal(signum)
    cluster.wait(leader, timeout=30, expect_code=128 + signum)
    assert all_exit(followers, timeout=10), "the follower outlived its leader"
    assert not list(temporary.iterdir()), "the leader left files in the temporary folder"
    stderr = leader.stderr()
    assert "Traceback" not in stderr, stderr
    assert f"stopped by {signal.Signals(signum).name}" in stderr, stderr
