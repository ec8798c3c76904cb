"""The pull handler of every shard, in process: one `PullHandler`, with a follower's terms
(a pull waits for its version, nothing goes with the slice, the held pulls are capped, the
leader's pull is never evicted) and the leader's (a pull waits for the policy's batch, which
goes with the weights, and STOP when the job is over). The sockets are a recorder of what
would be sent; the live paths are in tests/test_sharding.py and tests/test_streaming.py."""

from collections.abc import Sequence
from typing import Any

import torch

from common.assignment import Assignment
from common.wire.protocol import LEADER_ID, Error, Pull, Stop, Weights
from psserver.coordinator.membership import WorkerRecord, WorkerState
from psserver.policies import HOLD
from psserver.serving.pulls import AssignmentTerms, PullHandler, SliceTerms
from psserver.serving.staging import SliceStaging
from psserver.status.report import TrainingMeter
from psserver.store.optimizer import OptimizerSpec
from psserver.store.parameters import SliceStore


class Recorder:
    """What the handler sends, in order: (connection, message)."""

    def __init__(self) -> None:
        self.sent: list[tuple[bytes, Any]] = []

    def send(self, identity: bytes, message: Any) -> None:
        self.sent.append((identity, message))

    def send_tracked(self, identities: Sequence[bytes], message: Any) -> list[Any]:
        self.sent.extend((identity, message) for identity in identities)
        return []


def follower(max_held: int = 3) -> tuple[PullHandler[int], Recorder, SliceStore]:
    params = torch.arange(6, dtype=torch.float32)
    store = SliceStore(params, torch.zeros_like(params), OptimizerSpec(lr=1.0))
    buckets = [(0, 3), (3, 6)]
    staging = SliceStaging(store, buckets, 4, 1.0, 1)
    router, meter = Recorder(), TrainingMeter()
    handler: PullHandler[int] = PullHandler(
        router,  # type: ignore[arg-type]
        store, buckets, SliceTerms(1, store, staging, meter), meter, 1, max_held=max_held,
    )  # fmt: skip
    return handler, router, store


def test_a_follower_pull_waits_for_its_version_and_gets_the_slice_alone() -> None:
    handler, router, store = follower()
    handler.hold(b"a", 7, b"a", Pull(7, "t", shard=1, min_version=1))
    handler.answer()
    assert router.sent == [] and list(handler.held) == [b"a"]
    store.count_update()
    handler.answer()
    ((to, weights),) = router.sent
    assert to == b"a" and isinstance(weights, Weights) and not handler.held
    assert (weights.version, weights.epoch, weights.batch, weights.shard) == (1, -1, -1, 1)
    assert torch.equal(weights.params, store.params) and not weights.streamed


def test_a_follower_streams_buckets_and_leaves_them_out_of_the_next_pull() -> None:
    handler, router, store = follower()
    store.count_update()
    for bucket in (0, 1):
        handler.stream_bucket(bucket, 1, [b"a"])
    assert handler.meter.streamed_bytes == 6 * 4
    handler.hold(b"a", 7, b"a", Pull(7, "t", have_version=1, shard=1, min_version=1))
    handler.answer()
    weights = router.sent[-1][1]
    assert weights.streamed and weights.params.numel() == 0 and weights.bucket == -1
    assert handler.meter.streamed_pulls == 1


def test_a_follower_evicts_its_oldest_worker_pull_never_the_leaders() -> None:
    handler, router, _ = follower(max_held=2)
    leader_key = handler.terms.leader_key()  # type: ignore[attr-defined]
    handler.hold(leader_key, LEADER_ID, b"L", Pull(LEADER_ID, "x", shard=1, min_version=5),
                 evictable=False)  # fmt: skip
    handler.hold(b"a", 7, b"a", Pull(7, "t", shard=1, min_version=5))
    handler.hold(b"a", 7, b"a", Pull(7, "t", shard=1, min_version=5))  # replaces its own
    assert router.sent == [] and len(handler.held) == 2
    handler.hold(b"b", 8, b"b", Pull(8, "t", shard=1, min_version=5))
    ((to, busy),) = router.sent
    assert to == b"a" and isinstance(busy, Error) and busy.code == "busy"
    assert list(handler.held) == [leader_key, b"b"]
    second = handler.terms.leader_key()  # type: ignore[attr-defined]
    handler.hold(second, LEADER_ID, b"L", Pull(LEADER_ID, "x", shard=1, min_version=5),
                 evictable=False)  # fmt: skip
    assert len(router.sent) == 1, "the leader's pull takes no worker's place"
    assert list(handler.held) == [leader_key, b"b", second]


class ScriptedPolicy:
    """The leader's policy, its decisions given in advance."""

    def __init__(self, decisions: list[Assignment | str | None]) -> None:
        self.decisions = decisions

    def next_assignment(self, worker_id: int) -> Assignment | str | None:
        return self.decisions.pop(0)


class FreeCredits:
    def offer(self, worker_id: int) -> bool:
        return True


class BufferedStore(SliceStore):
    """The leader's store: its snapshot has buffers too."""

    def snapshot(self) -> tuple[int, torch.Tensor, torch.Tensor]:
        return self.version, self.params, torch.zeros(2)


def leader(decisions: list[Assignment | str | None]) -> tuple[PullHandler[WorkerRecord], Recorder]:
    """The leader's pull handler over 4 weights of 1, its policy deciding `decisions` in turn."""
    params = torch.ones(4)
    store = BufferedStore(params, torch.zeros_like(params), OptimizerSpec(lr=1.0))
    terms = AssignmentTerms(store, ScriptedPolicy(decisions), FreeCredits(), None)  # type: ignore[arg-type]
    router = Recorder()
    handler: PullHandler[WorkerRecord] = PullHandler(
        router,  # type: ignore[arg-type]
        store, [(0, 4)], terms, TrainingMeter(),
    )  # fmt: skip
    return handler, router


def test_the_leaders_pull_gets_its_batch_with_the_weights_and_stop_at_the_end() -> None:
    handler, router = leader([HOLD, Assignment(2, 5, 0, 3), None])
    worker = WorkerRecord(3, "t", "w3", "cpu", b"old", "", "host", 1, "p")
    handler.hold(3, worker, b"old", Pull(3, "t"))
    assert worker.state is WorkerState.WAITING
    handler.answer()
    assert router.sent == [] and list(handler.held) == [3]
    # A request of its since came on a newer socket: the answer goes there too.
    worker.identity = b"new"
    handler.answer()
    assert [to for to, _ in router.sent] == [b"old", b"new"]
    weights = router.sent[0][1]
    assert router.sent[1][1] is weights
    assert (weights.epoch, weights.batch, weights.rank) == (2, 5, 0)
    assert weights.world_size == 3 and weights.push_granted and worker.assignment == (2, 5)
    assert torch.equal(weights.params, torch.ones(4)) and weights.buffers.numel() == 2
    assert not handler.held
    handler.hold(3, worker, b"new", Pull(3, "t"))
    handler.answer()
    assert isinstance(router.sent[-1][1], Stop) and not handler.held
    assert worker.state is WorkerState.STOPPED


def test_the_leader_answers_a_held_pull_on_every_socket_it_came_on() -> None:
    """A pull sent again on a new socket, and the first one read after it (a server stopped
    meanwhile reads both in either order): held as one and answered on both sockets; a pull
    read twice from one socket is answered there once."""
    handler, router = leader([HOLD, HOLD, HOLD, Assignment(0, 1, 0, 2)])
    worker = WorkerRecord(3, "t", "w3", "cpu", b"new", "", "host", 1, "p")
    for socket in (b"new", b"old", b"old"):  # the retry read first, then the first twice
        worker.identity = socket  # as Membership.authenticate sets it
        handler.hold(3, worker, socket, Pull(3, "t"))
        handler.answer()
        assert router.sent == [] and list(handler.held) == [3]
    handler.answer()
    assert [to for to, _ in router.sent] == [b"new", b"old"]
    assert router.sent[0][1] is router.sent[1][1] and not handler.held
