"""Faults injected into sharded jobs (--num-shards 2): what the leader says and does when a
follower is lost. Run with the rest of the fault suite: `pytest -m fault`."""

import os
import signal
from pathlib import Path

import pytest

from tests.harness import Cluster, Proc, error_after_pausing_to_the_end, wait_for_log

pytestmark = [pytest.mark.fault, pytest.mark.timeout(180)]
LENET = ["--model", "lenet", "--train-limit", "1280", "--test-limit", "100", "--batch-size", "16"]
STEP_1_DONE = "step 1/"  # a worker's --progress log line


def sleeping_before_step_2s_push(worker: Proc) -> None:
    """Wait until the worker (--log-level debug) has step 2's slices from the follower: it
    sleeps its --step-delay before its push from here."""
    wait_for_log(worker, STEP_1_DONE, timeout=90)
    wait_for_log(worker, "answered SlicePull with SliceWeights", timeout=60, after=STEP_1_DONE)


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads children from /proc")
def test_workers_that_heard_stop_by_heartbeat_are_not_declared_dead(cluster: Cluster) -> None:
    """A follower dies while the workers wait for its answer. The leader stops the job; each
    worker hears STOP on its heartbeat and ends at once, and never asks the leader again. The
    leader used to wait for their next request until it declared them dead ("declared dead
    after 3.0 s of silence"), or, past --stop-grace, warned that they would time out."""
    leader, endpoint = cluster.start_server(
        *LENET, "--workers", "2", "--epochs", "50", "--worker-timeout", "3", "--num-shards", "2"
    )
    workers = [
        cluster.start_worker(endpoint, "--timeout", "3", "--retries", "3", name=f"w{i}")
        for i in range(2)
    ]
    wait_for_log(leader, "training starts", timeout=60)
    pid = leader.process.pid
    (follower,) = (int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split())
    os.kill(follower, signal.SIGKILL)
    cluster.wait(leader, timeout=60, expect_code=1)
    for worker in workers:
        cluster.wait(worker, timeout=30, expect_code=None)
        assert "a server shard was lost" in worker.stderr(), worker.describe()
    after_stop = leader.stderr().partition("stopping the job")[2]
    assert after_stop, leader.describe()
    assert "declared dead" not in after_stop, leader.describe()
    assert "did not ask again" not in after_stop, leader.describe()


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads children from /proc")
def test_a_worker_of_a_job_stopped_by_a_lost_shard_exits_1(cluster: Cluster) -> None:
    """The leader exits 1 when a follower is lost, and says to restart every shard with
    --resume. Its workers used to exit 0 on the STOP that said so: a supervisor (a Kubernetes
    Job) counted them complete, and the restarted server waited for ever for workers."""
    leader, endpoint = cluster.start_server(
        *LENET, "--workers", "1", "--epochs", "50", "--worker-timeout", "3", "--num-shards", "2"
    )
    worker = cluster.start_worker(endpoint, "--timeout", "3", "--retries", "3")
    wait_for_log(leader, "training starts", timeout=60)
    pid = leader.process.pid
    (follower,) = (int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split())
    os.kill(follower, signal.SIGKILL)
    cluster.wait(leader, timeout=60, expect_code=1)
    cluster.wait(worker, timeout=30, expect_code=1)
    last = worker.stderr().strip().splitlines()[-1]
    assert last.startswith("Error: the server stopped the job: a server shard was lost"), last
    assert "Traceback" not in worker.stderr(), worker.describe()


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads children from /proc")
def test_a_worker_mid_step_at_the_end_of_a_sharded_job_takes_the_leaders_stop(
    cluster: Cluster,
) -> None:
    """A straggler pushes after the job has ended: the leader answers its PUSH with STOP and
    exits, stopping its follower, which never answers the straggler's slice. The worker used
    to wait for that answer first, and the heartbeat's STOP never came from a leader that was
    gone: it ignored SIGTERM and ended after --timeout x (retries + 1), exiting 1 with "no reply
    from shard 1". It now reads the leader's STOP and exits 0. (The follower is stopped here
    so that it surely never answers; in real jobs it was a race the follower often lost.)"""
    leader, endpoint = cluster.start_server(
        *LENET, "--workers", "2", "--mode", "async", "--max-steps", "8", "--num-shards", "2",
        "--stop-grace", "20",
    )  # fmt: skip
    fast = cluster.start_worker(endpoint, name="fast")
    slow = cluster.start_worker(
        endpoint, "--step-delay", "4", "--timeout", "20", "--retries", "2", name="slow"
    )
    wait_for_log(leader, "started 1 follower shard", timeout=60)  # a child of the leader now
    pid = leader.process.pid
    (follower,) = (int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split())
    cluster.wait(fast, timeout=60)  # the job's 8 updates are done; the slow one still sleeps
    assert slow.process.poll() is None, slow.describe()
    os.kill(follower, signal.SIGSTOP)
    cluster.wait(slow, timeout=15)
    assert "no reply" not in slow.stderr(), slow.describe()
    # The follower, stopped, cannot exit when told; the leader kills it and says so.
    cluster.wait(leader, timeout=60, expect_code=1)
    assert "a follower shard failed while stopping" in leader.stderr(), leader.describe()


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads children from /proc")
def test_sigterm_ends_a_worker_whose_push_waits_for_a_silent_follower(cluster: Cluster) -> None:
    """A follower stops answering (SIGSTOP here; a hung host) while a worker waits for it to
    take the slices of its push. SIGTERM must still end the worker at once, with LEAVE and
    143, as it does while the server holds its pull: it used to wait out --timeout x
    (--retries + 1), a minute here, since no heartbeat speaks for a follower."""
    # The leader would stop the job after --worker-timeout of its follower's silence.
    leader, endpoint = cluster.start_server(
        *LENET, "--workers", "1", "--epochs", "50", "--worker-timeout", "300", "--num-shards",
        "2",
    )  # fmt: skip
    # Each step: the pull, 8 s asleep, the push. Its debug log names each request as it
    # goes out and as it is answered.
    worker = cluster.start_worker(
        endpoint, "--step-delay", "8", "--timeout", "100", "--retries", "2", "--log-level",
        "debug",
    )  # fmt: skip
    sleeping_before_step_2s_push(worker)
    pid = leader.process.pid
    (follower,) = (int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split())
    # The fixture's killpg ends it in teardown: a follower is in its leader's process group.
    os.kill(follower, signal.SIGSTOP)
    wait_for_log(worker, ": SlicePush", timeout=60, after=STEP_1_DONE)  # it waits for the answer
    assert "answered SlicePush" not in worker.stderr().partition(STEP_1_DONE)[2], (
        "the follower took step 2's push before it was stopped: the test missed the 8 s sleep"
    )
    worker.process.send_signal(signal.SIGTERM)
    # 143 and Interrupted's words: the signal ended the wait, not its --timeout (5 minutes
    # in all), which would end it with "no reply from shard 1" and 1.
    cluster.wait(worker, timeout=60, expect_code=128 + signal.SIGTERM)
    stderr = worker.stderr()
    assert "stopped waiting for the answer to SlicePush" in stderr, worker.describe()
    assert "left the job after a shutdown signal" in stderr, worker.describe()
    wait_for_log(leader, "left: shut down by a signal", timeout=30)


def test_a_worker_paused_past_the_end_of_a_sharded_job_says_the_job_is_gone(
    cluster: Cluster,
) -> None:
    """A worker stopped (SIGSTOP) in the pause before its push until its sharded job had
    ended, then continued: it waits for the follower's answer to its slice first, and exited
    with "no reply from shard 1 ... check that its port is reachable from this host", advice
    for a firewall, about a follower that had answered it all along and had ended with its
    leader. It says now that both stopped answering, that the job probably ended or the
    server died, and what to do."""
    leader, endpoint = cluster.start_server(
        *LENET, "--workers", "2", "--epochs", "1", "--worker-timeout", "2", "--num-shards",
        "2", "--push-credits", "0",
    )  # fmt: skip
    kept = cluster.start_worker(endpoint, name="kept")
    # Nearly all of its step is the --step-delay before the push: that is where it stops.
    paused = cluster.start_worker(
        endpoint, "--step-delay", "6", "--no-overlap", "--timeout", "1", "--retries", "1",
        "--progress", "log", "--log-level", "debug", name="paused",
    )  # fmt: skip
    sleeping_before_step_2s_push(paused)
    error = error_after_pausing_to_the_end(cluster, paused, kept, leader)
    assert "stopped answering" in error, error
    assert "finished the job or died" in error or "finished or the server died" in error
    assert "check that its port is reachable" not in error, error
