"""The update policies in-process: exact sample-weighted averaging, BatchNorm buffer
averaging (sync) and running averaging (async), and the errors for stale or repeated pushes."""

import pytest
import torch

from common.errors import RequestRejected
from common.job import JobSpec
from common.protocol import Push
from psserver.policies import AsyncPolicy, SyncPolicy
from psserver.store import ParameterStore


def make_store(lr: float = 1.0) -> ParameterStore:
    return ParameterStore("resnet18", seed=0, lr=lr, momentum=0.0, weight_decay=0.0)


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
    )


def push(
    store: ParameterStore,
    grads: torch.Tensor,
    buffers: torch.Tensor,
    samples: int,
    version: int | None = None,
) -> Push:
    v = store.version if version is None else version
    return Push(1, v, 0, 0, samples, 0.0, 0, grads, buffers)


def test_sync_step_is_the_sample_weighted_mean_and_buffers_are_averaged() -> None:
    store = make_store()
    policy = SyncPolicy(store, make_job(store, world_size=2), epochs=1, max_steps=None)
    p, f = store.num_params, store.num_buffers
    before = store.flat.params.clone()
    g1, g2 = torch.full((p,), 4.0), torch.full((p,), 1.0)
    b1, b2 = torch.full((f,), 2.0), torch.full((f,), 6.0)

    first = policy.on_push(1, push(store, g1, b1, samples=1))
    assert first.acknowledged == [] and store.version == 0  # waits for the second worker
    with pytest.raises(RequestRejected, match="already pushed"):
        policy.on_push(1, push(store, g1, b1, samples=1))
    second = policy.on_push(2, push(store, g2, b2, samples=3))
    assert sorted(second.acknowledged) == [1, 2] and store.version == 1

    # (1 * 4 + 3 * 1) / 4 = 1.75 exactly; lr 1 without momentum subtracts it once.
    assert torch.equal(store.flat.params, before - 1.75)
    assert torch.equal(store.flat.buffers, torch.full((f,), 4.0))
    assert int(store.model.state_dict()["0.1.num_batches_tracked"]) == 1

    with pytest.raises(RequestRejected, match="dropped"):
        policy.on_push(1, push(store, g1, b1, samples=1, version=0))


def test_async_applies_each_push_and_blends_buffers() -> None:
    store = make_store(lr=0.5)
    policy = AsyncPolicy(store, make_job(store, world_size=4), epochs=1, max_steps=None)
    p, f = store.num_params, store.num_buffers
    start_params, start_buffers = store.flat.params.clone(), store.flat.buffers.clone()
    target = torch.full((f,), 8.0)

    result = policy.on_push(1, push(store, torch.full((p,), 2.0), target, samples=8))
    assert result.acknowledged == [1] and result.staleness == 0 and store.version == 1
    assert torch.equal(store.flat.params, start_params - 1.0)
    # Running average: the master statistics move 1/N = 1/4 of the way to the worker's.
    torch.testing.assert_close(store.flat.buffers, start_buffers + (target - start_buffers) / 4)

    stale = policy.on_push(2, push(store, torch.zeros(p), target, samples=8, version=0))
    assert stale.staleness == 1
    assert policy.staleness_summary() == {
        "count": 2,
        "mean": 0.5,
        "max": 1,
        "histogram": {"0": 1, "1": 1},
    }
    with pytest.raises(RequestRejected, match="claims version"):
        policy.on_push(1, push(store, torch.zeros(p), target, samples=8, version=5))


def test_async_assignments_walk_each_shard_and_finish() -> None:
    store = make_store()
    policy = AsyncPolicy(store, make_job(store, world_size=2), epochs=2, max_steps=None)
    seen = []
    while (assignment := policy.next_assignment(1)) is not None:
        seen.append((assignment.epoch, assignment.batch))
        policy.on_push(1, push(store, torch.zeros(store.num_params), store.flat.buffers, 8))
    assert seen == [(e, b) for e in range(2) for b in range(4)]
    assert not policy.finished()  # worker 2 has not done its share
    assert policy.completed_epochs() == 0
