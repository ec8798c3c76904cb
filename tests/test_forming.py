"""Workers that register while the follower shards have not yet joined the leader.

The leader holds their registrations until every shard has joined, and answers nothing
meanwhile. A worker's wait for REGISTER is bounded by its --timeout and --retries (6 minutes
by default), so a follower started later than that, by hand on another host, used to find
every worker gone: each had exited with "no reply from the server ... check that ps-server
runs there", about a server that was running and had logged that it held them.

Real ps-server and ps-worker processes on 127.0.0.1, with a short --timeout so that a wait
is seconds, not minutes.
"""

import os
import threading
import time

import pytest
import zmq

from common.catalog import all_fingerprints
from common.wire.protocol import Error, Register, Status, StatusReply, Welcome, decode, encode
from psworker.connection.registration import ask_to_join
from psworker.connection.requests import NoReply, RequestFailed, ServerConnection
from tests.harness import Cluster, Proc, free_port, wait_for_log
from tests.raw_peers import RawClient

pytestmark = pytest.mark.timeout(300)
WORKERS = 8


def test_workers_wait_for_shards_that_join_after_their_retries_ran_out(cluster: Cluster) -> None:
    """Eight workers register with a leader whose follower is started by hand much later
    than their --join-timeout 3 (the first REGISTER) and --timeout 2 --retries 1 (each one
    after it, about 5 s) last. They wait on while the leader says it waits for its shards,
    and train once the follower has joined; the leader logs each waiting worker once, however
    often it asks again."""
    leader, endpoint = cluster.start_server(
        "--model", "lenet", "--workers", str(WORKERS), "--train-limit", "128", "--batch-size",
        "8", "--test-limit", "20", "--max-steps", "2", "--shard", "0", "--num-shards", "2",
    )  # fmt: skip
    workers = [
        cluster.start_worker(
            endpoint,
            "--timeout",
            "2",
            "--retries",
            "1",
            "--join-timeout",
            "3",
            name=f"worker{i}",
        )
        for i in range(WORKERS)
    ]
    deadline = time.monotonic() + 120
    while leader.stderr().count("is welcomed once shards") < WORKERS:
        assert time.monotonic() < deadline, f"not all workers held\n{cluster.describe_all()}"
        for worker in workers:
            assert worker.process.poll() is None, f"a worker gave up\n{worker.describe()}"
        time.sleep(0.2)
    time.sleep(8)  # longer than a worker's whole budget for one request (2 x 2 s + 0.5 s)
    gave_up = [w.role for w in workers if w.process.poll() is not None]
    assert not gave_up, f"{gave_up} gave up while the leader waited\n{cluster.describe_all()}"
    follower = cluster.start_follower(endpoint)
    wait_for_log(leader, "all 2 shards have joined", timeout=60)
    for worker in workers:
        cluster.wait(worker, timeout=120)
        assert "waits for follower shards [1] to join" in worker.stderr(), worker.stderr()
    cluster.wait(leader, timeout=60)
    cluster.wait(follower, timeout=30)
    # One line per worker, not one per REGISTER it sent again meanwhile.
    assert leader.stderr().count("is welcomed once shards") == WORKERS, leader.stderr()


@pytest.mark.parametrize("status", ["silent", "not forming"])
def test_a_worker_still_gives_up_on_a_server_that_does_not_say_it_waits_for_shards(
    zmq_context: zmq.Context, status: str
) -> None:
    """A stand-in that never answers REGISTER, and answers STATUS not at all or without
    follower shards to wait for: the worker gives up after its retries and one STATUS ask,
    with the "no reply" error, as before."""
    server = zmq_context.socket(zmq.ROUTER)
    server.setsockopt(zmq.LINGER, 0)
    endpoint = f"tcp://127.0.0.1:{server.bind_to_random_port('tcp://127.0.0.1')}"
    stopping = threading.Event()
    asked: list[str] = []

    def serve() -> None:
        while not stopping.is_set():
            if server.poll(50):
                identity, *frames = server.recv_multipart()
                message = decode(frames)
                asked.append(type(message).__name__)
                if isinstance(message, Status) and status == "not forming":
                    reply = StatusReply({"phase": "waiting", "shards_joining": []})
                    server.send_multipart([identity, *encode(reply)])

    serving = threading.Thread(target=serve, daemon=True)
    serving.start()
    connection = ServerConnection(endpoint, timeout_s=0.5, retries=1)
    try:
        started = time.monotonic()
        with pytest.raises(NoReply, match="no reply from the server"):
            ask_to_join(connection, Register("w", "h", "cpu", os.getpid(), "p", all_fingerprints()))
        # A guard against a hang, loose for a loaded machine; what was asked is the claim.
        assert time.monotonic() - started < 60
        assert asked == ["Register", "Register", "Status"], asked
    finally:
        stopping.set()
        serving.join(timeout=5)
        connection.close()
        server.close(linger=0)


HELD = Register("raw", "localhost", "cpu", os.getpid(), "p", all_fingerprints())


def hold_a_register_then_start_the_follower(
    cluster: Cluster, zmq_context: zmq.Context, *options: str
) -> tuple[Proc, str, RawClient]:
    """A 2-shard leader (with `options`) holding HELD, sent on the client returned, until the
    follower shard started now has joined."""
    leader, endpoint = cluster.start_server(
        "--model", "lenet", "--workers", "1", "--train-limit", "64", "--test-limit", "20",
        "--shard", "0", "--num-shards", "2", *options,
    )  # fmt: skip
    raw = RawClient(zmq_context, endpoint)
    raw.socket.send_multipart(encode(HELD))
    wait_for_log(leader, "is welcomed once shards", timeout=30)
    cluster.start_follower(endpoint)
    return leader, endpoint, raw


def test_a_held_worker_that_asks_again_as_the_shards_join_gets_the_same_welcome(
    cluster: Cluster, zmq_context: zmq.Context
) -> None:
    """A worker asks again on the socket whose REGISTER the leader holds. If the shards join
    between the two, the held REGISTER is welcomed and the second one reaches a formed job:
    it used to make a second worker, one that was never heard from and held a slot (and a
    place in the first epoch) until it was declared dead."""
    _, endpoint, raw = hold_a_register_then_start_the_follower(cluster, zmq_context)
    first = raw.receive("the held REGISTER's WELCOME")
    again = raw.request(HELD)
    assert isinstance(first, Welcome) and again == first, (first, again)
    status = RawClient(zmq_context, endpoint).request(Status())
    assert isinstance(status, StatusReply)
    assert [w["id"] for w in status.status["workers"]] == [first.worker_id], status.status


def test_a_held_worker_that_asks_again_on_a_new_socket_gets_the_same_welcome(
    cluster: Cluster, zmq_context: zmq.Context
) -> None:
    """After each silent --timeout a worker gives its socket up and asks again on a new one,
    after a pause of up to 8 s. Shards that join during that pause welcome the held REGISTER
    on the socket given up, so the leader made a second record of the same process when it
    asked again: with --max-workers 1 (or --max-workers equal to --workers), that REGISTER
    was refused `job-full` ("raise --max-workers") and the worker exited 1, and the leader
    waited for workers for ever. The same WELCOME must go to the new socket, once."""
    leader, endpoint, given_up = hold_a_register_then_start_the_follower(
        cluster, zmq_context, "--max-workers", "1"
    )
    wait_for_log(leader, "all 2 shards have joined", timeout=60)
    first = given_up.receive("the held REGISTER's WELCOME, sent to the socket given up")
    again = RawClient(zmq_context, endpoint).request(HELD)
    assert isinstance(first, Welcome) and again == first, (first, again)
    status = RawClient(zmq_context, endpoint).request(Status())
    assert isinstance(status, StatusReply)
    assert [w["id"] for w in status.status["workers"]] == [first.worker_id], status.status
    # Another process is another worker: the job is full.
    stranger = RawClient(zmq_context, endpoint).register()
    assert isinstance(stranger, Error) and stranger.code == "job-full", stranger


def test_a_worker_reads_no_second_welcome_as_the_reply_to_its_pull(
    zmq_context: zmq.Context,
) -> None:
    """A stand-in leader that holds the REGISTER, says it waits for shards, then welcomes
    the held REGISTER and the one asked again alike (as psserver.coordinator.admission does). The
    worker takes the first WELCOME and drops the second: its first PULL used to read it, and the
    worker stopped with "expected WEIGHTS, got Welcome"."""
    server = zmq_context.socket(zmq.ROUTER)
    server.setsockopt(zmq.LINGER, 0)
    endpoint = f"tcp://127.0.0.1:{server.bind_to_random_port('tcp://127.0.0.1')}"
    stopping = threading.Event()
    welcome = Welcome(1, "t" * 32, 1.0, {})
    asked: list[str] = []

    def serve() -> None:
        registers = 0
        while not stopping.is_set():
            if not server.poll(50):
                continue
            identity, *frames = server.recv_multipart()
            message = decode(frames)
            asked.append(type(message).__name__)
            if isinstance(message, Status) and asked.count("Status") == 1:
                reply = StatusReply({"phase": "waiting", "shards_joining": [1]})
                server.send_multipart([identity, *encode(reply)])
                server.send_multipart([identity, *encode(welcome)])  # the shards joined
            elif isinstance(message, Register):
                registers += 1
                if registers > 2:  # the two the worker's retries sent are held
                    server.send_multipart([identity, *encode(welcome)])
            else:
                server.send_multipart([identity, *encode(Error("test", type(message).__name__))])

    serving = threading.Thread(target=serve, daemon=True)
    serving.start()
    connection = ServerConnection(endpoint, timeout_s=0.5, retries=1)
    try:
        register = Register("w", "h", "cpu", os.getpid(), "p", all_fingerprints())
        assert ask_to_join(connection, register) == welcome
        with pytest.raises(RequestFailed, match=r"refused Status \(test\): Status"):
            connection.request(Status())  # answered by its own reply, not a stray WELCOME
    finally:
        stopping.set()
        serving.join(timeout=5)
        connection.close()
        server.close(linger=0)


def test_a_follower_started_before_its_leader_says_whom_it_waits_for(cluster: Cluster) -> None:
    """A follower started by hand before its leader said nothing for --leader-timeout (10
    minutes by default), then failed. It says whom it waits for after a few seconds; when the
    time is up, what to do."""
    leader = f"tcp://127.0.0.1:{free_port()}"
    follower = cluster.start_follower(leader, "--leader-timeout", "7")
    wait_for_log(follower, f"shard 1: waiting for its leader at {leader} to answer", timeout=30)
    cluster.wait(follower, timeout=60, expect_code=1)
    last = follower.stderr().strip().splitlines()[-1]
    assert last == (
        f"Error: shard 1: no answer from the leader at {leader} in 7 s; start ps-server "
        "--shard 0 there first, or check --leader"
    ), follower.stderr()
