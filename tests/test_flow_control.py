"""Flow control: with --push-credits C, at most C workers send a gradient at once, so the
server's memory does not grow with the number of workers. The rule is checked on its own and
on a live server driven by hand."""

import logging
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import zmq

from common.wire.protocol import (
    Error,
    Heartbeat,
    HeartbeatAck,
    Pull,
    Push,
    PushAck,
    PushReady,
    Register,
    Stop,
    Weights,
    Welcome,
    encode,
)
from psserver.coordinator.membership import Membership, WorkerState
from psserver.serving.credits import FlowControl, PushCredits
from tests.harness import Cluster
from tests.raw_peers import RawClient

NO_INDICES = torch.empty(0, dtype=torch.int32)


def is_go(message: object) -> bool:
    """The leader's answer to PUSH_READY that lets a push go: a PUSH_ACK that acknowledges
    nothing."""
    return (
        isinstance(message, PushAck)
        and message.go
        and (message.staleness, message.applied) == (0, False)
    )


def test_credits_admit_in_order_and_come_back_from_the_dead() -> None:
    credits = PushCredits(2)
    assert credits.ask(1) and credits.ask(2)
    assert not credits.ask(3) and not credits.ask(4)
    assert not credits.ask(3)  # asking twice does not queue twice
    assert credits.ask(1)  # a retry of a granted ask is granted again
    assert credits.release(1) == [3]  # 1 pushed: the first in line may go
    assert credits.release(4) == []  # 4 died while waiting: nothing to grant
    assert credits.release(2) == []  # 2 pushed; nobody waits
    assert set(credits.granted) == {3}
    assert credits.release(3) == [] and not credits.granted
    unlimited = PushCredits(0)
    assert all(unlimited.ask(worker) for worker in range(100))
    offers = PushCredits(1)
    assert offers.offer(1) and not offers.offer(2)  # handed out with the weights, if free
    assert not offers.ask(2) and offers.release(1) == [2]
    assert not offers.offer(3)  # 2 holds it now


def test_a_credit_held_too_long_while_others_wait_goes_to_them() -> None:
    now = [0.0]
    credits = PushCredits(1, hold_limit_s=10.0, clock=lambda: now[0])
    assert credits.ask(1) and not credits.ask(2)
    now[0] = 9.0
    assert credits.reclaim() == ([], [])  # not held too long yet
    now[0] = 11.0
    assert credits.reclaim() == ([1], [2])
    assert credits.release(1) == []  # 1 pushes after all: served, and nothing to hand on
    assert set(credits.granted) == {2}
    now[0] = 30.0
    assert credits.reclaim() == ([], [])  # held long, but nobody waits: it stays


def test_a_worker_that_loses_its_credit_every_step_is_warned_of_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A worker whose backward alone outlasts --worker-timeout loses its credit at every
    step while others wait: one warning, not one per step."""
    now = [0.0]
    credits = PushCredits(1, hold_limit_s=5, clock=lambda: now[0])
    router: Any = None  # nothing is sent: the worker it would go to is gone
    store: Any = SimpleNamespace(version=0)
    flow = FlowControl(router, store, Membership(4, 30.0), credits)
    with caplog.at_level(logging.DEBUG, logger="ps.server"):
        for step in range(3):
            assert credits.ask(1) and not credits.ask(2)
            now[0] += 10
            flow.reclaim()  # 1's credit goes to 2, which is gone: it comes back
            assert credits.granted == {} and not credits.waiting, step
    lines = [r for r in caplog.records if "held a push credit" in r.getMessage()]
    assert [r.levelno for r in lines] == [logging.WARNING, logging.DEBUG, logging.DEBUG]


@pytest.mark.parametrize("ending", ["credit", "end of the job"])
def test_a_worker_waiting_for_its_go_is_answered_on_every_socket_it_asked_on(ending: str) -> None:
    """PUSH_READY sent again on a new socket, and the first one read after it (a server
    stopped meanwhile reads both in either order): the go when the credit comes, or the STOP
    when the job ends first (psserver.coordinator.drain), goes to both sockets, not only to
    the one read last; a worker granted at once is answered on the socket it asked on."""
    sent: list[tuple[bytes, Any]] = []
    router: Any = SimpleNamespace(send=lambda identity, message: sent.append((identity, message)))
    store: Any = SimpleNamespace(version=4)
    membership = Membership(max_workers=2, worker_timeout=10)
    holder = membership.register(b"h", Register("holder", "h", "cpu", 1, "p1", {}))
    waiter = membership.register(b"old", Register("waiter", "h", "cpu", 2, "p2", {}))
    holder.assignment = waiter.assignment = (0, 0)
    flow = FlowControl(router, store, membership, PushCredits(1))
    flow.ask(holder, b"h")
    assert sent == [(b"h", PushAck(4, 0, False, go=True))]
    for socket in (b"new", b"old", b"old"):  # the retry read first, then the first twice
        waiter.identity = socket  # as Membership.authenticate sets it
        flow.ask(waiter, socket)
    assert len(sent) == 1  # waits for the holder's credit
    if ending == "credit":
        flow.release(holder.worker_id)  # the holder pushed
        answer: Any = PushAck(4, 0, False, go=True)
    else:
        flow.stop_waiting("training is over")
        answer = Stop("training is over")
        assert waiter.state == WorkerState.STOPPED
        assert holder.state != WorkerState.STOPPED  # it pushes, and hears STOP then
    assert sent[1:] == [(socket, answer) for socket in (b"new", b"old")]


def test_a_worker_without_a_batch_gets_no_credit_and_a_silent_holder_loses_its_own(
    cluster: Cluster, zmq_context: zmq.Context
) -> None:
    """Two clients that asked for credits and never pushed stalled every real worker for
    ever. Asking without a pulled batch is refused; a credit held past --worker-timeout while
    another worker waits goes to that worker, and the holder's late push is still taken."""
    # Before the credit is granted (with the pull), on the clock the server reads too.
    before_grant = time.monotonic()
    (a, ida, wa), (b, idb, wb) = two_pulls_with_one_credit(
        cluster, zmq_context, "--worker-timeout", "3"
    )
    (holder, holder_id, held), (waiter, waiter_id, waits) = (
        ((a, ida, wa), (b, idb, wb)) if wa.push_granted else ((b, idb, wb), (a, ida, wa))
    )
    stranger = RawClient(zmq_context, a.endpoint)
    welcome = stranger.register("stranger")
    assert isinstance(welcome, Welcome)
    refusal = stranger.request(PushReady(welcome.worker_id, stranger.token))
    assert isinstance(refusal, Error) and refusal.code == "unexpected-batch", refusal
    assert "holds no batch to push" in refusal.message, refusal

    waiter.socket.send_multipart(encode(PushReady(waiter_id, waiter.token)))
    started = time.monotonic()
    beats = RawClient(zmq_context, a.endpoint)  # both stay alive, as a worker's heartbeat does
    while not waiter.socket.poll(250):  # the holder keeps its credit, and does not push
        # A guard against a hang, loose for a loaded machine (the credit moves after about
        # 3 s); the lower bound below is what the test claims.
        assert time.monotonic() - started < 60, "the waiting worker never got the credit"
        for client, worker_id in ((holder, holder_id), (waiter, waiter_id)):
            assert isinstance(beats.request(Heartbeat(worker_id, client.token)), HeartbeatAck)
    assert is_go(waiter.receive("the go"))
    # Not before the holder had it for 3 s: a lower bound, which load cannot break.
    assert time.monotonic() - before_grant > 3.0
    grads = torch.zeros(held.params.numel())
    for client, worker_id, weights in ((waiter, waiter_id, waits), (holder, holder_id, held)):
        client.socket.send_multipart(
            encode(Push(worker_id, client.token, 0, weights.epoch, weights.batch, 8, 0.0, 0,
                        grads, NO_INDICES, weights.buffers))
        )  # fmt: skip
    for client in (waiter, holder):
        ack = client.receive("the step's acknowledgement")
        assert isinstance(ack, PushAck) and ack.version == 1, ack


def test_a_live_server_lets_one_push_through_at_a_time(
    cluster: Cluster, zmq_context: zmq.Context
) -> None:
    (a, ida, wa), (b, idb, wb) = two_pulls_with_one_credit(cluster, zmq_context)

    # The one credit went out with the first weights; the other worker has to ask.
    assert sorted([wa.push_granted, wb.push_granted]) == [False, True]
    first, second = (
        ((a, ida, wa), (b, idb, wb)) if wa.push_granted else ((b, idb, wb), (a, ida, wa))
    )
    assert is_go(first[0].request(PushReady(first[1], first[0].token)))  # a retry
    second[0].socket.send_multipart(encode(PushReady(second[1], second[0].token)))
    assert not second[0].socket.poll(500), "let in while the other still held the only credit"
    grads = torch.zeros(wa.params.numel())
    client, worker_id, weights = first
    client.socket.send_multipart(
        encode(Push(worker_id, client.token, 0, weights.epoch, weights.batch, 8, 0.0, 0, grads,
                    NO_INDICES, weights.buffers))
    )  # fmt: skip
    assert is_go(second[0].receive("the go once the other pushed"))
    client, worker_id, weights = second
    ack = client.request(
        Push(worker_id, client.token, 0, weights.epoch, weights.batch, 8, 0.0, 0, grads,
             NO_INDICES, weights.buffers)
    )  # fmt: skip
    assert isinstance(ack, PushAck) and ack.version == 1
    assert isinstance(first[0].receive("the first one's acknowledgement"), PushAck)


def test_a_sharded_leader_lets_a_credit_per_shard_through(
    cluster: Cluster, zmq_context: zmq.Context
) -> None:
    """With K shards the leader takes 1/K of each gradient, so 1 credit lets 2 workers send
    their slices to the 2-shard leader at once."""
    (_, _, wa), (_, _, wb) = two_pulls_with_one_credit(cluster, zmq_context, "--num-shards", "2")
    assert wa.push_granted and wb.push_granted


def two_pulls_with_one_credit(
    cluster: Cluster, zmq_context: zmq.Context, *server_args: str
) -> list[tuple[RawClient, int, Weights]]:
    """A sync server with --push-credits 1 and two raw workers that pulled at once: each
    worker's client, id and first WEIGHTS."""
    _, endpoint = cluster.start_server(
        "--mode", "sync", "--model", "lenet", "--workers", "2", "--push-credits", "1",
        "--train-limit", "64", "--test-limit", "20", "--batch-size", "8", "--max-steps", "1",
        *server_args,
    )  # fmt: skip
    clients = [RawClient(zmq_context, endpoint), RawClient(zmq_context, endpoint)]
    welcomes = [client.register(name) for client, name in zip(clients, "ab", strict=True)]
    assert all(isinstance(w, Welcome) and w.job["push_credits"] == 1 for w in welcomes)
    ids = [w.worker_id for w in welcomes if isinstance(w, Welcome)]
    for client, worker_id in zip(clients, ids, strict=True):
        client.socket.send_multipart(encode(Pull(worker_id, client.token)))
    pulled = []
    for client, worker_id, name in zip(clients, ids, "ab", strict=True):
        weights = client.receive(f"{name}'s weights")
        assert isinstance(weights, Weights)
        pulled.append((client, worker_id, weights))
    return pulled


class FakeTracker:
    """Stands in for zmq.MessageTracker: `done` says whether ZeroMQ still reads the memory."""

    def __init__(self) -> None:
        self.done = False

    def wait(self, timeout: float) -> None:  # a peer that never reads: it never ends
        if not self.done:
            time.sleep(timeout)
            raise zmq.NotDone


def test_async_snapshots_reuse_a_fixed_number_of_copies() -> None:
    from psserver.store.optimizer import OptimizerSpec
    from psserver.store.parameters import ParameterStore
    from psserver.store.sends import SNAPSHOT_SLOTS

    store = ParameterStore("lenet", seed=0, optimizer=OptimizerSpec(lr=1.0))
    trackers = []
    copies = set()
    for _ in range(SNAPSHOT_SLOTS):
        snapshot = store.snapshot()
        assert snapshot is not None and snapshot[0] == store.version
        assert torch.equal(snapshot[1], store.params)
        assert snapshot[1].data_ptr() != store.params.data_ptr()  # a copy, not the live tensor
        copies.add(snapshot[1].data_ptr())
        trackers.append(FakeTracker())
        store.track_send([trackers[-1]])
        again = store.snapshot()  # the same version shares its copy
        assert again is not None and again[1].data_ptr() == snapshot[1].data_ptr()
        store.apply_gradient(torch.ones(store.num_params))  # a new version
    assert store.snapshot() is None  # every copy is still being sent: the pull must wait
    trackers[1].done = True
    freed = store.snapshot()
    assert freed is not None and freed[1].data_ptr() in copies  # reused, not a new copy
    assert torch.equal(freed[1], store.params) and freed[0] == SNAPSHOT_SLOTS


def test_copies_stuck_with_a_peer_that_stopped_reading_are_replaced_a_few_times(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Three pulls whose replies are never read (a frozen or hostile client) used to hold
    every copy for ever, and every later async pull waited with them. A copy busy for over
    SEND_WAIT_S is given up on and replaced, up to RETIRED_SLOTS at once: memory stays
    bounded, and a retired copy that ZeroMQ has freed makes room for another."""
    from psserver.store import sends as sends_module
    from psserver.store.optimizer import OptimizerSpec
    from psserver.store.parameters import ParameterStore
    from psserver.store.sends import RETIRED_SLOTS, SNAPSHOT_SLOTS

    clock = [1000.0]
    monkeypatch.setattr(sends_module.time, "monotonic", lambda: clock[0])
    store = ParameterStore("lenet", seed=0, optimizer=OptimizerSpec(lr=1.0))
    stuck: list[FakeTracker] = []

    def pull_and_stall() -> tuple[int, torch.Tensor, torch.Tensor] | None:
        snapshot = store.snapshot()
        if snapshot is not None:
            assert snapshot[0] == store.version and torch.equal(snapshot[1], store.params)
            stuck.append(FakeTracker())
            store.track_send([stuck[-1]])
            store.apply_gradient(torch.ones(store.num_params))  # the next pull: a new version
        return snapshot

    for _ in range(SNAPSHOT_SLOTS):
        assert pull_and_stall() is not None
    assert store.snapshot() is None  # all busy, and not for long yet: wait
    clock[0] += sends_module.SEND_WAIT_S + 1
    for _ in range(RETIRED_SLOTS):
        assert pull_and_stall() is not None  # the oldest copy is given up on
        clock[0] += sends_module.SEND_WAIT_S + 1
    assert store.snapshot() is None  # the cap: no more copies than that
    stuck[0].done = True  # ZeroMQ let go of the first retired copy
    assert store.snapshot() is not None


class ClockedTracker:
    """A zmq.MessageTracker that is never done, on a clock of the test's: each wait moves
    the clock on by the timeout it was given, and is recorded."""

    def __init__(self, clock: list[float], waits: list[float]) -> None:
        self.done, self.clock, self.waits = False, clock, waits

    def wait(self, timeout: float) -> None:
        self.waits.append(timeout)
        self.clock[0] += timeout
        raise zmq.NotDone


def test_waits_for_a_stalled_peers_buckets_share_one_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A sync step closing with a stalled worker's streamed buckets still in flight waits
    once, not once per bucket (19 x 2 s held the loop so long that heartbeating workers were
    declared dead); each wait that gave up is counted, so the loop excuses the silence. On a
    clock of the test's, so that what is checked is how long each wait was asked to last."""
    from psserver.store import sends as sends_module
    from psserver.store.optimizer import OptimizerSpec
    from psserver.store.parameters import ParameterStore

    clock, waits = [0.0], []
    monkeypatch.setattr(sends_module, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    store = ParameterStore("lenet", seed=0, optimizer=OptimizerSpec(lr=1.0))
    store.publish_live = True
    for bucket in range(5):
        tracker = ClockedTracker(clock, waits)
        store.track_send([tracker], 10 * bucket, 10 * bucket + 10)  # type: ignore[list-item]
    for bucket in range(5):
        store.wait_for_sends(10 * bucket, 10 * bucket + 10, deadline=0.25)
    assert waits == [0.25, 0.0, 0.0, 0.0, 0.0]  # the first used the budget up
    assert clock == [0.25] and store.stalled_waits == 5


def test_the_end_of_a_job_stops_workers_queued_for_push_go(
    cluster: Cluster, zmq_context: zmq.Context
) -> None:
    """Async, one credit, three workers, --max-steps 1: two ask PUSH_READY and queue; the
    holder's push ends the job. Those still queued asked already and will not ask again, so the
    drain must answer them STOP (it used to leave them to time out)."""
    server, endpoint = cluster.start_server(
        "--mode", "async", "--model", "lenet", "--workers", "3", "--train-limit", "64",
        "--test-limit", "20", "--batch-size", "8", "--push-credits", "1", "--max-steps", "1",
        "--stop-grace", "1",
    )  # fmt: skip
    clients = [RawClient(zmq_context, endpoint, timeout_s=10) for _ in range(3)]
    welcomes = [client.register(f"w{i}") for i, client in enumerate(clients)]
    assert all(isinstance(w, Welcome) for w in welcomes)
    ids = [w.worker_id for w in welcomes]
    for client, worker_id in zip(clients, ids, strict=True):
        client.send_frames(encode(Pull(worker_id, client.token)))
    weights = [client.receive("WEIGHTS") for client in clients]
    assert all(isinstance(w, Weights) for w in weights)
    holder = next(k for k, w in enumerate(weights) if w.push_granted)
    queued = [k for k in range(3) if k != holder]
    for k in queued:
        clients[k].send_frames(encode(PushReady(ids[k], clients[k].token)))
    w, client = weights[holder], clients[holder]
    grads = torch.zeros(w.params.numel())
    ack = client.request(
        Push(ids[holder], client.token, w.version, w.epoch, w.batch, 8, 0.0, 0, grads,
             NO_INDICES, w.buffers.clone())
    )  # fmt: skip
    assert isinstance(ack, PushAck), ack
    # The freed credit goes to the first in line; the job is over, so its push hears STOP.
    # The second stays in line: the drain answers it.
    first, second = (clients[k].receive("an answer to PUSH_READY") for k in queued)
    assert is_go(first) and isinstance(second, Stop), (first, second)
    cluster.wait(server, timeout=30)
