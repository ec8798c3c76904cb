"""A push the server took from a worker it then forgets: applied once, and said so.

A top-k worker keeps what it sent until the server answers; a push the server did not apply
goes back into its residual (`GradientCompressor.take_back`), to be sent again. So the answer
must be true: a push summed into a sync step, or applied by async, must be acknowledged as
applied, also when the worker's heartbeats stopped meanwhile and when it asks again after the
server forgot it. It used to be answered "unknown-worker", which the worker reads as "not
applied": the gradient was applied and also kept, so it was applied twice.

The worker's side: a push whose wait the heartbeat's "unknown-worker" ends is sent once more,
and the answer to it is the push's.

A push, or a pull the leader holds, sent again on a new socket (after --timeout) is answered on
that socket, also when the server reads the first one after it.

Raw workers (tests.raw_peers.RawClient) push integer top-k gradients with lr 1 and no momentum,
so the weights move by exactly the sum the server should apply (torch.equal).
"""

import logging
import threading
import time
from collections.abc import Iterator

import pytest
import torch
import zmq

from common.job import JobSpec
from common.sharding import split_gradient
from common.wire.protocol import (
    Error,
    Heartbeat,
    HeartbeatAck,
    Message,
    Pull,
    Push,
    PushAck,
    Weights,
    Welcome,
    decode,
    encode,
)
from psworker.connection.requests import NoReply, RequestFailed, ServerConnection
from tests.harness import Cluster, Proc, wait_for_log, wait_for_state
from tests.raw_peers import Heartbeats, RawClient, slice_pull, slice_push

pytestmark = [pytest.mark.fault, pytest.mark.timeout(180)]
TIMEOUT_S = 2  # --worker-timeout: how long a silent worker lives
JOB = [
    "--model", "lenet", "--workers", "2", "--lr", "1", "--momentum", "0", "--weight-decay",
    "0", "--train-limit", "64", "--batch-size", "8", "--test-limit", "20", "--worker-timeout",
    str(TIMEOUT_S), "--push-credits", "0", "--compress", "topk:0.01",
]  # fmt: skip


class Peers:
    """The hand-driven workers and sockets of one test (the `peers` fixture), and the
    heartbeats that keep those that beat alive: all stopped and closed when the test ends,
    however it ends."""

    def __init__(self, context: zmq.Context) -> None:
        self.context = context
        self.clients: list[RawClient] = []
        self.beats: Heartbeats | None = None

    def client(self, endpoint: str) -> RawClient:
        """A socket of its own: a worker's connection, or the new one it sends again on."""
        client = RawClient(self.context, endpoint, timeout_s=15)
        self.clients.append(client)
        return client

    def worker(self, endpoint: str, name: str, beating: bool = True) -> "RawWorker":
        """A registered worker, kept alive by heartbeats unless `beating` is False (it is
        silent from the start, and the server declares it dead after --worker-timeout)."""
        worker = RawWorker(self, endpoint, name)
        if beating:
            if self.beats is None:
                self.beats = Heartbeats(endpoint)
            self.beats.add(worker.id, worker.token)
        return worker

    def silence(self, worker: "RawWorker") -> None:
        """Its heartbeats stop from now on."""
        assert self.beats is not None
        self.beats.workers.remove((worker.id, worker.token))

    def close(self) -> None:
        if self.beats is not None:
            self.beats.stop()
        for client in self.clients:
            client.close()


@pytest.fixture
def peers(zmq_context: zmq.Context) -> Iterator[Peers]:
    made = Peers(zmq_context)
    yield made
    made.close()


class RawWorker:
    """A hand-driven worker: its leader connection and, with two shards, the follower's."""

    def __init__(self, peers: Peers, endpoint: str, name: str) -> None:
        self.peers, self.endpoint = peers, endpoint
        self.leader = peers.client(endpoint)
        welcome = self.leader.register(name)
        assert isinstance(welcome, Welcome), welcome
        self.id, self.job = welcome.worker_id, JobSpec.from_dict(welcome.job)
        self.token = self.leader.token
        self.follower = (
            peers.client(self.job.shard_endpoints[0]) if self.job.num_shards > 1 else None
        )

    def weights(self, reply: Message) -> tuple[Weights, torch.Tensor]:
        """The WEIGHTS `reply`, and the whole flat vector (the follower's slice first)."""
        assert isinstance(reply, Weights), reply
        if self.follower is None:
            return reply, reply.params
        part = self.follower.request(slice_pull(self.id, self.token, reply.version))
        assert isinstance(part, Weights), part
        return reply, torch.cat([part.params, reply.params])

    def push(
        self, weights: Weights, values: torch.Tensor, indices: torch.Tensor,
        on: RawClient | None = None,
    ) -> Push:  # fmt: skip
        """Send a top-k gradient as ps-worker does (the follower's slice first, and its
        PUSH_ACK read); the leader's PUSH, sent `on` that socket (default: the worker's own),
        is returned unanswered, to be sent again."""
        pieces = split_gradient(values, indices, self.job.bounds, True)
        if self.follower is not None:
            values, indices = pieces[1]
            ack = self.follower.request(
                slice_push(self.id, self.token, weights.version, weights.epoch, weights.batch,
                           values, indices=indices)
            )  # fmt: skip
            assert isinstance(ack, PushAck) and ack.applied, ack
        push = Push(
            self.id, self.token, weights.version, weights.epoch, weights.batch, 8, 1.0, 0,
            *pieces[0], torch.zeros(self.job.num_buffers),
        )  # fmt: skip
        (on or self.leader).send_frames(encode(push))
        return push

    def ask_again(self, push: Push) -> Message:
        """The push once more on a new socket, as ps-worker retries after its timeout."""
        return self.peers.client(self.endpoint).request(push)


def top_k(job: JobSpec, positions: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Integer values at the given positions (as int32, as a top-k push carries them)."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randint(1, 9, (positions.numel(),), generator=generator).float()
    return values, positions.to(torch.int32)


def start(cluster: Cluster, shards: int, *args: str) -> tuple[Proc, str]:
    if shards == 1:
        return cluster.start_server(*JOB, *args)
    leader, endpoint = cluster.start_server(*JOB, *args, "--shard", "0", "--num-shards", "2")
    cluster.start_follower(endpoint)
    return leader, endpoint


@pytest.mark.parametrize("shards", [1, 2])
def test_a_sync_push_taken_before_its_worker_fell_silent_is_applied_once_and_acknowledged(
    cluster: Cluster, peers: Peers, shards: int
) -> None:
    """Worker A pushes, then falls silent for twice --worker-timeout while the step waits
    for B. The step applies A's gradient with B's (it was summed already), so A must hear
    `applied` on the socket it pushed on, and again when it asks once more after the server
    has declared it dead; only then is it forgotten."""
    server, endpoint = start(cluster, shards, "--mode", "sync", "--max-steps", "2")
    a = peers.worker(endpoint, "a", beating=False)  # after its push it is silent
    b = peers.worker(endpoint, "b")
    a.leader.send_frames(encode(Pull(a.id, a.token)))
    weights_b, before = b.weights(b.leader.request(Pull(b.id, b.token)))
    weights_a, _ = a.weights(a.leader.receive("A's first WEIGHTS"))
    num_params = a.job.num_params
    k = max(1, int(0.01 * num_params))
    positions = torch.randperm(num_params, generator=torch.Generator().manual_seed(0))
    values_a, indices_a = top_k(a.job, positions[:k], seed=1)  # disjoint positions
    values_b, indices_b = top_k(a.job, positions[k : 2 * k], seed=2)

    push_a = a.push(weights_a, values_a, indices_a)
    time.sleep(2 * TIMEOUT_S + 1)  # A is silent; the step holds its gradient
    b.push(weights_b, values_b, indices_b)
    ack_b = b.leader.receive("B's PUSH_ACK")
    assert isinstance(ack_b, PushAck) and ack_b.applied and ack_b.version == 1, ack_b
    ack_a = a.leader.receive("A's PUSH_ACK, on the socket it pushed on")
    assert isinstance(ack_a, PushAck) and ack_a.applied and ack_a.version == 1, ack_a
    wait_for_log(server, f"worker {a.id} (a) declared dead", timeout=10)
    again = a.ask_again(push_a)  # after the server forgot A
    assert isinstance(again, PushAck) and again.applied and again.version == 1, again
    forgotten = a.ask_again(Pull(a.id, a.token))  # type: ignore[arg-type]
    assert isinstance(forgotten, Error) and forgotten.code == "unknown-worker", forgotten

    _, after = b.weights(b.leader.request(Pull(b.id, b.token)))
    step = torch.zeros(num_params)  # the step's mean: each gradient weighted 8 / 16
    step.index_add_(0, indices_a.long(), values_a, alpha=0.5)
    step.index_add_(0, indices_b.long(), values_b, alpha=0.5)
    assert torch.equal(after, before - step)
    assert server.process.poll() is None, server.describe()


@pytest.mark.parametrize("first", ["the push", "the push sent again"])
def test_a_push_and_the_push_sent_again_are_answered_on_the_socket_the_worker_waits_on(
    cluster: Cluster, peers: Peers, first: str
) -> None:
    """ps-worker sends a PUSH that got no answer within --timeout again, on a new socket, and
    waits there. A server that was stopped meanwhile (SIGSTOP, a paused VM) reads both when it
    goes on, in either order: ZeroMQ takes turns between sockets. The step's PUSH_ACK must
    reach the new socket either way, and the gradient count once. It went to the socket read
    last, and when that was the old one the worker waited for ever."""
    server, endpoint = start(cluster, 1, "--mode", "sync", "--max-steps", "2")
    a, b = peers.worker(endpoint, "a"), peers.worker(endpoint, "b")
    retry = peers.client(endpoint)  # A's new socket
    a.leader.send_frames(encode(Pull(a.id, a.token)))  # answered once both are in
    weights_b, before = b.weights(b.leader.request(Pull(b.id, b.token)))
    weights_a, _ = a.weights(a.leader.receive("A's first WEIGHTS"))
    k = max(1, int(0.01 * a.job.num_params))
    values_a, indices_a = top_k(a.job, torch.arange(k) * 5, seed=6)
    values_b, indices_b = top_k(a.job, torch.arange(k) * 5 + 2, seed=7)

    def taken(status: dict) -> bool:
        return any(w["id"] == a.id and w["pushes"] == 1 for w in status["workers"])

    sockets = [a.leader, retry] if first == "the push" else [retry, a.leader]
    a.push(weights_a, values_a, indices_a, on=sockets[0])
    wait_for_state(server, endpoint, "A's push taken", taken)
    a.push(weights_a, values_a, indices_a, on=sockets[1])
    # Read before B's push: a socket's messages are read in order, and this one answered.
    beat = sockets[1].request(Heartbeat(a.id, a.token))
    assert isinstance(beat, HeartbeatAck), beat
    b.push(weights_b, values_b, indices_b)
    ack_b = b.leader.receive("B's PUSH_ACK")
    assert isinstance(ack_b, PushAck) and ack_b.applied and ack_b.version == 1, ack_b
    ack_a = retry.receive("A's PUSH_ACK, on the socket it sent the push again on")
    assert isinstance(ack_a, PushAck) and ack_a.applied and ack_a.version == 1, ack_a

    _, after = b.weights(b.leader.request(Pull(b.id, b.token)))
    step = torch.zeros(a.job.num_params)  # the step's mean: each gradient weighted 8 / 16
    step.index_add_(0, indices_a.long(), values_a, alpha=0.5)
    step.index_add_(0, indices_b.long(), values_b, alpha=0.5)
    assert torch.equal(after, before - step)  # A's gradient counted once
    assert server.process.poll() is None, server.describe()


@pytest.mark.parametrize("first", ["the pull", "the pull sent again"])
def test_a_held_pull_and_the_pull_sent_again_are_answered_on_the_socket_the_worker_waits_on(
    cluster: Cluster, peers: Peers, first: str
) -> None:
    """As above, for a PULL the leader holds (here until both workers are in): the WEIGHTS
    must reach the new socket whichever of the two the server reads last."""
    server, endpoint = start(cluster, 1, "--mode", "sync", "--max-steps", "2")
    a = peers.worker(endpoint, "a")
    retry = peers.client(endpoint)  # A's new socket
    sockets = [a.leader, retry] if first == "the pull" else [retry, a.leader]
    for socket in sockets:  # each read before the next is sent: its heartbeat answered
        socket.send_frames(encode(Pull(a.id, a.token)))
        beat = socket.request(Heartbeat(a.id, a.token))
        assert isinstance(beat, HeartbeatAck), beat
    b = peers.worker(endpoint, "b")
    weights_b = b.leader.request(Pull(b.id, b.token))
    assert isinstance(weights_b, Weights), weights_b
    weights_a = retry.receive("A's WEIGHTS, on the socket it sent the pull again on")
    assert isinstance(weights_a, Weights), weights_a
    assert (weights_a.version, weights_a.epoch) == (weights_b.version, weights_b.epoch)
    assert weights_a.rank != weights_b.rank  # each its own share of the step
    assert server.process.poll() is None, server.describe()


def test_a_worker_spared_until_its_step_closed_is_not_counted_into_the_next_epoch(
    cluster: Cluster, peers: Peers
) -> None:
    """A and C push, B never does. A falls silent and is spared (the step holds its push);
    then B falls silent too and is declared dead, and the step closes without B, and with it
    the epoch (one step an epoch). A must be declared dead right then, before the evaluation
    excuses everyone's silence and the next epoch counts who is ready: otherwise epoch 1
    starts with A in its roster, and its steps wait another --worker-timeout for it."""
    server, endpoint = start(
        cluster, 1, "--mode", "sync", "--workers", "3", "--train-limit", "24",
        "--min-workers", "1", "--epochs", "3",
    )  # fmt: skip
    a = peers.worker(endpoint, "a", beating=False)
    b, c = peers.worker(endpoint, "b"), peers.worker(endpoint, "c")
    for worker in (a, b):
        worker.leader.send_frames(encode(Pull(worker.id, worker.token)))
    weights_c, _ = c.weights(c.leader.request(Pull(c.id, c.token)))
    weights_a, _ = a.weights(a.leader.receive("A's first WEIGHTS"))
    k = max(1, int(0.01 * a.job.num_params))
    a.push(weights_a, *top_k(a.job, torch.arange(k) * 7, seed=4))
    c.push(weights_c, *top_k(a.job, torch.arange(k) * 7 + 3, seed=5))
    time.sleep(TIMEOUT_S + 1)  # A is silent past its timeout, and spared
    peers.silence(b)  # B falls silent: the step closes without it
    ack_a = a.leader.receive("A's PUSH_ACK, once the step closed without B")
    assert isinstance(ack_a, PushAck) and ack_a.applied, ack_a
    wait_for_log(server, "epoch 1 begins", timeout=30)
    log = server.stderr()
    assert f"epoch 1 begins: 1 worker [{c.id}]" in log, log
    assert log.index(f"worker {a.id} (a) declared dead") < log.index("epoch 1 begins"), log


def test_an_async_push_whose_ack_was_lost_is_acknowledged_again_after_the_worker_is_forgotten(
    cluster: Cluster, peers: Peers
) -> None:
    """Async applies A's push at once; its PUSH_ACK is lost with A's socket, and A falls
    silent until the server declares it dead. Asked again, the server must say `applied`
    (not "unknown-worker", which makes the worker take it back), and A's gradient is in the
    weights exactly once."""
    server, endpoint = start(cluster, 1, "--mode", "async", "--no-staleness-lr", "--max-steps", "3")
    a = peers.worker(endpoint, "a", beating=False)
    b = peers.worker(endpoint, "b")
    a.leader.send_frames(encode(Pull(a.id, a.token)))
    _, before = b.weights(b.leader.request(Pull(b.id, b.token)))
    weights_a, _ = a.weights(a.leader.receive("A's first WEIGHTS"))
    k = max(1, int(0.01 * a.job.num_params))
    values, indices = top_k(a.job, torch.arange(k) * 7, seed=3)
    push_a = a.push(weights_a, values, indices)
    wait_for_state(server, endpoint, "A's push applied", lambda status: status["step"] == 1)
    a.leader.close()  # its PUSH_ACK, if any, is lost with the socket
    wait_for_log(server, f"worker {a.id} (a) declared dead", timeout=10)
    again = a.ask_again(push_a)
    assert isinstance(again, PushAck) and again.applied and again.version == 1, again
    _, after = b.weights(b.leader.request(Pull(b.id, b.token)))
    expected = before.clone()
    expected.index_add_(0, indices.long(), -values)
    assert torch.equal(after, expected)


def test_a_push_of_an_abandoned_step_is_answered_not_applied_also_when_asked_again(
    cluster: Cluster, peers: Peers
) -> None:
    """--min-workers 2: A pushes and both fall silent, so the epoch cannot go on. A's
    gradient is dropped with the step: A hears `applied=False`, then and when it asks again
    after the server forgot it (the worker then rightly takes it back)."""
    server, endpoint = start(cluster, 1, "--mode", "sync", "--min-workers", "2", "--epochs", "2")
    a = peers.worker(endpoint, "a", beating=False)
    b = peers.worker(endpoint, "b", beating=False)
    a.leader.send_frames(encode(Pull(a.id, a.token)))
    b.weights(b.leader.request(Pull(b.id, b.token)))
    weights_a, _ = a.weights(a.leader.receive("A's first WEIGHTS"))
    k = max(1, int(0.01 * a.job.num_params))
    push_a = a.push(weights_a, *top_k(a.job, torch.arange(k), seed=4))
    dropped = a.leader.receive("A's PUSH_ACK after the abandon")
    assert isinstance(dropped, PushAck) and not dropped.applied, dropped
    wait_for_log(server, "cannot go on", timeout=10)
    wait_for_log(server, f"worker {a.id} (a) declared dead", timeout=10)
    again = a.ask_again(push_a)
    assert isinstance(again, PushAck) and not again.applied, again


def test_a_worker_asks_about_its_push_when_its_heartbeat_hears_it_was_forgotten(
    zmq_context: zmq.Context,
) -> None:
    """A stand-in server takes the PUSH and answers nothing; then the job's heartbeat hears
    "unknown-worker". The connection sends the PUSH once more at once, and returns the
    answer to it (here: applied), not the heartbeat's "unknown-worker", which would have
    made a top-k worker take the applied gradient back. A PULL still ends at once."""
    server = zmq_context.socket(zmq.ROUTER)
    server.setsockopt(zmq.LINGER, 0)
    endpoint = f"tcp://127.0.0.1:{server.bind_to_random_port('tcp://127.0.0.1')}"
    heard: list[Message] = []
    connection = ServerConnection(
        endpoint, timeout_s=60, retries=0, verdict=lambda: heard[0] if heard else None
    )
    try:
        empty = torch.empty(0)
        push = Push(3, "t", 5, 0, 5, 8, 1.0, 0, torch.ones(2), torch.tensor([0, 1]).int(), empty)
        connection.send(push)
        assert server.poll(10_000), "the PUSH never reached the stand-in"
        first, *frames = server.recv_multipart()
        assert isinstance(decode(frames), Push)
        threading.Timer(0.3, lambda: heard.append(Error("unknown-worker", "forgotten"))).start()

        asked: list[Message] = []

        def answer_the_second() -> None:
            if server.poll(10_000):
                identity, *again = server.recv_multipart()
                asked.append(decode(again))
                if identity != first:  # a new socket: the old one's reply is never read
                    server.send_multipart([identity, *encode(PushAck(6, 0, True))])

        answering = threading.Thread(target=answer_the_second)
        answering.start()
        started = time.monotonic()
        ack = connection.receive()
        answering.join(timeout=15)
        assert ack == PushAck(6, 0, True), ack
        again = asked[0]
        assert isinstance(again, Push) and (again.version, again.batch) == (5, 5), again
        assert torch.equal(again.grads, push.grads)
        # "At once": well under the connection's 60 s timeout, however loaded the machine.
        assert time.monotonic() - started < 30
        with pytest.raises(RequestFailed) as failed:
            connection.request(Pull(3, "t"))
        assert failed.value.code == "unknown-worker"
    finally:
        connection.close()
        server.close(linger=0)


@pytest.mark.parametrize("end", ["silent", "gone"])
def test_a_push_asked_about_again_ends_at_once_when_that_gets_no_answer_either(
    zmq_context: zmq.Context, end: str, caplog: pytest.LogCaptureFixture
) -> None:
    """As above, but the server dies right after its heartbeat said "unknown-worker": it never
    answers the PUSH sent once more (`silent`: it hangs; `gone`: its port is closed). The
    wait for that answer ignored the heartbeat, and each of --retries more attempts sent the
    PUSH again and waited its --timeout: --timeout x (retries + 1) before the NoReply. The
    PUSH is now sent again once only, and its wait ends one --timeout later, with a NoReply
    that says what the server said before it fell silent. Counted from the worker's own log
    (each PUSH it sends, each retry it announces), not timed: under load a clock cannot tell
    one --timeout from four."""
    server = zmq_context.socket(zmq.ROUTER)
    server.setsockopt(zmq.LINGER, 0)
    endpoint = f"tcp://127.0.0.1:{server.bind_to_random_port('tcp://127.0.0.1')}"
    heard: list[Message] = []
    timeout_s, retries = 1.0, 3
    connection = ServerConnection(
        endpoint, timeout_s, retries, verdict=lambda: heard[0] if heard else None
    )
    pushes: list[Message] = []
    stopping = threading.Event()

    def take_pushes() -> None:  # answers nothing
        while not stopping.is_set():
            if server.poll(50):
                pushes.append(decode(server.recv_multipart()[1:]))
                if end == "gone":
                    server.close(linger=0)
                    return

    taking = threading.Thread(target=take_pushes)
    try:
        empty = torch.empty(0)
        push = Push(3, "t", 5, 0, 5, 8, 1.0, 0, torch.ones(2), torch.tensor([0, 1]).int(), empty)
        connection.send(push)
        taking.start()
        heard.append(Error("unknown-worker", "forgotten"))
        started = time.monotonic()
        with caplog.at_level(logging.DEBUG, logger="ps.worker"), pytest.raises(NoReply) as silent:
            connection.receive()
        # A guard against a hang only: the counts below say whether the retries waited on.
        assert time.monotonic() - started < 60
        assert "unknown-worker" in str(silent.value), silent.value
        lines = [record.getMessage() for record in caplog.records]
        asked = [line for line in lines if line.startswith(f"asking {endpoint}: Push")]
        assert len(asked) == 1, lines  # the PUSH sent again; the first went before the capture
        assert not [line for line in lines if "retrying in" in line], lines
        assert silent.value.waited_s >= timeout_s  # the one sent again got its --timeout
        stopping.set()
        taking.join(timeout=5)
        # What reached the server: both PUSHes while it listens, the first only once gone.
        expected = [Push, Push] if end == "silent" else [Push]
        assert [type(message) for message in pushes] == expected, pushes
    finally:
        stopping.set()
        if taking.ident is not None:  # started: it must be done with the socket first
            taking.join(timeout=5)
        connection.close()
        server.close(linger=0)
