"""The PyTorch reference runs of `ps-bench train`: one plain process, DDP, and DDP's ranks
training apart.

Each run is a child process that `psserver.bench.baselines` starts and waits for:

    python -m psserver.bench.ddp single --model M --batch-size NB --steps S --out F ...
    python -m psserver.bench.ddp rank --rank R --world-size N --master-port P --out F ...

`rank --no-sync` trains each rank's own copy of the model on its shard, with no all-reduce:
the ranks meet only at the timer's two barriers. No data-parallel system can train faster on
the same processes and threads, so it is the compute bound that every other run is read
against (`ps-bench train`'s `compute_bound` phase).

Rank 0 hosts the rendezvous store at --master-addr.

Both train `build_model(model, seed=0)` with SGD (lr 0.1) and cross-entropy on the embedded
training set, held on the device once, with batches drawn exactly like the parameter server's
shards (`common.assignment.shard_indices`, i.e. DistributedSampler's order). The first
`WARMUP_STEPS` steps are not timed (allocator, kernel selection, gloo/NCCL connections).
Each run writes `{"images_per_second", "samples", "seconds"}` to `--out`; for ranks only rank 0
writes, and its count is the world's: every rank's shard has the same length. Ranks add
`replicas_identical`, whether all of them ended with the same weights (checked after the
clock stops): true for DDP, false for ranks apart.

What this is not: a tuned baseline. No AMP, no channels_last, no DataLoader workers, DDP with
its default buckets and buffer broadcast. It is plain PyTorch as a user would first write it.
"""

import dataclasses
import datetime
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import click
import torch
import torch.distributed as dist
from torch import nn

from common import catalog
from common.assignment import batch_slice, shard_indices, steps_per_epoch
from common.catalog import MODEL_NAMES, build_model
from common.cli import explain_errors
from common.data import DataSource, ImageSet
from common.memory import reuse_large_buffers
from common.options import Option, options
from common.roles import Role
from common.startup import freeze_imported_objects
from psserver.status.report import WARMUP_STEPS

SEED = 0  # the ps-server's default --seed: same initial weights and data order
LR = 0.1  # the ps-server's default --lr
RENDEZVOUS_TIMEOUT = datetime.timedelta(seconds=120)
LEFT_KEY = "ps-bench/ranks-left"  # counted up by each rank after destroy_process_group


@dataclasses.dataclass(frozen=True)
class Timing:
    """Samples processed by the timed steps and how long those steps took; for ranks, also
    whether every rank ended with the same weights (DDP must; ranks apart must not)."""

    samples: int
    seconds: float
    replicas_identical: bool | None = None

    @property
    def images_per_second(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # a CPU-GPU sync point, only at the timer's edges


def load_training_set(device: torch.device) -> ImageSet:
    """The embedded training set on `device`, once: a batch is then an index, not a copy."""
    data = catalog.load_training_set(DataSource())
    return ImageSet(data.images.to(device), data.labels.to(device))


def timed_training(
    model: nn.Module,
    data: ImageSet,
    batch_size: int,
    steps: int,
    device: torch.device,
    rank: int = 0,
    world_size: int = 1,
    barrier: Callable[[], object] = lambda: None,
    keep_gradients: bool = False,
) -> Timing:
    """Train for `steps` steps of this rank's shard; time all but the first WARMUP_STEPS.
    `keep_gradients`: zero the gradients between steps instead of freeing them."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model.train()
    per_epoch = steps_per_epoch(len(data), world_size, batch_size)
    shard_epoch, shard = -1, torch.empty(0, dtype=torch.long)
    started, samples = time.perf_counter(), 0
    for step in range(steps):
        if step == WARMUP_STEPS:
            _synchronize(device)
            barrier()  # every rank starts its clock together
            started, samples = time.perf_counter(), 0
        epoch, batch = divmod(step, per_epoch)
        if epoch != shard_epoch:
            shard_epoch = epoch
            shard = shard_indices(len(data), epoch, SEED, rank, world_size).to(device)
        indices = batch_slice(shard, batch, batch_size)
        images, labels = data.images[indices], data.labels[indices]  # (B, 1, 28, 28), (B,)
        optimizer.zero_grad(set_to_none=not keep_gradients)
        loss = nn.functional.cross_entropy(model(images), labels)
        loss.backward()  # DDP: gradients are all-reduced here, overlapped with backward
        optimizer.step()
        samples += len(indices)
    _synchronize(device)
    barrier()  # the run lasts until the slowest rank is done
    return Timing(samples, time.perf_counter() - started)


def run_single(model_name: str, batch_size: int, steps: int, device: torch.device) -> Timing:
    model = build_model(model_name, seed=SEED).to(device)
    return timed_training(model, load_training_set(device), batch_size, steps, device)


def run_rank(
    model_name: str,
    batch_size: int,
    steps: int,
    device: torch.device,
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    sync: bool = True,
) -> Timing:
    """One DDP rank (with `sync` False, one rank training apart: the process group only
    times the run); the returned timing counts the samples of all ranks."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    hosts_store = rank == 0
    # The store is ours rather than init_method's, so that rank 0 closes it in order, once
    # every rank has counted itself out (wait_for_every_rank_to_leave); every rank then
    # exits without the interpreter's teardown (ddp_rank), where torch's threads aborted.
    store = dist.TCPStore(
        master_addr,
        master_port,
        world_size,
        is_master=hosts_store,
        timeout=RENDEZVOUS_TIMEOUT,
    )
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size, timeout=RENDEZVOUS_TIMEOUT
    )
    try:
        model = build_model(model_name, seed=SEED).to(device)
        trained = _wrap_in_ddp(model, device) if sync else model
        data = load_training_set(device)
        # Ranks apart keep their gradients from step to step, as DDP's bucket views do:
        # freed, each step's 45 MB (ResNet-18) would be allocated afresh, and the two runs
        # would differ in more than the all-reduce.
        timing = timed_training(
            trained, data, batch_size, steps, device, rank, world_size,
            barrier=dist.barrier, keep_gradients=not sync,
        )  # fmt: skip
        # One rank has nothing to compare: the check is for worlds of 2 or more.
        identical = replicas_identical(model) if world_size > 1 else None
    finally:
        dist.destroy_process_group()
    wait_for_every_rank_to_leave(store, world_size, hosts_store)
    del store  # rank 0: its server thread stops here, under no rank's feet
    return Timing(timing.samples * world_size, timing.seconds, identical)


def replicas_identical(model: nn.Module) -> bool:
    """Whether every rank holds the same weights, bit for bit: each weight's smallest and
    largest value over the ranks agree. (Not a checksum: a sum's bits can differ between
    hosts whose kernels add in another order.) A check on the baseline itself: DDP that
    trained replicas apart, or "apart" ranks that synchronised, would measure something
    else. Two all-reduces of the model, after the clock has stopped."""
    with torch.no_grad():
        low = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        high = low.clone()
        dist.all_reduce(low, op=dist.ReduceOp.MIN)
        dist.all_reduce(high, op=dist.ReduceOp.MAX)
        return bool(torch.equal(low, high))


def _wrap_in_ddp(model: nn.Module, device: torch.device) -> nn.Module:
    # Gradients as views into DDP's buckets spare a copy of every gradient a step: DDP as
    # its documentation tunes it, so the baseline is not one we made slow.
    return nn.parallel.DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        gradient_as_bucket_view=True,
    )


def wait_for_every_rank_to_leave(store: dist.TCPStore, world_size: int, hosts: bool) -> None:
    """Each rank counts itself out once it has left the process group; the store's host
    waits for the count, so that it closes the store under no rank's feet."""
    left = store.add(LEFT_KEY, 1)
    deadline = time.monotonic() + RENDEZVOUS_TIMEOUT.total_seconds()
    while hosts and left < world_size and time.monotonic() < deadline:
        time.sleep(0.01)
        left = store.add(LEFT_KEY, 0)


def write_timing(path: Path, timing: Timing) -> None:
    record: dict[str, object] = {
        "images_per_second": timing.images_per_second,
        "samples": timing.samples,
        "seconds": timing.seconds,
    }
    if timing.replicas_identical is not None:
        record["replicas_identical"] = timing.replicas_identical
    path.write_text(json.dumps(record) + "\n")


REFERENCE_OPTIONS = (
    Option("--model", type=click.Choice(list(MODEL_NAMES)), required=True),
    Option("--batch-size", type=click.IntRange(min=1), required=True),
    Option("--steps", type=click.IntRange(min=WARMUP_STEPS + 1), required=True),
    Option("--threads", type=click.IntRange(min=1), required=True),
    Option("--device", default="cpu", help="cpu or cuda:N"),
    Option("--out", type=click.Path(dir_okay=False, path_type=Path), required=True),
)
SINGLE = Role("psserver.bench.ddp", REFERENCE_OPTIONS, ("single",))
RANK = Role(
    "psserver.bench.ddp",
    (
        *REFERENCE_OPTIONS,
        Option("--rank", type=click.IntRange(min=0), required=True),
        Option("--world-size", type=click.IntRange(min=1), required=True),
        Option("--master-addr", default="127.0.0.1"),
        Option("--master-port", type=click.IntRange(1, 65535), required=True),
        Option(
            "--no-sync",
            is_flag=True,
            help="Train this rank's own copy, with no all-reduce: the compute bound of the ranks.",
        ),
    ),
    ("rank",),
)


@click.group()
def command() -> None:
    """PyTorch reference runs for ps-bench train (started by it, not by hand)."""
    # The same malloc as ps-worker's, so that the comparison is of the training, not of
    # how often each side's allocator hands large buffers back to the kernel.
    reuse_large_buffers()


@command.command()
@options(SINGLE.options)
@explain_errors
def single(model: str, batch_size: int, steps: int, threads: int, device: str, out: Path) -> None:
    """A plain PyTorch training loop in this one process."""
    torch.set_num_threads(threads)
    write_timing(out, run_single(model, batch_size, steps, torch.device(device)))


@command.command("rank")
@options(RANK.options)
@explain_errors
def ddp_rank(
    model: str,
    batch_size: int,
    steps: int,
    threads: int,
    device: str,
    out: Path,
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    no_sync: bool,
) -> None:
    """One rank of a DistributedDataParallel run (or, with --no-sync, of ranks training
    apart); rank 0 writes the result."""
    torch.set_num_threads(threads)
    timing = run_rank(
        model,
        batch_size,
        steps,
        torch.device(device),
        rank,
        world_size,
        master_addr,
        master_port,
        sync=not no_sync,
    )
    if rank == 0:
        write_timing(out, timing)
    # Done: the process group is destroyed, every rank has counted itself out of the store,
    # and rank 0 has written the result. Exit now, without the interpreter's teardown: there
    # a C++ thread of torch's, still joinable, sometimes aborted the process ("terminate
    # called without an active exception", SIGABRT) after its result was written, failing a
    # finished run: on ranks other than 0, and (CI, 2026-11-25) on rank 0 hosting the store,
    # though it closed the store in order first.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main() -> None:
    freeze_imported_objects()
    command()


if __name__ == "__main__":
    main()
