"""A follower shard takes slices only from the job's workers (psserver.shards.roster): the leader
tells it who they are. A flood of slice pushes under made-up workers is refused and staged nowhere,
so it cannot push a real worker's slice out before its commit: the job ends bit for bit where
it ends without the flood."""

import dataclasses
import random
import threading
import time
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
import zmq

from common.errors import RequestRejected
from common.job import JobSpec
from common.wire.protocol import (
    Error,
    Leave,
    Message,
    Push,
    PushAck,
    Register,
    Roster,
    Stop,
    Weights,
    Welcome,
    decode,
    encode,
)
from psserver.coordinator.admission import Admission
from psserver.coordinator.membership import Membership
from psserver.shards.follower import SliceServer
from psserver.shards.joining import FollowerConfig
from psserver.shards.roster import WorkerRoster, new_worker_key, worker_token
from tests.harness import Cluster, free_port
from tests.raw_peers import RawClient, slice_pull, slice_push
from tests.test_sharding import JOB, assert_identical
from tests.test_step_plan import recorded_shard_group

TINY = torch.zeros(1)


def made_up_push(rng: random.Random) -> Push:
    return slice_push(rng.randint(1, 10**6), f"{rng.getrandbits(128):032x}", 0, 0, 0, TINY)


def test_the_roster_takes_its_workers_and_newcomers_and_refuses_the_rest() -> None:
    key = new_worker_key()
    roster = WorkerRoster(key, shard=1)
    roster.update(Roster("leader", [1, 3], 4))
    for worker_id in (1, 3, 4, 9):  # 4 and 9 registered after this roster was sent
        roster.authenticate(worker_id, worker_token(key, worker_id))
    with pytest.raises(RequestRejected, match="has left the job or was declared dead"):
        roster.authenticate(2, worker_token(key, 2))
    with pytest.raises(RequestRejected, match="not registered with this job"):
        roster.authenticate(1, worker_token(new_worker_key(), 1))  # another job's token for id 1
    with pytest.raises(RequestRejected, match="not registered with this job"):
        roster.authenticate(5, "f" * 32)
    roster.update(Roster("leader", [3, 4], 5))  # 1 left
    with pytest.raises(RequestRejected) as refused:
        roster.authenticate(1, worker_token(key, 1))
    assert refused.value.code == "unknown-worker"
    # A roster that takes back ids already handed out is not the leader's.
    with pytest.raises(RequestRejected, match="next id"):
        roster.update(Roster("leader", [3], 4))
    with pytest.raises(RequestRejected, match="next id"):
        roster.update(Roster("leader", [3, 7], 6))


def test_the_leader_sends_the_roster_on_each_change_and_before_the_welcome(
    zmq_context: zmq.Context,
) -> None:
    group, follower = recorded_shard_group(zmq_context)
    membership = Membership(max_workers=4, worker_timeout=10)
    config = SimpleNamespace(model="lenet", heartbeat_interval=1.0)
    store = SimpleNamespace(fingerprint="f")
    job = JobSpec("async", "lenet", "embedded", 2, 8, 0, None, 64, 4, 1, None, 10, 0, "none")
    to_workers: list[Message] = []

    def send(identity: bytes, message: Message) -> None:
        to_workers.append(message)
        active = [w.worker_id for w in membership.active()]
        assert follower.sent[-1] == Roster(group.token, active, membership.next_id), "too late"

    admission = Admission(config, store, job, membership, group, send)
    register = Register("w", "h", "cpu", 1, "p", {"lenet": "f"})
    admission.on_register(b"a", register)
    # Another process: the same one asking again would get its WELCOME again (admission).
    admission.on_register(b"b", dataclasses.replace(register, process="q"))
    first, second = to_workers
    assert isinstance(first, Welcome) and isinstance(second, Welcome)
    assert first.token == worker_token(membership.token_key, first.worker_id)
    membership.leave(membership.workers[first.worker_id], "done")
    assert follower.sent[-1] == Roster(group.token, [second.worker_id], 3)
    membership.workers[second.worker_id].last_seen -= 60
    membership.reap(time.monotonic())
    assert follower.sent == [
        Roster(group.token, [1], 2),
        Roster(group.token, [1, 2], 3),
        Roster(group.token, [2], 3),
        Roster(group.token, [], 3),
    ]


def start_leader(cluster: Cluster, *args: str, name: str = "leader") -> str:
    _, endpoint = cluster.start_server(
        *JOB, "--shard", "0", "--num-shards", "2", "--workers", "1", "--batch-size", "8", *args,
        name=name,
    )  # fmt: skip
    return endpoint


def refused_within(shard: RawClient, request: Message, seconds: float) -> Error:
    """Ask until the follower refuses the worker (its roster comes from the leader)."""
    deadline = time.monotonic() + seconds
    while True:
        reply = shard.request(request)
        if isinstance(reply, Error) and reply.code == "unknown-worker":
            return reply
        assert time.monotonic() < deadline, f"still answered {reply} after {seconds} s"
        time.sleep(0.1)


def test_a_follower_stages_nothing_from_strangers_and_follows_the_leaders_roster(
    cluster: Cluster, zmq_context: zmq.Context
) -> None:
    """The follower runs in this process, against a real leader, so that its staging area can
    be looked at: nothing a stranger sends is staged, and a worker that left or died is
    refused from then on."""
    endpoint = start_leader(cluster, "--mode", "async", "--worker-timeout", "5")
    server = SliceServer(FollowerConfig(shard=1, num_shards=2, leader=endpoint))
    loop = threading.Thread(target=server.run, name="follower", daemon=True)
    loop.start()
    try:
        leaving, dying = RawClient(zmq_context, endpoint), RawClient(zmq_context, endpoint)
        welcome, doomed = leaving.register("leaving"), dying.register("dying")
        assert isinstance(welcome, Welcome) and isinstance(doomed, Welcome), (welcome, doomed)
        shard = RawClient(zmq_context, server.endpoint)
        pull = slice_pull(doomed.worker_id, doomed.token, 0)
        assert isinstance(shard.request(pull), Weights)
        rng = random.Random(5)
        replies = Counter()
        for _ in range(3 * server.max_staged):
            reply = shard.request(made_up_push(rng))
            replies[reply.code if isinstance(reply, Error) else type(reply).__name__] += 1
        forged = slice_push(welcome.worker_id, "0" * 32, 0, 0, 0, TINY)
        reply = shard.request(forged)  # a real worker's id without its token
        replies[reply.code if isinstance(reply, Error) else type(reply).__name__] += 1
        assert replies == {"unknown-worker": 3 * server.max_staged + 1}
        assert not server.staging.staged and not server.pulls.held

        # The real worker is taken at once, registered a moment ago as it is.
        lo, hi = server.lo, server.hi
        ack = shard.request(slice_push(welcome.worker_id, welcome.token, 0, 0, 0,
                                       torch.ones(hi - lo)))  # fmt: skip
        assert isinstance(ack, PushAck) and ack.applied, ack
        assert len(server.staging.staged) == 1
        # A known worker's refused slice is staged as refused, as before: its commit skips it.
        wrong = slice_push(welcome.worker_id, welcome.token, 0, 0, 2, torch.ones(3))
        error = shard.request(wrong)
        assert isinstance(error, Error) and error.code == "wrong-shape", error
        assert [s.refused for s in server.staging.staged.values()] == [False, True]
        pulled = shard.request(slice_pull(welcome.worker_id, welcome.token, 0))
        assert isinstance(pulled, Weights) and pulled.params.numel() == hi - lo

        # It leaves: the follower hears so from the leader and refuses it from then on.
        assert isinstance(leaving.request(Leave(welcome.worker_id, welcome.token, "done")), Stop)
        refused_within(shard, slice_pull(welcome.worker_id, welcome.token, 0), 10)
        late = slice_push(welcome.worker_id, welcome.token, 0, 0, 1, torch.ones(hi - lo))
        error = shard.request(late)
        assert isinstance(error, Error) and error.code == "unknown-worker", error
        assert len(server.staging.staged) == 2
        # The other sends no heartbeat: declared dead after 5 s, it is refused too.
        refused_within(shard, pull, 20)
    finally:
        server.stopped = True  # the loop ends within a poll, and closes its sockets
        loop.join(timeout=10)
    assert not loop.is_alive()


class Flood(threading.Thread):
    """Tiny slice pushes under made-up worker ids and tokens, as fast as they are answered."""

    def __init__(self, context: zmq.Context, endpoint: str) -> None:
        super().__init__(name="flood", daemon=True)
        self.context, self.endpoint = context, endpoint
        self.stopping = threading.Event()
        self.replies: Counter[str] = Counter()

    def run(self) -> None:
        rng = random.Random(7)
        socket = self.context.socket(zmq.DEALER)  # made on the thread that uses it
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(self.endpoint)
        try:
            while not self.stopping.is_set():
                for _ in range(20):
                    socket.send_multipart(encode(made_up_push(rng)))
                deadline = time.monotonic() + 1.0
                answered = 0
                while answered < 20 and time.monotonic() < deadline:
                    if socket.poll(50):
                        reply = decode(socket.recv_multipart())
                        self.replies[reply.code if isinstance(reply, Error) else "other"] += 1
                        answered += 1
        finally:
            socket.close(linger=0)


def train_async(cluster: Cluster, zmq_context: zmq.Context, name: str, flood: bool) -> dict:
    """One async worker, two shards; the follower at a known port, flooded if asked."""
    checkpoints = cluster.workdir / name
    port = free_port()
    endpoint = start_leader(
        cluster, "--mode", "async", "--no-staleness-lr", "--epochs", "1", "--batch-size", "32",
        "--checkpoint-dir", str(checkpoints), name=f"{name}-leader",
    )  # fmt: skip
    cluster.start_follower(endpoint, name=f"{name}-follower", bind=f"tcp://127.0.0.1:{port}")
    flooder = Flood(zmq_context, f"tcp://127.0.0.1:{port}")
    if flood:
        flooder.start()
    cluster.start_worker(endpoint, name=f"{name}-worker")
    try:
        cluster.wait_all(timeout=240)
    finally:
        flooder.stopping.set()
        if flood:
            flooder.join(timeout=10)
    if flood:
        assert flooder.replies["unknown-worker"] > 100, flooder.replies
        assert set(flooder.replies) == {"unknown-worker"}, flooder.replies
    logs = "".join(proc.stderr() for proc in cluster.procs)
    assert "applied without them" not in logs
    return torch.load(checkpoints / "latest.pt", weights_only=True)


def test_a_flood_of_strangers_slices_changes_nothing_in_async_mode(
    cluster: Cluster, zmq_context: zmq.Context
) -> None:
    """Staged "refused", the flood used to push the worker's slices out before their commits
    (--max-workers slices are kept): the follower then applied zero for them after 30 s."""
    quiet = train_async(cluster, zmq_context, "quiet", flood=False)
    flooded = train_async(cluster, zmq_context, "flooded", flood=True)
    assert_identical(quiet, flooded)
