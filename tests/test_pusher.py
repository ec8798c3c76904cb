"""The worker's pusher with flow control, in-process: a worker that has no push credit asks for
one and goes on with backward. The follower shard's slice leaves during backward; the
leader's buckets wait until the go (a PUSH_ACK with `go`) is read, then go in order, ahead of
the PUSH. The connection is a real one whose leader and shard clients are stand-ins that log
what is sent and when."""

import threading
import time
from typing import Any, cast

import pytest
import torch
import zmq
from torch import nn

from common.catalog import build_model
from common.compression import CompressionSpec, GradientCompressor
from common.errors import ServerError
from common.job import JobSpec
from common.model.flat import FlatModel
from common.sharding import shard_bounds, shard_bucket_bounds
from common.wire.protocol import Message, Push, PushAck, Stop, Weights
from psworker.connection import Connection, Session
from psworker.connection.requests import ServerConnection
from psworker.connection.shards import ShardClients
from psworker.pusher import GradientPusher, NonFiniteGradient, OutgoingStep
from tests.raw_peers import hand_driven_follower, slice_push

BUCKET_NUMEL = 1_000  # LeNet's leader slice and the follower's then have several buckets each
GO = PushAck(0, 0, False, go=True)  # the leader's answer to PUSH_READY


class FakeLeader:
    """Logs every message sent; `receive` answers with the next of `replies`."""

    def __init__(self, log: list[tuple[Any, ...]], replies: list[Message]) -> None:
        self.log, self.replies = log, replies

    def send(self, message: Message) -> None:
        self.log.append(("leader", type(message).__name__))

    def post(self, message: Message) -> None:
        assert isinstance(message, Push) and message.shard == 0 and message.bucket >= 0
        self.log.append(("leader", "bucket", message.bucket))

    def receive(self) -> Message:
        reply = self.replies.pop(0)
        go = isinstance(reply, PushAck) and reply.go
        self.log.append(("leader reply", "go" if go else type(reply).__name__))
        return reply

    def reset(self) -> None:
        self.log.append(("leader reset",))


class FakeShards:
    def __init__(self, log: list[tuple[Any, ...]], answer: Stop | None = None) -> None:
        self.log, self.answer = log, answer

    def post_bucket(self, push: Push) -> None:
        assert push.bucket >= 0 and not push.parts and not push.buffers.numel()
        self.log.append(("shard", push.shard, push.bucket))

    def send_push(self, push: Push) -> None:
        assert push.bucket == -1 and not push.buffers.numel()
        if push.parts:  # the PUSH that completes the buckets
            assert not push.grads.numel()
            self.log.append(("shard complete", push.shard, push.parts))
        else:
            self.log.append(("shard", push.shard, -1))

    def finish_pushes(self) -> Stop | None:
        self.log.append(("shards answered",))
        return self.answer

    def cancel(self) -> None:
        self.log.append(("shards cancelled",))


def two_shard_job(model: nn.Module, push_credits: int) -> JobSpec:
    sizes = [p.numel() for p in model.parameters()]
    num_params = sum(sizes)
    bounds = shard_bounds(num_params, 2)
    buckets = shard_bucket_bounds(sizes, bounds, BUCKET_NUMEL)
    return JobSpec(
        "sync", "lenet", "embedded", 2, 8, 0, None, 64, 4, 1, None, num_params, 0, "none",
        shard_bounds=bounds, shard_endpoints=("tcp://127.0.0.1:1",), push_credits=push_credits,
        bucket_bounds=buckets[0], slice_bucket_bounds=tuple(buckets[1:]),
    )  # fmt: skip


def not_finite_at(model: nn.Module, index: int) -> torch.Tensor:
    """A term that is 0, with a NaN gradient for value `index` of the flat parameter vector
    (the derivative of sqrt at 0 is infinite, times 0)."""
    for param in model.parameters():
        if index < param.numel():
            return torch.sqrt(param.view(-1)[index] * 0)
        index -= param.numel()
    raise IndexError(index)


def push_one_step(
    granted: bool,
    replies: list[Message],
    overlap: bool = True,
    shards_answer: Stop | None = None,
    nan_at: int | None = None,
    log: list[tuple[Any, ...]] | None = None,
) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]], Message, JobSpec]:
    """One backward and push; the log as backward left it, the log in all, and the reply.
    `nan_at`: the flat index whose gradient is NaN (the loss stays finite). `log`: where to
    log, to read it also when the step raises."""
    torch.manual_seed(0)
    model = build_model("lenet")
    flat = FlatModel(model)
    job = two_shard_job(model, push_credits=1)
    assert job.num_buckets > 1 and len(job.shard_bucket_ranges(1)) > 1
    log = [] if log is None else log
    connection = Connection(cast(ServerConnection, FakeLeader(log, replies)))
    connection.session = Session(1, "t", job)
    connection.shards = cast(ShardClients, FakeShards(log, shards_answer))
    pusher = GradientPusher(
        job, model, flat,
        GradientCompressor(CompressionSpec.parse("none"), job.num_params, torch.device("cpu")),
        connection, overlap=overlap,
    )  # fmt: skip
    weights = Weights(0, 0, 0, 0, 2, granted, torch.empty(0), torch.empty(0))
    loss = model(torch.randn(8, 1, 28, 28)).square().mean()
    if nan_at is not None:
        loss = loss + not_finite_at(model, nan_at)
        assert torch.isfinite(loss)
    pusher.backward_and_push(loss, OutgoingStep(1, "t", weights, 8, 0.0, 0, torch.empty(0)))
    during = list(log)
    reply = pusher.finish()
    pusher.close()
    return during, log, reply, job


def test_with_a_credit_the_leader_buckets_leave_during_backward() -> None:
    during, log, reply, job = push_one_step(granted=True, replies=[PushAck(1, 0, True)])
    assert ("leader", "PushReady") not in log
    # The leader's slice holds the last layers: all its buckets go first, each once, then
    # the PUSH that completes them, then the follower's slice.
    leader = [e for e in during if e[0] == "leader"]
    assert sorted(e[2] for e in leader[:-1]) == list(range(job.num_buckets))
    assert leader[-1] == ("leader", "Push")
    assert during.index(("leader", "Push")) < min(
        i for i, e in enumerate(during) if e[0] == "shard"
    )
    assert isinstance(reply, PushAck)


def test_without_a_credit_backward_goes_on_and_the_leader_waits_for_push_go() -> None:
    granted, _, _, _ = push_one_step(granted=True, replies=[PushAck(1, 0, True)])
    during, log, reply, job = push_one_step(granted=False, replies=[GO, PushAck(1, 0, True)])
    # During backward: the ask, and every bucket of the follower's slice, in the order backward
    # made them, and the PUSH that completes them; nothing of the leader's gradient.
    slices = [e for e in granted if e[0] == "shard"]
    buckets = len(job.shard_bucket_ranges(1))
    assert sorted(e[2] for e in slices) == list(range(buckets))
    assert during == [("leader", "PushReady"), *slices, ("shard complete", 1, buckets)]
    # Then: the go, the leader's buckets in the order backward made them (as they leave with
    # a credit), the PUSH that completes them, the follower's answer and the leader's.
    leader = [e for e in granted if e[0] == "leader"]
    assert log[len(during) :] == [
        ("leader reply", "go"), *leader, ("shards answered",), ("leader reply", "PushAck"),
    ]  # fmt: skip
    assert isinstance(reply, PushAck)


def test_without_overlap_the_whole_leader_slice_waits_for_push_go() -> None:
    during, log, reply, _ = push_one_step(
        granted=False, replies=[GO, PushAck(1, 0, True)], overlap=False
    )
    # After backward: the follower's whole slice, then the ask; the leader's PUSH only after
    # go.
    assert during == [("shard", 1, -1), ("leader", "PushReady")]
    assert log[len(during) :] == [
        ("leader reply", "go"), ("leader", "Push"), ("shards answered",),
        ("leader reply", "PushAck"),
    ]  # fmt: skip
    assert isinstance(reply, PushAck)


def test_a_stop_instead_of_push_go_sends_nothing_of_the_leader() -> None:
    _, log, reply, _ = push_one_step(granted=False, replies=[Stop("training is over")])
    assert isinstance(reply, Stop)
    assert not [e for e in log if e[:2] in {("leader", "bucket"), ("leader", "Push")}]
    assert log[-1] == ("shards cancelled",)  # their slices will never be committed


def test_a_wrong_answer_to_the_ask_is_a_clear_error() -> None:
    with pytest.raises(ServerError, match="got a PUSH_ACK without go"):
        push_one_step(granted=False, replies=[PushAck(1, 0, True)])


def test_a_stop_heard_while_waiting_for_the_followers_ends_the_step() -> None:
    """The job ended while a follower still held this slow worker's slice push: the STOP
    heard there is the step's answer, and the leader's reply (the same STOP) is not read."""
    _, log, reply, _ = push_one_step(
        granted=True, replies=[], shards_answer=Stop("training is over")
    )
    assert isinstance(reply, Stop) and reply.reason == "training is over"
    assert log[-2:] == [("shards answered",), ("leader reset",)]


def sent_ranges(log: list[tuple[Any, ...]], job: JobSpec) -> list[tuple[int, int]]:
    """The ranges of the flat vector that the pieces in `log` carried."""
    leader_lo = job.shard_range(0)[0]
    follower_lo = job.shard_range(1)[0]
    ranges = []
    for entry in log:
        if entry[:2] == ("leader", "bucket"):
            lo, hi = job.bucket_range(entry[2])
            ranges.append((leader_lo + lo, leader_lo + hi))
        elif entry[0] == "shard":
            lo, hi = job.shard_bucket_ranges(1)[entry[2]]
            ranges.append((follower_lo + lo, follower_lo + hi))
    return ranges


def test_without_overlap_a_gradient_with_a_nan_sends_nothing() -> None:
    """Not even the follower's slice, which is finite: the NaN is in the leader's."""
    log: list[tuple[Any, ...]] = []
    with pytest.raises(NonFiniteGradient, match="NaN or Inf"):
        push_one_step(granted=True, replies=[], overlap=False, nan_at=100_000, log=log)
    assert log == [("shards cancelled",)]


@pytest.mark.parametrize(
    ("nan_at", "granted", "pushed", "reset"),
    [(100_000, True, False, True), (30_000, True, True, True), (30_000, False, False, False)],
    ids=["in the leader's slice", "in the follower's slice", "while the leader's buckets wait"],
)
def test_with_overlap_no_piece_from_the_first_not_finite_on_goes_out(
    nan_at: int, granted: bool, pushed: bool, reset: bool
) -> None:
    """Backward makes the leader's slice (the last layers) first. A NaN there: no PUSH, and
    the connection that took the buckets before it is reset (weights it streams back are not
    wanted). A NaN in the follower's slice: the leader's buckets and PUSH have gone, and its
    answer is not read (reset). A NaN found while the leader's buckets wait for the go:
    the go is read, and they never go."""
    log: list[tuple[Any, ...]] = []
    replies: list[Message] = [] if granted else [GO]
    with pytest.raises(NonFiniteGradient, match=r"NaN or Inf values \(in \["):
        push_one_step(granted=granted, replies=replies, nan_at=nan_at, log=log)
    job = two_shard_job(build_model("lenet"), push_credits=1)
    sent = sent_ranges(log, job)
    assert sent, "the pieces before the NaN should have gone"
    assert not any(lo <= nan_at < hi for lo, hi in sent), sent
    assert (("leader", "Push") in log) is pushed
    tail = [("shards cancelled",), ("leader reset",)] if reset else [("shards cancelled",)]
    assert log[-len(tail) :] == tail
    if not granted:
        assert ("leader reply", "go") in log


def test_the_shard_clients_hand_on_a_stop_the_job_heartbeat_heard(
    zmq_context: zmq.Context,
) -> None:
    """A real ShardClients whose follower takes the slice push and never answers (the leader
    stopped it). Once the job's heartbeat has heard STOP, `finish_pushes` returns it at once,
    not an error about the follower's answer and not after the timeout."""
    follower, job = hand_driven_follower(zmq_context)
    heard: list[Message] = []
    shards = ShardClients(
        job, lambda start, values: None, 60, 0, None, liveness=time.monotonic,
        verdict=lambda: heard[0] if heard else None,
    )  # fmt: skip
    try:
        shards.send_push(slice_push(7, "t", 3, 0, 1, torch.zeros(6)))
        assert follower.poll(10_000), "the slice push never reached the follower"
        follower.recv_multipart()
        threading.Timer(0.3, lambda: heard.append(Stop("training is over"))).start()
        started = time.monotonic()
        answer = shards.finish_pushes()
        assert isinstance(answer, Stop) and answer.reason == "training is over"
        # "At once": well under the connection's 60 s timeout, however loaded the machine.
        assert time.monotonic() - started < 30
    finally:
        shards.close()
        follower.close(linger=0)
