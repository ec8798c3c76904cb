"""A finished job that lingers (`ps-server --linger`): real processes on 127.0.0.1.

A worker that a supervisor restarts after the end (a Kubernetes pod that failed as the job
finished) must hear that the job is over and exit 0, not retry a closed port until its
restarts run out. So the server writes its summary, then goes on answering every worker that
comes with STOP, and ps-status with the status, until --linger runs out (exit 0) or SIGTERM
ends it (exit 143). A server restarted on the volume of a finished job (`--resume`) trains
nothing, keeps the run's summary, and lingers the same way.
"""

import json
import signal
from pathlib import Path

import pytest
from click.testing import CliRunner

from psserver.cli.status import command as ps_status
from tests.harness import Cluster, kill, wait_for_log

pytestmark = [pytest.mark.timeout(240), pytest.mark.fault]
# One worker, 64 images in batches of 16: 4 steps, then the final checkpoint and summary.
JOB = (
    *("--model", "lenet", "--workers", "1", "--train-limit", "64", "--batch-size", "16"),
    *("--test-limit", "32"),
)
LINGERING = "answering every worker that comes with STOP"


def status_of(endpoint: str) -> dict:
    result = CliRunner().invoke(ps_status, ["--server", endpoint, "--json", "--timeout", "10"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_a_lingering_server_tells_late_workers_the_job_is_over(
    cluster: Cluster, tmp_path: Path
) -> None:
    folder, summary = tmp_path / "ck", tmp_path / "summary.json"
    server, endpoint = cluster.start_server(
        *JOB, "--checkpoint-dir", str(folder), "--summary", str(summary), "--linger", "600"
    )
    first = cluster.start_worker(endpoint, name="first-worker")
    cluster.wait(first, timeout=120)
    wait_for_log(server, LINGERING, timeout=30)
    # The summary is written before the linger, not after it.
    assert json.loads(summary.read_text())["global_steps"] == 4
    assert server.process.poll() is None

    late = cluster.start_worker(endpoint, name="late-worker")
    assert cluster.wait(late, timeout=120) == 0
    assert "training is over" in late.stderr(), late.stderr()
    wait_for_log(server, "which registered after the end, that the job is over", timeout=10)
    status = status_of(endpoint)
    assert status["phase"] == "finished" and status["step"] == 4, status

    kill(server, signal.SIGTERM)  # what a JobSet that completed sends
    assert cluster.wait(server, timeout=30, expect_code=None) == 128 + signal.SIGTERM

    # The server restarted on the finished job's folder trains nothing and keeps the run's
    # summary; its linger runs out on its own, and it exits 0.
    written = summary.read_text()
    again, endpoint = cluster.start_server(
        *JOB, "--checkpoint-dir", str(folder), "--summary", str(summary), "--resume",
        "--stop-grace", "0", "--linger", "3", name="again",
    )  # fmt: skip
    cluster.wait(again, timeout=120)
    assert "nothing to train" in again.stderr()
    assert "stopped lingering after 3 s; 0 workers told after the end" in again.stderr()
    assert summary.read_text() == written


def test_a_sharded_server_stops_its_followers_before_it_lingers(cluster: Cluster) -> None:
    """Nobody needs the follower shards once the job is over, and a follower that heard
    nothing from its leader for --leader-timeout would end with an error, failing the leader
    after a linger longer than that."""
    server, endpoint = cluster.start_server(
        *JOB, "--num-shards", "2", "--leader-timeout", "5", "--linger", "8"
    )
    worker = cluster.start_worker(endpoint)
    cluster.wait(worker, timeout=120)
    cluster.wait(server, timeout=60)
    assert "stopped lingering after 8 s" in server.stderr(), server.describe()
    assert "failed" not in server.stderr(), server.describe()
