"""A worker that reaches the leader but not a follower shard stops with one clear line, and the
job goes on without it.

The follower here accepts only one of the two workers' CURVE keys (its own
--curve-authorized-clients folder lacks the other), so the refused worker's requests to it
never arrive while the leader answers that worker's heartbeats. That worker used to wait for
ever, borrowing the leader's liveness, and every sync step with it; then for its timeouts;
now the refused handshake tells it at once. A follower that is silent for another reason (a
firewall) is the hand-driven one of the second test.
"""

import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import zmq

from common.errors import ServerError
from common.wire.protocol import Error, Pull, decode, encode
from common.wire.security import ClientSecurity
from psserver.cli.status import request_status
from psworker.connection.requests import Interrupted
from psworker.connection.shards import ShardClients
from tests.harness import Cluster, wait_for_log
from tests.raw_peers import hand_driven_follower, slice_push, slice_weights

pytestmark = pytest.mark.timeout(180)
JOB = [
    "--model", "lenet", "--train-limit", "64", "--test-limit", "32", "--batch-size", "16",
    "--epochs", "1", "--lr", "0.05",
]  # fmt: skip


def make_keys(folder: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "psserver.cli.keys", str(folder), "--clients", "2"],
        check=True,
        capture_output=True,
        timeout=60,
    )


def test_a_worker_the_follower_refuses_stops_with_a_clear_error_and_the_job_goes_on(
    cluster: Cluster, tmp_path: Path
) -> None:
    keys, follower_clients = tmp_path / "keys", tmp_path / "follower_clients"
    make_keys(keys)
    follower_clients.mkdir()
    shutil.copy(keys / "authorized_clients" / "client-2.key", follower_clients)
    server_keys = ["--curve-secret-key", str(keys / "server.key_secret")]
    leader, endpoint = cluster.start_server(
        *JOB, *server_keys, "--curve-authorized-clients", str(keys / "authorized_clients"),
        "--workers", "2", "--worker-timeout", "6", "--shard", "0", "--num-shards", "2",
    )  # fmt: skip
    follower = cluster.start_follower(
        endpoint, *server_keys, "--curve-authorized-clients", str(follower_clients)
    )
    wait_for_log(leader, "all 2 shards have joined", timeout=60)

    def worker(client: str) -> list[str]:
        return [
            "--curve-secret-key", str(keys / f"{client}.key_secret"),
            "--curve-server-key", str(keys / "server.key"), "--timeout", "3", "--retries", "1",
        ]  # fmt: skip

    refused = cluster.start_worker(endpoint, *worker("client-1"), name="refused")
    trusted = cluster.start_worker(endpoint, *worker("client-2"), name="trusted")
    cluster.wait(refused, timeout=60, expect_code=1)
    error = refused.stderr()
    # The follower's refusal is told at once: no attempt timed out and was retried first.
    assert "no reply for" not in error and "retrying" not in error, error
    assert "Error: shard 1: the server at tcp://127.0.0.1:" in error, error
    assert "refused this client's CURVE key" in error, error
    assert "Traceback" not in error, error
    assert "rejected a connection" in follower.stderr(), follower.stderr()

    # The leader hears the refused worker die, and the trusted one trains to the end.
    wait_for_log(leader, "declared dead", timeout=60)
    if "training starts" not in leader.stderr():
        # A worker asks the followers for their slices before it sends the leader its
        # first pull, and here the refusal ended it in between, so it never joined the
        # roster. (In the usual order it pulls first, training starts with both workers,
        # and it is declared dead later.) The job waits for a second worker, as --workers 2
        # says; one more comes, and training starts with it.
        trusted_key = ClientSecurity(keys / "client-2.key_secret", keys / "server.key")
        assert request_status(endpoint, 10, trusted_key)["phase"] == "waiting"
        cluster.start_worker(endpoint, *worker("client-2"), name="second")
    cluster.wait(trusted, timeout=120)
    cluster.wait(leader, timeout=60)


def test_only_a_held_pull_to_a_follower_that_answered_borrows_the_leaders_liveness(
    zmq_context: zmq.Context,
) -> None:
    """With the job's liveness always fresh (the leader answers): a first PULL to a silent
    follower times out; once the follower has answered, a pull it holds outlives the timeout;
    a PUSH, which is answered at once, never borrows."""
    follower, job = hand_driven_follower(zmq_context)
    shards = ShardClients(job, lambda start, values: None, 0.5, 0, None, time.monotonic)
    try:
        shards.request_slices(7, "t7", 0)
        assert follower.poll(10_000), "no PULL reached the follower"
        follower.recv_multipart()  # and never answered
        with pytest.raises(ServerError, match=r"no reply from shard 1 at tcp://127\.0\.0\.1:"):
            shards.receive_slices(7, "t7", 0)

        shards.request_slices(7, "t7", 0)
        assert follower.poll(10_000), "no second PULL reached the follower"
        identity, *_ = follower.recv_multipart()
        follower.send_multipart([identity, *encode(slice_weights(0, torch.zeros(4)))])
        shards.receive_slices(7, "t7", 0)  # the follower has answered: it is reachable

        shards.request_slices(7, "t7", 1)
        assert follower.poll(10_000), "no third PULL reached the follower"
        identity, *frames = follower.recv_multipart()
        assert isinstance(decode(frames), Pull)
        threading.Timer(
            2.0,  # four timeouts: the pull is held, not lost
            lambda: follower.send_multipart([identity, *encode(slice_weights(1, torch.ones(4)))]),
        ).start()
        shards.receive_slices(7, "t7", 1)

        shards.send_push(slice_push(7, "t", 1, 0, 1, torch.zeros(4)))
        assert follower.poll(10_000), "no PUSH reached the follower"
        follower.recv_multipart()  # and never acknowledged
        # Borrowing the liveness, always fresh here, it would wait for ever: that it ends at
        # all (its 0.5 s timeout, then "no reply") is the check; the test's timeout bounds it.
        with pytest.raises(ServerError, match="no reply from shard 1"):
            shards.finish_pushes()
    finally:
        shards.close()
        follower.close(linger=0)


def test_a_second_follower_for_a_joined_shard_is_told_who_holds_it(cluster: Cluster) -> None:
    """A follower restarted by hand while the leader still holds the old one: refused, with
    where the old one joined from and when the leader gives up on it."""
    leader, endpoint = cluster.start_server(
        *JOB, "--workers", "1", "--worker-timeout", "30", "--shard", "0", "--num-shards", "2",
    )  # fmt: skip
    first = cluster.start_follower(endpoint)
    wait_for_log(leader, "all 2 shards have joined", timeout=60)
    second = cluster.start_follower(endpoint, name="second")
    cluster.wait(second, timeout=60, expect_code=1)
    error = second.stderr()
    assert "Error: shard 1: the leader refused it: shard 1 already joined this job from " in error
    assert "s ago); a shard cannot rejoin a running job" in error, error
    assert "the leader stops the job after 30 s of its silence" in error, error
    assert first.process.poll() is None, "the joined follower must go on"


def test_a_follower_that_forgot_the_worker_leaves_the_verdict_to_the_leader(
    zmq_context: zmq.Context,
) -> None:
    """A follower answers a PUSH "unknown-worker" (the leader forgot the worker and told
    it so). The leader may have applied the push before it forgot the worker, so the follower's
    answer must not end the push: `finish_pushes` drops the followers' wait and the caller
    reads the leader's answer. It used to raise, and a top-k worker took its gradient back."""
    follower, job = hand_driven_follower(zmq_context)
    shards = ShardClients(job, lambda start, values: None, 5.0, 0, None, time.monotonic)
    try:
        shards.send_push(slice_push(7, "t", 1, 0, 1, torch.zeros(4)))
        assert follower.poll(10_000), "no PUSH reached the follower"
        identity, *_ = follower.recv_multipart()
        forgot = Error("unknown-worker", "worker 7 is unknown here; register again")
        follower.send_multipart([identity, *encode(forgot)])
        assert shards.finish_pushes() is None
    finally:
        shards.close()
        follower.close(linger=0)


def test_a_shutdown_signal_ends_the_wait_for_a_silent_followers_push_answer(
    zmq_context: zmq.Context,
) -> None:
    """SIGTERM (here the event its handler sets) while a follower never acknowledges a
    PUSH: the wait ends within a poll slice with Interrupted, and the worker leaves. It
    used to wait out the timeout and the retry (300 s each here), since no heartbeat speaks
    for a follower."""
    follower, job = hand_driven_follower(zmq_context)
    shutdown = threading.Event()
    shards = ShardClients(
        job, lambda start, values: None, 300.0, 1, None, time.monotonic, interrupt=shutdown
    )
    signal_comes = threading.Timer(0.5, shutdown.set)
    try:
        shards.send_push(slice_push(7, "t", 1, 0, 1, torch.zeros(4)))
        assert follower.poll(10_000), "no PUSH reached the follower"
        follower.recv_multipart()  # and never acknowledged
        started = time.monotonic()
        signal_comes.start()
        with pytest.raises(Interrupted, match=r"the answer to Push \(shard 1\)"):
            shards.finish_pushes()
        # Within a poll slice of the signal: 60 s is far from it, and far below the 600 s
        # it would otherwise wait, so that load cannot decide this.
        assert time.monotonic() - started < 60
    finally:
        signal_comes.cancel()
        shards.close()
        follower.close(linger=0)
