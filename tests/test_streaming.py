"""Weight streaming: in sync mode each applied bucket goes back at once to the workers that sent
parts of it (a WEIGHTS with a bucket), before their PUSH_ACK, and a pull that names the version they
received whole gets WEIGHTS without the parameters. Exact values with a raw client; the
worker's side in process. Whole runs with streaming are checked bit for bit against runs
without it in tests/test_buckets.py."""

import json
import threading
import time

import pytest
import torch
import zmq

from common.errors import ServerError
from common.job import JobSpec
from common.wire.protocol import (
    Message,
    Pull,
    Push,
    PushAck,
    Status,
    StatusReply,
    Stop,
    Weights,
    decode,
    encode,
)
from psserver.serving.socket import send_tracked
from psserver.serving.streaming import WeightStreamer
from psserver.store.optimizer import OptimizerSpec
from psserver.store.parameters import ParameterStore
from psworker.connection.shards import ShardClients
from psworker.connection.streaming import ParamLoader, WeightStream
from tests.harness import Cluster, kill
from tests.raw_peers import (
    RawClient,
    hand_driven_follower,
    slice_weights,
    streamed_bucket,
)

BUCKETS = ["--bucket-mb", "0.15"]  # lenet (129k values) in three buckets
NO_INDICES = torch.empty(0, dtype=torch.int32)
QUIET_MS = 300  # how long "nothing arrives" is watched for


class StreamingClient(RawClient):
    """A raw worker that pushes integer gradients, whole or in parts."""

    def join(self) -> JobSpec:
        welcome = self.register()
        self.worker_id = welcome.worker_id  # type: ignore[union-attr]
        return JobSpec.from_dict(welcome.job)  # type: ignore[union-attr]

    def pull(self, have_version: int = -1) -> Weights:
        weights = self.request(Pull(self.worker_id, self.token, have_version))
        assert isinstance(weights, Weights), weights
        return weights

    def part(self, job: JobSpec, w: Weights, bucket: int, grads: torch.Tensor) -> None:
        lo, hi = job.bucket_range(bucket)
        message = Push(
            self.worker_id, self.token, w.version, w.epoch, w.batch, 8, 0.0, 0, grads[lo:hi],
            NO_INDICES, torch.empty(0), 0, 0, bucket,
        )  # fmt: skip
        self.send_frames([bytes(f) for f in encode(message)])

    def push(self, job: JobSpec, w: Weights, grads: torch.Tensor, parts: int = 0) -> None:
        values = torch.empty(0) if parts else grads
        message = Push(
            self.worker_id, self.token, w.version, w.epoch, w.batch, 8, 0.0, 0, values,
            NO_INDICES, torch.zeros(job.num_buffers), parts,
        )  # fmt: skip
        self.send_frames([bytes(f) for f in encode(message)])

    def settle(self) -> None:
        """Return once the server has handled everything sent so far (one connection keeps
        its order)."""
        assert isinstance(self.request(Status()), StatusReply)

    def expect_quiet(self) -> None:
        assert not self.socket.poll(QUIET_MS), decode_next(self)


def decode_next(client: RawClient) -> Message:
    return client.receive("anything")


def streamed(client: RawClient, version: int, bucket: int) -> torch.Tensor:
    part = client.receive(f"bucket {bucket} of version {version}")
    assert isinstance(part, Weights), part
    assert (part.version, part.shard, part.bucket) == (version, 0, bucket)
    return part.params.clone()


def test_applied_buckets_stream_to_part_senders_and_pulls_leave_them_out(
    cluster: Cluster, zmq_context: zmq.Context
) -> None:
    summary = cluster.workdir / "summary.json"
    server, endpoint = cluster.start_server(
        "--mode", "sync", "--model", "lenet", "--workers", "2", "--lr", "1", "--momentum", "0",
        "--weight-decay", "0", "--max-steps", "2", "--train-limit", "64", "--batch-size", "8",
        "--test-limit", "20", "--summary", str(summary), *BUCKETS,
    )  # fmt: skip
    a, b = StreamingClient(zmq_context, endpoint), StreamingClient(zmq_context, endpoint)
    job, _ = a.join(), b.join()
    assert job.num_buckets == 3
    a.send_frames([bytes(f) for f in encode(Pull(a.worker_id, a.token))])
    start_b = b.pull()
    start_a = a.receive("the first WEIGHTS")
    assert isinstance(start_a, Weights) and not start_a.streamed
    assert not start_b.streamed and torch.equal(start_a.params, start_b.params)

    generator = torch.Generator().manual_seed(2)
    grads_a, grads_b = (
        torch.randint(-8, 9, (job.num_params,), generator=generator).float() for _ in range(2)
    )
    # Two gradients of 8 samples each: the mean is exact in float32, and so is lr 1.
    expected = start_a.params - (grads_a * 0.5 + grads_b * 0.5)

    # A sends bucket 2, B its whole gradient: bucket 2 is complete and applied, and goes to
    # A, who sent parts. B pushed whole and is not streamed to.
    a.part(job, start_a, 2, grads_a)
    a.settle()
    b.push(job, start_b, grads_b)
    lo, hi = job.bucket_range(2)
    assert torch.equal(streamed(a, 1, 2), expected[lo:hi])
    # The other buckets are applied as A's parts come, each streamed before A's PUSH_ACK.
    a.part(job, start_a, 1, grads_a)
    a.part(job, start_a, 0, grads_a)
    a.push(job, start_a, grads_a, parts=3)
    for bucket in (1, 0):
        lo, hi = job.bucket_range(bucket)
        assert torch.equal(streamed(a, 1, bucket), expected[lo:hi])
    for client in (a, b):
        ack = client.receive("PUSH_ACK")
        assert isinstance(ack, PushAck) and ack.version == 1, ack
    b.expect_quiet()

    # A holds version 1 and says so: no parameters. B claims it too, but was sent nothing:
    # it gets them all. Only what the server sent and the worker names together counts.
    pulled_a = a.pull(have_version=1)
    assert pulled_a.streamed and pulled_a.params.numel() == 0 and pulled_a.version == 1
    pulled_b = b.pull(have_version=1)
    assert not pulled_b.streamed and torch.equal(pulled_b.params, expected)

    # Step 2: A is streamed again but does not say so, and gets the parameters in full.
    for bucket in (2, 1, 0):
        a.part(job, pulled_a, bucket, grads_a)
    a.push(job, pulled_a, grads_a, parts=3)
    b.push(job, pulled_b, grads_b)
    expected -= grads_a * 0.5 + grads_b * 0.5
    buckets = set()
    for _ in range(3):  # all at once, when B's push completes them
        part = a.receive("a bucket of version 2")
        assert isinstance(part, Weights) and part.version == 2 and part.bucket >= 0, part
        lo, hi = job.bucket_range(part.bucket)
        assert torch.equal(part.params, expected[lo:hi])
        buckets.add(part.bucket)
    assert buckets == {0, 1, 2}
    for client in (a, b):
        ack = client.receive("PUSH_ACK")
        assert isinstance(ack, PushAck) and ack.version == 2, ack
    for client in (a, b):  # training is over
        stop = client.request(Pull(client.worker_id, client.token))
        assert isinstance(stop, Stop), stop
        client.close()
    cluster.wait(server, timeout=60)
    result = json.loads(summary.read_text())
    assert result["streamed_pulls"] == 1
    assert result["streamed_bytes"] == 2 * 4 * job.num_params
    kill(server)


# ---- the worker's side -------------------------------------------------------------------


def copy_into(params: torch.Tensor) -> ParamLoader:
    """Loads weights into a plain flat tensor by copying, as a GPU worker's model does."""

    def load(lo: int, values: torch.Tensor) -> None:
        params[lo : lo + values.numel()].copy_(values)

    return load


def stream_job(bounds: tuple[int, ...] = (0, 4, 10)) -> JobSpec:
    return JobSpec(
        "sync", "lenet", "embedded", 3, 8, 0, None, 96, 4, 1, None, 10, 0, "none",
        bucket_bounds=bounds,
    )  # fmt: skip


def test_the_worker_copies_streamed_buckets_and_knows_when_a_version_is_whole() -> None:
    params = torch.zeros(10)
    stream = WeightStream(stream_job(), copy_into(params))
    stream.accept(streamed_bucket(5, 1, torch.arange(6.0)))
    assert stream.whole_version() == -1  # bucket 0 is missing
    stream.accept(streamed_bucket(5, 0, torch.full((4,), 9.0)))
    assert stream.whole_version() == 5
    assert params.tolist() == [9.0] * 4 + [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    # A bucket of the next version starts the count over.
    stream.accept(streamed_bucket(6, 0, torch.ones(4)))
    assert stream.whole_version() == -1
    stream.accept(streamed_bucket(6, 1, torch.ones(6)))
    assert stream.whole_version() == 6 and params.tolist() == [1.0] * 10
    stream.forget()
    assert stream.whole_version() == -1


@pytest.mark.parametrize(
    ("part", "says"),
    [
        (streamed_bucket(1, 2, torch.ones(6)), "bucket 2, the job has 2"),
        (streamed_bucket(1, -1, torch.ones(6)), "bucket -1"),
        (streamed_bucket(1, 1, torch.ones(5)), "expected 6 x torch.float32"),
        (streamed_bucket(1, 1, torch.ones(6, dtype=torch.float16)), "expected 6 x torch.float32"),
        (streamed_bucket(1, 1, torch.ones(6), shard=1), "a bucket of shard 1's slice"),
    ],
)
def test_a_streamed_bucket_that_does_not_fit_is_an_error(part: Weights, says: str) -> None:
    params = torch.zeros(10)
    stream = WeightStream(stream_job(), copy_into(params))
    with pytest.raises(ServerError, match=says):
        stream.accept(part)
    assert params.tolist() == [0.0] * 10 and stream.whole_version() == -1


# ---- the server's books ------------------------------------------------------------------


def test_the_server_leaves_weights_out_only_when_its_books_and_the_worker_agree() -> None:
    store = ParameterStore("lenet", seed=0, optimizer=OptimizerSpec(lr=1.0))
    streamer = WeightStreamer(store, [(0, 10), (10, store.params.numel())])

    def stream_all(worker_id: int) -> None:
        for bucket in (1, 0):
            part = streamer.part([worker_id], bucket, store.version)
            lo, hi = streamer.buckets[bucket]
            assert torch.equal(part.params, store.params[lo:hi])

    stream_all(1)
    streamer.part([2], 1, store.version)  # worker 2 got one bucket of two
    for worker_id in (1, 2):
        streamer.claim(worker_id, store.version)
    assert streamer.covers(1) and not streamer.covers(2)
    assert not streamer.covers(1), "a claim is good for one pull"
    streamer.claim(1, store.version + 1)  # a version the server is not at
    assert not streamer.covers(1)
    # An abandoned step streamed buckets that its version number never got: forget them.
    stream_all(1)
    streamer.reset()
    streamer.claim(1, store.version)
    assert not streamer.covers(1)
    stream_all(1)
    streamer.forget(1)  # the worker left or died
    streamer.claim(1, store.version)
    assert not streamer.covers(1)
    streamer.part([1, 2], 0, store.version + 1)  # one message, noted for both
    streamer.part([1, 2], 1, store.version + 1)
    store.count_update()
    for worker_id in (1, 2):
        streamer.claim(worker_id, store.version)
        assert streamer.covers(worker_id)


def test_one_bucket_goes_to_several_workers_as_one_shared_tracked_message(
    zmq_context: zmq.Context,
) -> None:
    router = zmq_context.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    peers = []
    for name in (b"w1", b"w2"):
        peer = zmq_context.socket(zmq.DEALER)
        peer.setsockopt(zmq.IDENTITY, name)
        peer.connect(f"tcp://127.0.0.1:{port}")
        peer.send(b"hello")  # the ROUTER learns the identity
        assert router.recv_multipart(copy=True) == [name, b"hello"]
        peers.append(peer)
    params = torch.arange(1000, dtype=torch.float32)
    trackers = send_tracked(router, [b"w1", b"w2"], streamed_bucket(3, 1, params))
    assert len(trackers) == 1, "one frame and one tracker, whatever the number of workers"
    for peer in peers:
        assert peer.poll(5000), "the streamed bucket did not arrive"
        part = decode(peer.recv_multipart())
        assert isinstance(part, Weights) and (part.version, part.bucket) == (3, 1)
        assert torch.equal(part.params, params)
    trackers[0].wait(5)  # ZeroMQ is done with the weights once both sends are
    for socket in (*peers, router):
        socket.close(linger=0)


class FakeTracker:
    """Stands in for zmq.MessageTracker: a send that is done once someone waits for it."""

    def __init__(self) -> None:
        self.done = self.waited = False

    def wait(self, timeout: float) -> None:
        self.waited = self.done = True


def test_an_update_waits_only_for_the_sends_of_its_own_range() -> None:
    # Streamed buckets are sent zero-copy from the live weights, and the next bucket's
    # update must not wait for them: only an update of the same range has to.
    store = ParameterStore("lenet", seed=0, optimizer=OptimizerSpec(lr=1.0))
    store.publish_live = True
    bucket_a, bucket_b, pull = FakeTracker(), FakeTracker(), FakeTracker()
    store.track_send([bucket_a], 0, 10)  # type: ignore[list-item]
    store.track_send([bucket_b], 10, 20)  # type: ignore[list-item]
    store.wait_for_sends(10, 20)
    assert bucket_b.waited and not bucket_a.waited
    store.track_send([pull])  # type: ignore[list-item]  # a whole WEIGHTS: every update waits
    store.wait_for_sends(30, 40)
    assert pull.waited and not bucket_a.waited
    store.wait_for_sends()
    assert bucket_a.waited


def test_a_worker_takes_streamed_follower_slices_and_asks_again_when_one_is_missing(
    zmq_context: zmq.Context,
) -> None:
    """A hand-driven follower (a ROUTER) streams the worker's slice of [0, 4) in two buckets
    and answers the pull `streamed`: the worker keeps what it was sent. When it claims a
    streamed version the worker does not hold whole, the worker asks for the parameters."""

    follower, job = hand_driven_follower(zmq_context, slice_bucket_bounds=((0, 1, 4),))
    params = torch.zeros(10)
    shards = ShardClients(job, copy_into(params), 10, 0, None, liveness=time.monotonic)

    def next_pull() -> tuple[bytes, Pull]:
        assert follower.poll(10_000), "no PULL from the worker"
        identity, *frames = follower.recv_multipart()
        pull = decode(frames)
        assert isinstance(pull, Pull) and pull.shard == 1, pull
        return identity, pull

    def send(identity: bytes, message: Message) -> None:
        follower.send_multipart([identity, *encode(message)])

    try:
        shards.request_slices(7, "t7", 3)
        identity, pull = next_pull()
        # It claims the version it asks for: what is streamed comes before the answer.
        assert (pull.worker_id, pull.min_version, pull.have_version) == (7, 3, 3)
        send(identity, streamed_bucket(3, 1, torch.full((3,), 2.0), shard=1))
        send(identity, streamed_bucket(3, 0, torch.full((1,), 1.0), shard=1))
        send(identity, slice_weights(3, torch.empty(0), streamed=True))
        shards.receive_slices(7, "t7", 3)
        assert params.tolist() == [1.0, 2.0, 2.0, 2.0] + [0.0] * 6

        # Version 4: only bucket 1 arrives, yet the follower says it streamed everything.
        shards.request_slices(7, "t7", 4)
        identity, _ = next_pull()
        send(identity, streamed_bucket(4, 1, torch.full((3,), 5.0), shard=1))
        send(identity, slice_weights(4, torch.empty(0), streamed=True))
        pulled: list[Pull] = []

        def answer_the_second_pull() -> None:
            again, pull = next_pull()
            pulled.append(pull)
            send(again, slice_weights(4, torch.arange(4.0)))

        helper = threading.Thread(target=answer_the_second_pull)
        helper.start()
        shards.receive_slices(7, "t7", 4)
        helper.join(timeout=10)
        assert pulled[0].have_version == -1 and pulled[0].min_version == 4
        assert params.tolist() == [0.0, 1.0, 2.0, 3.0] + [0.0] * 6
    finally:
        shards.close()
        follower.close(linger=0)
