"""The update policies in-process: exact averaging, BatchNorm buffer
averaging (sync) and running averaging (async), and the errors for stale or repeated pushes."""

import pytest
import torch

from common.assignment import Assignment
from common.errors import RequestRejected
from common.job import JobSpec
from common.wire.protocol import Push
from psserver.policies import HOLD, AsyncPolicy, SyncPolicy
from psserver.store.optimizer import OptimizerSpec
from psserver.store.parameters import ParameterStore

NO_INDICES = torch.empty(0, dtype=torch.int32)


def make_store(lr: float = 1.0) -> ParameterStore:
    return ParameterStore("resnet18", seed=0, optimizer=OptimizerSpec(lr=lr))


def make_job(store: ParameterStore, world_size: int) -> JobSpec:
    return JobSpec(
        mode="sync",
        model="resnet18",
        dataset="embedded",
        world_size=world_size,
        batch_size=8,
        seed=0,
        train_limit=None,
        train_size=64,
        steps_per_epoch=4,
        epochs=1,
        max_steps=None,
        num_params=store.num_params,
        num_buffers=store.num_buffers,
        compress="none",
    )


def push(
    store: ParameterStore,
    grads: torch.Tensor,
    buffers: torch.Tensor,
    samples: int,
    version: int | None = None,
) -> Push:
    v = store.version if version is None else version
    return Push(1, "token", v, 0, 0, samples, 0.0, 0, grads, NO_INDICES, buffers)


def test_sync_step_is_the_mean_and_buffers_are_averaged() -> None:
    store = make_store()
    policy = SyncPolicy(store, make_job(store, world_size=2), epochs=1, max_steps=None)
    policy.begin_epoch([1, 2])
    live = {1, 2}
    p, f = store.num_params, store.num_buffers
    before = store.flat.params.clone()
    g1, g2 = torch.full((p,), 4.0), torch.full((p,), 1.0)
    b1, b2 = torch.full((f,), 2.0), torch.full((f,), 6.0)

    first = policy.on_push(1, push(store, g1, b1, samples=8), live)
    assert first.acknowledged == [] and store.version == 0  # waits for the second worker
    with pytest.raises(RequestRejected, match="already pushed"):
        policy.on_push(1, push(store, g1, b1, samples=8), live)
    # Every rank's batch t has the same size (shards are padded): 8 samples here, no other.
    with pytest.raises(RequestRejected, match="over 8 samples") as refused:
        policy.on_push(2, push(store, g2, b2, samples=3), live)
    assert refused.value.code == "bad-samples"
    second = policy.on_push(2, push(store, g2, b2, samples=8), live)
    assert sorted(second.acknowledged) == [1, 2] and store.version == 1

    # (4 + 1) / 2 = 2.5 exactly; lr 1 without momentum subtracts it once.
    assert torch.equal(store.flat.params, before - 2.5)
    assert torch.equal(store.flat.buffers, torch.full((f,), 4.0))
    assert int(store.model.state_dict()["0.1.num_batches_tracked"]) == 1

    assert policy.is_late(push(store, g1, b1, samples=8, version=0))


def test_async_applies_each_push_and_blends_buffers() -> None:
    store = make_store(lr=0.5)
    policy = AsyncPolicy(store, make_job(store, world_size=4), epochs=1, max_steps=None)
    policy.begin_epoch([1, 2, 3, 4])
    live = {1, 2, 3, 4}
    p, f = store.num_params, store.num_buffers
    start_params, start_buffers = store.flat.params.clone(), store.flat.buffers.clone()
    target = torch.full((f,), 8.0)

    result = policy.on_push(1, push(store, torch.full((p,), 2.0), target, samples=8), live)
    assert result.acknowledged == [1] and result.staleness == 0 and store.version == 1
    assert torch.equal(store.flat.params, start_params - 1.0)
    # Running average: the master statistics move 1/N = 1/4 of the way to the worker's.
    torch.testing.assert_close(store.flat.buffers, start_buffers + (target - start_buffers) / 4)

    stale = policy.on_push(2, push(store, torch.zeros(p), target, samples=8, version=0), live)
    assert stale.staleness == 1
    assert policy.staleness_summary() == {
        "count": 2,
        "mean": 0.5,
        "max": 1,
        "histogram": {"0": 1, "1": 1},
        "steps_ahead_bound": None,
    }
    with pytest.raises(RequestRejected, match="claims version"):
        policy.on_push(1, push(store, torch.zeros(p), target, samples=8, version=5), live)


def test_async_assignments_walk_each_shard_and_finish() -> None:
    store = make_store()
    policy = AsyncPolicy(store, make_job(store, world_size=2), epochs=2, max_steps=None)
    policy.begin_epoch([1, 2])
    seen = []
    while isinstance(assignment := policy.next_assignment(1), Assignment):
        seen.append((assignment.epoch, assignment.batch, assignment.rank, assignment.world_size))
        policy.on_push(1, push(store, torch.zeros(store.num_params), store.flat.buffers, 8), {1})
    assert assignment == HOLD  # shard done: wait for the epoch to end
    assert seen == [(0, b, 0, 2) for b in range(4)]  # 64 samples, 2 shards, batch 8
    assert not policy.epoch_done({1, 2})  # worker 2 has not done its share
    assert policy.epoch_done({1})  # ... unless it is dead
    assert not policy.epoch_done(set()) and policy.stuck(set())  # all dead, 2's share undone
    while isinstance(policy.next_assignment(2), Assignment):
        policy.on_push(2, push(store, torch.zeros(store.num_params), store.flat.buffers, 8), {2})
    assert policy.epoch_done(set())  # both shares done before they went: a finished epoch
    assert policy.next_assignment(3) == HOLD  # not in this epoch's roster: waits


def test_ssp_holds_a_worker_that_runs_too_far_ahead() -> None:
    store = make_store()
    policy = AsyncPolicy(
        store, make_job(store, world_size=2), epochs=1, max_steps=None, staleness_bound=1
    )
    policy.begin_epoch([1, 2])
    policy.observe_live({1, 2})
    zeros = torch.zeros(store.num_params)

    def push_from(worker_id: int) -> None:
        assignment = policy.next_assignment(worker_id)
        assert isinstance(assignment, Assignment), assignment
        policy.on_push(worker_id, push(store, zeros, store.flat.buffers, 8), {1, 2})

    push_from(1)  # 1 step ahead of worker 2: allowed
    push_from(1)  # now 2 ahead
    assert policy.next_assignment(1) == HOLD
    push_from(2)  # the slowest catches up by one
    assert isinstance(policy.next_assignment(1), Assignment)
    push_from(1)
    assert policy.next_assignment(1) == HOLD
    policy.observe_live({1})  # worker 2 died: nobody to wait for
    assert isinstance(policy.next_assignment(1), Assignment)


def test_staleness_scales_the_async_learning_rate() -> None:
    store = make_store(lr=1.0)
    policy = AsyncPolicy(store, make_job(store, world_size=2), epochs=1, max_steps=None)
    policy.begin_epoch([1, 2])
    before = store.flat.params.clone()
    ones = torch.ones(store.num_params)
    policy.on_push(1, push(store, ones, store.flat.buffers, 8), {1, 2})
    policy.on_push(2, push(store, ones, store.flat.buffers, 8, version=0), {1, 2})
    policy.on_push(1, push(store, ones, store.flat.buffers, 8, version=0), {1, 2})
    # Staleness 0, 1 and 2: steps of lr, lr / 1 and lr / 2.
    torch.testing.assert_close(store.flat.params, before - 2.5)


def test_sync_names_the_open_step_and_whom_it_waits_for() -> None:
    """What the leader announces to follower shards (STEP_PLAN) as each step opens."""
    store = make_store()
    policy = SyncPolicy(store, make_job(store, world_size=2), epochs=1, max_steps=None)
    assert policy.open_step({1, 2}) is None  # no epoch yet
    policy.begin_epoch([1, 2])
    step = policy.open_step({1, 2})
    assert step is not None and step.key == (0, 0, 0)
    assert (step.expected, step.share, step.workers) == (16, 8, (1, 2))
    dead_one = policy.open_step({2})
    assert dead_one is not None and dead_one.workers == (2,) and dead_one.share == 8
    assert policy.open_step(set()) is None  # nobody left to wait for
    p, f = store.num_params, store.num_buffers
    for worker in (1, 2):
        policy.on_push(worker, push(store, torch.zeros(p), torch.zeros(f), samples=8), {1, 2})
    after = policy.open_step({1, 2})
    assert after is not None and after.key == (1, 0, 1)


def test_an_epoch_resumed_with_another_number_of_workers_goes_on_where_its_data_stopped() -> None:
    """Sync step b of N workers takes the block perm[N*B*b : N*B*(b+1)] of the epoch's
    permutation (rank r every N-th sample from r). Resumed with another N, the epoch goes on
    at the step whose block starts at the first sample not yet taken (or the one before):
    it used to go on at the same step number, skipping or repeating whole blocks."""
    from common.assignment import shard_indices, steps_per_epoch
    from psserver.policies.epochs import EpochPlan, resumed_batch

    samples, batch_size = 640, 16

    def block(world: int, step: int) -> set[int]:
        ranks = [shard_indices(samples, 0, 3, r, world) for r in range(world)]
        return {int(i) for s in ranks for i in s[step * batch_size : (step + 1) * batch_size]}

    done = set().union(*(block(2, step) for step in range(7)))  # 7 steps of 2 workers
    for world in (1, 2, 3, 4):
        step = resumed_batch(7, 2, world)
        steps = steps_per_epoch(samples, world, batch_size)
        rest = set().union(*(block(world, s) for s in range(step, steps)))
        assert done | rest == set(range(samples)), f"{world} workers skip samples"
        assert len(done & rest) < world * batch_size, f"{world} workers repeat a whole step"
    assert [resumed_batch(7, 2, w) for w in (1, 2, 3, 4)] == [14, 7, 4, 3]

    # The position a sync policy saves says how many workers its steps were of.
    store = make_store()
    saving = SyncPolicy(store, make_job(store, world_size=2), epochs=1, max_steps=None)
    saving.begin_epoch([1, 2])
    saving.batch = 3
    resumed = SyncPolicy(store, make_job(store, world_size=4), epochs=1, max_steps=None)
    resumed.restore(saving.position())
    resumed.resume_into(EpochPlan(0, (1, 2, 3, 4), 4))
    assert resumed.batch == 1  # 3 steps of 2 workers: 1.5 steps of 4
    old = SyncPolicy(store, make_job(store, world_size=4), epochs=1, max_steps=None)
    old.restore({"epoch": 0, "batch": 3, "cursors": []})  # a checkpoint from before: as is
    old.resume_into(EpochPlan(0, (1, 2, 3, 4), 4))
    assert old.batch == 3


@pytest.mark.parametrize("policy_class", [SyncPolicy, AsyncPolicy])
def test_an_abandoned_epoch_does_not_count_toward_epochs_and_a_resume_knows_it(
    policy_class: type,
) -> None:
    store = make_store()
    job = make_job(store, world_size=1)
    policy = policy_class(store, job, epochs=1, max_steps=None)
    policy.begin_epoch([1])
    policy.abandon_epoch()
    assert (policy.completed_epochs, policy.abandoned_epochs, policy.full_epochs) == (1, 1, 0)
    assert not policy.finished()  # the one epoch asked for is still to train
    resumed = policy_class(store, job, epochs=1, max_steps=None)
    resumed.restore(policy.position())
    assert not resumed.finished() and resumed.abandoned_epochs == 1
    assert resumed.begin_epoch([1]).epoch == 1  # a new epoch: a late push for 0 is late
    resumed.end_epoch()
    assert resumed.finished() and resumed.full_epochs == 1
    old = policy_class(store, job, epochs=1, max_steps=None)
    old.restore({"epoch": 1, "batch": 0, "cursors": []})  # a checkpoint from before: none
    assert old.finished() and old.abandoned_epochs == 0


def test_a_workers_progress_total_is_the_most_steps_it_can_compute() -> None:
    """Async with --max-steps 200 and 2 workers: a fast worker computed 188 steps while its
    bar said 100 (an even share)."""
    from psworker.batches import planned_steps

    store = make_store()
    job = make_job(store, world_size=2)  # 4 steps a shard, 1 epoch
    for mode in ("sync", "async", "ssp"):
        many = JobSpec.from_dict({**job.to_dict(), "mode": mode, "epochs": 100, "max_steps": 200})
        assert planned_steps(many) == 200
        few = JobSpec.from_dict({**job.to_dict(), "mode": mode, "max_steps": 200})
        assert planned_steps(few) == 4


def test_an_epoch_of_one_worker_says_one_worker(caplog: pytest.LogCaptureFixture) -> None:
    """The log said "epoch 0 begins: 1 workers [1]"."""
    store = make_store()
    policy = AsyncPolicy(store, make_job(store, world_size=1), epochs=1, max_steps=None)
    with caplog.at_level("INFO"):
        policy.begin_epoch([1])
    assert "epoch 0 begins: 1 worker [1], 8 steps per shard" in caplog.text, caplog.text
