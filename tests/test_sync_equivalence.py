"""Sync mode trains as one big batch would: N workers with batch B give the weights of 1
worker with batch N*B, and both those of plain single-process PyTorch on the same global
batches. Compared within rtol 1e-4, atol 1e-5, not bit for bit: a mean over N*B samples is
summed in another order when it is N means of B (LeNet has no BatchNorm, so the order of
float rounding is all that differs)."""

import torch

from common.assignment import batch_slice, shard_indices, steps_per_epoch
from common.catalog import build_model
from common.data import DataSource, load_split
from tests.harness import CPU_WORKER, Cluster

TRAIN_LIMIT = 640  # divisible by every global batch below, so shards need no padding
COMMON = [
    "--mode",
    "sync",
    "--model",
    "lenet",
    "--train-limit",
    str(TRAIN_LIMIT),
    "--test-limit",
    "200",
    "--epochs",
    "2",
    "--lr",
    "0.05",
    "--momentum",
    "0.9",
    "--weight-decay",
    "0.0005",
    "--seed",
    "7",
]


def train_with_servers(cluster: Cluster, workers: int, batch: int, name: str) -> dict:
    server_args = [*COMMON, "--batch-size", str(batch)]
    return cluster.train_to_end(name, server_args, [CPU_WORKER] * workers, timeout=180)[1]


def train_single_process(world_size: int, batch: int) -> dict[str, torch.Tensor]:
    """Plain PyTorch: step k trains on the concatenation of every rank's batch k. The mean
    loss over that concatenation is exactly the sample-weighted mean the server computes."""
    train = load_split(DataSource(), train=True, limit=TRAIN_LIMIT)
    model = build_model("lenet", seed=7)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=0.0005)
    for epoch in range(2):
        shards = [shard_indices(TRAIN_LIMIT, epoch, 7, r, world_size) for r in range(world_size)]
        for step in range(steps_per_epoch(TRAIN_LIMIT, world_size, batch)):
            indices = torch.cat([batch_slice(shard, step, batch) for shard in shards])
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(
                model(train.images[indices]), train.labels[indices]
            )
            loss.backward()
            optimizer.step()
    return model.state_dict()


def assert_close_weights(a: dict, b: dict) -> None:
    """Equal to float rounding (see the module doc): rtol 1e-4, atol 1e-5."""
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-5, msg=key)


def test_two_workers_of_32_equal_one_worker_of_64(cluster: Cluster) -> None:
    torch.set_num_threads(1)
    two = train_with_servers(cluster, workers=2, batch=32, name="two")
    one = train_with_servers(cluster, workers=1, batch=64, name="one")
    expected_steps = 2 * TRAIN_LIMIT // 64
    assert two["step"] == one["step"] == expected_steps

    initial = build_model("lenet", seed=7).state_dict()
    moved = max((two["model"][k] - initial[k]).abs().max().item() for k in initial)
    assert moved > 1e-2, "training did not change the weights; the comparison would be vacuous"

    assert_close_weights(two["model"], one["model"])
    assert_close_weights(two["model"], train_single_process(world_size=1, batch=64))


def test_three_workers_match_single_process(cluster: Cluster) -> None:
    # 640 is not divisible by 3: shards are padded by wrapping, exactly as DistributedSampler.
    torch.set_num_threads(1)
    three = train_with_servers(cluster, workers=3, batch=16, name="three")
    assert three["step"] == 2 * steps_per_epoch(TRAIN_LIMIT, 3, 16)
    assert_close_weights(three["model"], train_single_process(world_size=3, batch=16))
