"""The sample-assignment seam (common.assignment): what the leader's side counts (steps,
shares) and what the worker's side trains (indices) must agree, step by step, and deal out
every sample of an epoch."""

import pytest
import torch

from common.assignment import Assignment, StaticShards, sample_assignment


def test_an_assignment_is_named_by_its_epoch_and_batch() -> None:
    assert Assignment(epoch=2, batch=5, rank=1, world_size=3).key == (2, 5)


@pytest.mark.parametrize("world", [1, 3, 4])
def test_both_sides_agree_and_every_sample_is_dealt_out(world: int) -> None:
    num_samples, batch_size = 103, 8
    samples = sample_assignment(num_samples, batch_size, seed=4)
    assert isinstance(samples, StaticShards)
    single = sample_assignment(num_samples, world * batch_size, seed=4)
    for epoch in range(2):
        assert samples.steps(world) == single.steps(1)
        seen = []
        for batch in range(samples.steps(world)):
            ranks = [samples.indices(Assignment(epoch, batch, r, world)) for r in range(world)]
            share = samples.share(batch, world)
            assert [len(indices) for indices in ranks] == [share] * world
            together = torch.cat(ranks)
            whole = single.indices(Assignment(epoch, batch, 0, 1))
            # Batch t of every rank is batch t of one worker with a batch world times larger
            # (the padding repeats at the end aside), as a set: what makes sync exact.
            assert set(together.tolist()) >= set(whole.tolist())
            seen.extend(together.tolist())
        assert set(seen) == set(range(num_samples))
        assert len(seen) == -(-num_samples // world) * world  # padded to equal shards


def test_the_next_epoch_draws_another_order_and_the_same_epoch_the_same() -> None:
    samples = sample_assignment(50, 10, seed=0)
    first = samples.indices(Assignment(0, 0, 0, 2))
    other = samples.indices(Assignment(1, 0, 0, 2))
    assert not torch.equal(first, other)
    assert torch.equal(first, sample_assignment(50, 10, seed=0).indices(Assignment(0, 0, 0, 2)))
    assert samples.indices(Assignment(1, 5, 0, 2)).numel() == 0  # past the epoch's end
