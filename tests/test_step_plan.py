"""Sync steps on follower shards without waiting for the update: the leader's COMMIT with a
plan names the workers the open step waits for, and a follower applies (and streams back)
each bucket of its slice as soon as all of them sent it, as the leader does with its own
buckets. Integer gradients and lr 1 keep every value exact."""

import pytest
import torch
import zmq

from common.errors import RequestRejected
from common.wire.protocol import (
    Commit,
    PushAck,
    Weights,
    decode,
    encode,
)
from psserver.policies import OpenStep
from psserver.serving.staging import AppliedBucket, SliceStaging
from psserver.shards.follower_link import FollowerLink
from psserver.shards.leader import ShardGroup
from psserver.store.optimizer import OptimizerSpec
from psserver.store.parameters import SliceStore
from tests.harness import Cluster
from tests.raw_peers import RawClient, completing_push, slice_push
from tests.test_sharding import assert_streamed, pull_slice, start_two_raw_workers

NO_INDICES = torch.empty(0, dtype=torch.int32)
STEP = (0, 0, 0)  # (version, epoch, batch)


def step_plan(token: str, version: int, epoch: int, batch: int, expected: int,
              plan: list[object]) -> Commit:  # fmt: skip
    """The COMMIT that carries the plan of a sync step (no update)."""
    return Commit(token, version, [], expected, 1.0, epoch, batch, plan)


PLAN = step_plan("leader", 0, 0, 0, 16, [[1, "t1", 8], [2, "t2", 8]])  # 8 samples each
COMMIT = Commit("leader", 0, [[1, "t1", 0, 0, 0, 8], [2, "t2", 0, 0, 0, 8]], 16, 1.0)


def make_staging() -> tuple[SliceStaging, torch.Tensor, list[AppliedBucket]]:
    params = torch.zeros(4)
    store = SliceStore(params, torch.zeros(4), OptimizerSpec(lr=1.0))
    store.publish_live = True
    staging = SliceStaging(store, [(0, 1), (1, 4)], capacity=4, slice_wait=3600, shard=1)
    applied: list[AppliedBucket] = []
    staging.on_bucket_applied = applied.append
    return staging, params, applied


def stage(staging: SliceStaging, worker: int, bucket: int, values: list[float]) -> None:
    piece = (torch.tensor(values), NO_INDICES)
    staging.stage(worker, f"t{worker}", STEP, f"w{worker}".encode(), bucket, piece)


def test_a_planned_bucket_is_applied_before_the_commit_and_only_once() -> None:
    staging, params, applied = make_staging()
    staging.set_plan(PLAN)
    stage(staging, 1, 1, [2.0, 2.0, 2.0])
    staging.apply_ready()
    assert params.tolist() == [0.0] * 4 and not applied  # worker 2's bucket 1 is missing
    stage(staging, 2, 1, [4.0, 4.0, 4.0])
    staging.apply_ready()
    # (2 + 4) / 2 = 3, applied and streamed as version 1 with no COMMIT yet.
    assert params.tolist() == [0.0, -3.0, -3.0, -3.0] and staging.mid_commit
    assert applied == [AppliedBucket(1, 1, [b"w1", b"w2"])]
    assert staging.store.version == 0  # the step is the leader's to close
    stage(staging, 1, 0, [6.0])
    stage(staging, 2, 0, [8.0])
    staging.apply_ready()
    assert params.tolist() == [-7.0, -3.0, -3.0, -3.0] and len(applied) == 2
    assert staging.store.version == 0 and staging.mid_commit
    # The COMMIT finds every bucket applied: the slice moves on, nothing is added twice.
    staging.add_commit(COMMIT)
    staging.apply_ready()
    assert params.tolist() == [-7.0, -3.0, -3.0, -3.0] and len(applied) == 2
    assert staging.store.version == 1 and not staging.mid_commit and not staging.staged


def test_a_commit_finishes_what_the_plan_could_not() -> None:
    """A refused slice stops the plan: the commit leaves it out and renormalises, as before."""
    staging, params, applied = make_staging()
    staging.set_plan(PLAN)
    staging.stage(1, "t1", STEP, b"w1", 1, None)  # worker 1's bucket 1 was refused
    stage(staging, 1, 0, [6.0])
    stage(staging, 2, -1, [8.0, 4.0, 4.0, 4.0])
    staging.apply_ready()
    assert params.tolist() == [0.0] * 4 and not applied
    staging.add_commit(COMMIT)
    staging.apply_ready()
    assert params.tolist() == [-8.0, -4.0, -4.0, -4.0] and staging.store.version == 1


def test_a_plan_for_the_next_step_waits_for_the_commit_of_this_one() -> None:
    staging, params, _ = make_staging()
    stage(staging, 1, -1, [2.0] * 4)
    stage(staging, 2, -1, [2.0] * 4)
    staging.set_plan(step_plan("leader", 1, 0, 1, 16, PLAN.plan))  # came before COMMIT 0
    staging.apply_ready()
    assert params.tolist() == [0.0] * 4  # step 0 is not committed: the slice is at version 0
    staging.add_commit(COMMIT)
    staging.apply_ready()
    assert params.tolist() == [-2.0] * 4 and staging.store.version == 1
    for worker in (1, 2):
        for bucket, size in ((0, 1), (1, 3)):  # in parts, as overlap sends them
            piece = (torch.ones(size), NO_INDICES)
            staging.stage(worker, f"t{worker}", (1, 0, 1), b"w", bucket, piece)
    staging.apply_ready()  # step 1's buckets by its plan
    assert params.tolist() == [-3.0] * 4 and staging.store.version == 1 and staging.mid_commit


@pytest.mark.parametrize("sparse", [False, True])
def test_a_whole_slice_waits_for_the_commit_that_may_leave_it_out(sparse: bool) -> None:
    """A slice pushed whole (no overlap, or top-k) is not streamed back, so the plan does not
    apply it: the leader may still close the step without its worker (its push came after
    --step-timeout), and then no shard may take it. Worker 1 alone, renormalised: weight 1."""
    params = torch.zeros(4)
    store = SliceStore(params, torch.zeros(4), OptimizerSpec(1.0), sparse=sparse)
    store.publish_live = True
    staging = SliceStaging(store, [(0, 4)] if sparse else [(0, 1), (1, 4)], 4, 3600, 1)
    staging.set_plan(PLAN)
    for worker, value in ((1, 2.0), (2, 4.0)):
        if sparse:  # top-k: values at two of the four positions
            piece = (torch.full((2,), value), torch.tensor([1, 3], dtype=torch.int32))
        else:
            piece = (torch.full((4,), value), NO_INDICES)
        staging.stage(worker, f"t{worker}", STEP, b"w", -1, piece)
    staging.apply_ready()
    assert params.tolist() == [0.0] * 4 and not staging.mid_commit
    staging.add_commit(Commit("leader", 0, [[1, "t1", 0, 0, 0, 8]], 16, 1.0))
    staging.apply_ready()
    assert params.tolist() == ([0.0, -2.0, 0.0, -2.0] if sparse else [-2.0] * 4)
    assert staging.store.version == 1 and not staging.mid_commit


@pytest.mark.parametrize("ending", ["empty plan", "new epoch"])
def test_an_abandoned_step_keeps_its_applied_buckets(ending: str) -> None:
    staging, params, _ = make_staging()
    dropped: list[bool] = []
    staging.on_step_dropped = lambda: dropped.append(True)
    staging.set_plan(PLAN)
    stage(staging, 1, 1, [2.0, 2.0, 2.0])
    stage(staging, 2, 1, [4.0, 4.0, 4.0])
    staging.apply_ready()
    assert staging.mid_commit
    if ending == "empty plan":  # the epoch was abandoned and no other began
        staging.set_plan(step_plan("leader", 0, -1, -1, 0, []))
    else:  # the next epoch began at once, at the same version
        staging.set_plan(step_plan("leader", 0, 1, 0, 16, PLAN.plan))
        staging.apply_ready()
    # As the leader's buckets: the update stays, the version does not move, pulls go on.
    assert params.tolist() == [0.0, -3.0, -3.0, -3.0] and staging.store.version == 0
    assert not staging.mid_commit and dropped == [True]


@pytest.mark.parametrize(
    "entry", [[1, "t1"], [1, "t1", 0], ["1", "t1", 8], [1, 2, 8], [1, "t1", True], "x"]
)
def test_a_malformed_plan_is_refused(entry: object) -> None:
    staging, _, _ = make_staging()
    with pytest.raises(RequestRejected, match="plan entry"):
        staging.set_plan(step_plan("leader", 0, 0, 0, 16, [entry]))
    assert staging.plan is None


class RecordingSocket:
    """Stands in for the leader's socket to a follower: keeps what is sent."""

    def __init__(self) -> None:
        self.sent: list[object] = []

    def send_multipart(self, frames: list[bytes], copy: bool = True) -> None:
        self.sent.append(decode([bytes(f) for f in frames]))


def recorded_shard_group(zmq_context: zmq.Context) -> tuple[ShardGroup, RecordingSocket]:
    """A leader's ShardGroup of two 5-parameter shards whose follower link records what the
    leader sends it."""
    group = ShardGroup(zmq_context, (0, 5, 10), None, timeout_s=1.0, ping_interval_s=1.0)
    socket = RecordingSocket()
    group.links[1] = FollowerLink(1, "tcp://127.0.0.1:1", socket, 0.0)
    return group, socket


def test_the_leader_announces_each_step_once_and_the_end_of_an_abandoned_one(
    zmq_context: zmq.Context,
) -> None:
    group, socket = recorded_shard_group(zmq_context)
    tokens = {4: "a", 7: "b"}.__getitem__
    group.announce(OpenStep(3, 0, 2, 16, 8, (4, 7)), 3, tokens)
    group.announce(OpenStep(3, 0, 2, 16, 8, (4, 7)), 3, tokens)  # the same step: once
    assert socket.sent == [step_plan(group.token, 3, 0, 2, 16, [[4, "a", 8], [7, "b", 8]])]
    group.announce(None, 4, tokens)  # step 3 was committed and its epoch ended: nothing
    group.announce(OpenStep(4, 1, 0, 16, 8, (7,)), 4, tokens)
    assert socket.sent[1:] == [step_plan(group.token, 4, 1, 0, 16, [[7, "b", 8]])]
    group.announce(None, 4, tokens)  # step 4 ended without a commit: its epoch was abandoned
    group.announce(None, 4, tokens)
    assert socket.sent[2:] == [Commit(group.token, 4, [], 0, 1.0)]


def test_a_follower_streams_buckets_before_the_leader_closes_the_step(
    cluster: Cluster, zmq_context: zmq.Context
) -> None:
    """Sync, 2 raw workers: the follower applies and streams each bucket of its slice once
    both sent it, while neither has pushed to the leader; the leader's step then closes with
    the same update, and the workers' pulls leave the follower's slice out."""
    pair = start_two_raw_workers(cluster, zmq_context, 1, 5, "--stop-grace", "1")
    leader, follower, _, buckets, _, a, b, ids, shard, weights, grads, expected = pair

    def send_bucket(c: RawClient, bucket: int) -> None:
        w = weights[c]
        assert isinstance(w, Weights)
        lo, hi = buckets[bucket]
        push = slice_push(ids[c], c.token, 0, w.epoch, w.batch, grads[c][lo:hi], bucket)
        shard[c].send_frames([bytes(f) for f in encode(push)])

    for bucket in (2, 1):  # last layers first, as backward makes them
        send_bucket(a, bucket)
        assert not shard[a].socket.poll(200)  # B's part of it is not in yet
        send_bucket(b, bucket)
        lo, hi = buckets[bucket]
        for c in (a, b):
            assert_streamed(shard[c], 1, bucket, expected[lo:hi])
    for c in (a, b):
        send_bucket(c, 0)
    for c in (a, b):
        assert_streamed(shard[c], 1, 0, expected[: buckets[0][1]])
    for c in (a, b):  # the PUSH that completes a slice is answered, as on the leader
        w = weights[c]
        assert isinstance(w, Weights)
        ack = shard[c].request(completing_push(ids[c], c.token, 0, w.epoch, w.batch, 3))
        assert isinstance(ack, PushAck) and ack.shard == 1, ack

    for c in (a, b):
        c.send_frames([bytes(f) for f in encode(pair.leader_push(c, 0))])
    for c in (a, b):
        ack = c.receive("PUSH_ACK")
        assert isinstance(ack, PushAck) and ack.version == 1, ack
    pulled = pull_slice(shard[a], ids[a], a.token, 1)
    assert pulled.streamed and pulled.version == 1 and pulled.params.numel() == 0
    assert not shard[b].socket.poll(200)  # nothing was applied twice, nor streamed again
    cluster.wait(leader, timeout=60)
    cluster.wait(follower, timeout=30)


def test_an_async_push_does_not_replace_a_slice_whose_commit_waits() -> None:
    """Async, lr 1: worker 2's commit is first in line but its slice is slow; worker 1's
    commit waits behind it, and meanwhile worker 1 pushes its next slice (its pull did not
    wait for the follower). Both of worker 1's gradients must still be applied, in order.
    Before the fix the next push replaced the first, whose commit then gave up on it."""
    staging, params, _ = make_staging()
    a1, a2, b = (0, 0, 0), (1, 0, 1), (0, 0, 0)  # (version, epoch, batch) of each push
    staging.stage(1, "t1", a1, b"w1", -1, (torch.full((4,), 1.0), NO_INDICES))
    staging.add_commit(Commit("leader", 0, [[2, "t2", *b, 8]], 0, 1.0))  # worker 2 first
    staging.add_commit(Commit("leader", 1, [[1, "t1", *a1, 8]], 0, 1.0))
    staging.apply_ready()
    assert params.tolist() == [0.0] * 4  # worker 2's slice is not in yet
    staging.stage(1, "t1", a2, b"w1", -1, (torch.full((4,), 10.0), NO_INDICES))
    staging.add_commit(Commit("leader", 2, [[1, "t1", *a2, 8]], 0, 1.0))
    staging.stage(2, "t2", b, b"w2", -1, (torch.full((4,), 100.0), NO_INDICES))
    staging.apply_ready()
    assert params.tolist() == [-111.0] * 4 and staging.store.version == 3
    assert not staging.staged


def test_a_full_staging_area_drops_only_slices_nothing_names() -> None:
    """Past its capacity (4 here) the oldest unnamed slices go (late gradients the leader
    dropped, or a flood under made-up worker ids); a slice a queued commit names stays."""
    staging, params, _ = make_staging()
    staging.stage(1, "t1", STEP, b"w1", -1, (torch.full((4,), 1.0), NO_INDICES))
    staging.add_commit(Commit("leader", 0, [[1, "t1", *STEP, 8], [2, "t2", *STEP, 8]], 16, 1.0))
    for worker in range(100, 110):  # never named
        staging.stage(worker, "forged", STEP, b"x", -1, (torch.full((4,), 1e6), NO_INDICES))
    assert len(staging.staged) == 4 and (1, "t1", STEP) in staging.staged
    staging.stage(2, "t2", STEP, b"w2", -1, (torch.full((4,), 3.0), NO_INDICES))
    staging.apply_ready()
    assert params.tolist() == [-2.0] * 4 and staging.store.version == 1


def test_the_push_that_completes_a_slice_is_answered_from_what_came() -> None:
    """A slice sent in buckets is complete, incomplete or refused; and complete also once its
    commit applied every bucket and let it go: the leader's step may close, and its COMMIT
    reach the follower, while the worker's completing PUSH is still on its way."""
    staging, params, _ = make_staging()
    stage(staging, 1, 1, [1.0, 1.0, 1.0])
    with pytest.raises(RequestRejected, match=r"buckets \[0\] of shard 1's slice did not arrive"):
        staging.complete(1, "t1", STEP, 2)
    stage(staging, 1, 0, [2.0])
    with pytest.raises(RequestRejected, match="announces 3 parts of 2"):
        staging.complete(1, "t1", STEP, 3)
    staging.complete(1, "t1", STEP, 2)
    refusal = RequestRejected("wrong-shape", "bucket 1 of worker 2 does not fit")
    staging.stage(2, "t2", STEP, b"w2", 1, None, refusal)
    stage(staging, 2, 0, [4.0])
    with pytest.raises(RequestRejected, match="does not fit"):
        staging.complete(2, "t2", STEP, 2)
    staging.add_commit(COMMIT)
    staging.apply_ready()  # worker 2's slice is refused: worker 1's alone, renormalised
    assert params.tolist() == [-2.0, -1.0, -1.0, -1.0] and not staging.staged
    staging.complete(1, "t1", STEP, 2)  # applied and let go: still complete
    with pytest.raises(RequestRejected, match="does not fit"):
        staging.complete(2, "t2", STEP, 2)


def test_a_commit_with_both_an_update_and_a_plan_is_refused() -> None:
    staging, params, _ = make_staging()
    both = Commit("leader", 0, COMMIT.entries, 16, 1.0, 0, 0, PLAN.plan)
    with pytest.raises(RequestRejected, match="never both"):
        staging.receive(both)
    assert staging.plan is None and not staging.commits and params.tolist() == [0.0] * 4
