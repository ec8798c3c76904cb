"""Sixteen concurrent clients, one thread and one socket each, against a live server.

The arithmetic is exact, so any lost, doubled or misrouted gradient shows: with lr 1 and no
momentum the first update zeroes the weights (w - w is exactly 0), and every later gradient is
a small integer c times a fixed integer vector B_r of its worker, so every sum and every mean
over 16 workers is exactly representable in float32. The final weights are read back from the
checkpoint the server writes at the end.
"""

import collections
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import zmq

from common.catalog import build_model
from common.wire.protocol import Pull, Push, PushAck, Stop, Weights, Welcome
from psserver.checkpoints.files import LATEST, read_checkpoint
from tests.harness import Cluster, Proc
from tests.raw_peers import RawClient

pytestmark = [pytest.mark.fault, pytest.mark.timeout(150)]

WORKERS = 16
JOIN_TIMEOUT_S = 90
LENET_PARAMS = 129_068


def directions() -> list[torch.Tensor]:
    """B_r: a fixed vector of integers in [-3, 3] for every worker r."""
    generator = torch.Generator().manual_seed(1000)
    return [
        torch.randint(-3, 4, (LENET_PARAMS,), generator=generator).float()  # (P,)
        for _ in range(WORKERS)
    ]


def coefficient(rank: int, step: int) -> int:
    """c: the multiple of B_r a worker pushes at a given step, in [-3, 3]."""
    return (rank * 5 + step * 3) % 7 - 3


def final_params(checkpoint_dir: Path) -> tuple[int, torch.Tensor]:
    state = read_checkpoint(checkpoint_dir / LATEST)
    model = build_model("lenet")
    model.load_state_dict(state["model"])
    return state["step"], torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@dataclass
class Worker:
    """What one client thread did; read by the test after the thread is joined."""

    rank: int
    acks: list[PushAck] = field(default_factory=list)
    coefficients: int = 0  # sum of c over this worker's applied integer gradients
    error: BaseException | None = None
    stopped: bool = False


def run_threads(workers: list[Worker], body: Callable[[Worker], None], what: str) -> None:
    def guarded(worker: Worker) -> None:
        try:
            body(worker)
        except BaseException as exc:  # reported by the main thread below
            worker.error = exc

    threads = [
        threading.Thread(target=guarded, args=(w,), name=f"{what}-{w.rank}", daemon=True)
        for w in workers
    ]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    for thread in threads:
        thread.join(max(0.1, deadline - time.monotonic()))
    hung = [t.name for t in threads if t.is_alive()]
    assert not hung, f"threads still running after {JOIN_TIMEOUT_S} s (deadlock?): {hung}"
    failed = [f"rank {w.rank}: {w.error!r}" for w in workers if w.error is not None]
    assert not failed, "client threads failed:\n" + "\n".join(failed)


def push(client: RawClient, worker_id: int, weights: Weights, grads: torch.Tensor) -> object:
    return client.request(
        Push(
            worker_id,
            client.token,
            weights.version,
            weights.epoch,
            weights.batch,
            1,  # samples: equal for all, so the sample-weighted mean is the plain mean
            0.0,
            0,
            grads,
            torch.empty(0, dtype=torch.int32),
            torch.empty(0),  # LeNet has no BatchNorm buffers
        )
    )


def register_all(context: zmq.Context, endpoint: str) -> list[tuple[RawClient, int]]:
    clients = []
    for rank in range(WORKERS):
        client = RawClient(context, endpoint, timeout_s=30)
        welcome = client.register(f"load-{rank}")
        assert isinstance(welcome, Welcome), welcome
        clients.append((client, welcome.worker_id))
    return clients


def start_server(cluster: Cluster, mode: str, *args: str) -> tuple[Proc, str]:
    return cluster.start_server(
        "--mode",
        mode,
        "--model",
        "lenet",
        "--workers",
        str(WORKERS),
        "--lr",
        "1",
        "--momentum",
        "0",
        "--batch-size",
        "1",
        "--test-limit",
        "50",
        "--worker-timeout",
        "120",  # raw clients send no heartbeats; their requests are their only sign of life
        "--checkpoint-dir",
        str(cluster.workdir / "checkpoints"),
        "--summary",
        str(cluster.workdir / "summary.json"),
        *args,
    )


def test_sixteen_sync_workers_step_in_lockstep_with_exact_means(
    cluster: Cluster, zmq_context: zmq.Context
) -> None:
    steps = 200
    # Each shard holds 1120 / 16 = 70 images: 70 steps per epoch at batch 1, so the run
    # crosses two epoch boundaries and stops at --max-steps in the middle of the third.
    server, endpoint = start_server(
        cluster,
        "sync",
        "--train-limit",
        "1120",
        "--epochs",
        "5",
        "--max-steps",
        str(steps),
        "--step-timeout",
        "600",  # no step may close without all 16 gradients
    )
    clients = register_all(zmq_context, endpoint)
    workers = [Worker(rank) for rank in range(WORKERS)]
    vectors = directions()
    epochs_seen: set[int] = set()

    def train(worker: Worker) -> None:
        client, worker_id = clients[worker.rank]
        b = vectors[worker.rank]
        expected = None  # rank 0 checks every version it is sent against the exact sum
        while True:
            weights = client.request(Pull(worker_id, client.token))
            if isinstance(weights, Stop):
                worker.stopped = True
                return
            assert isinstance(weights, Weights), weights
            assert weights.version == len(worker.acks), (weights.version, len(worker.acks))
            assert weights.params.numel() == b.numel()
            if weights.version == 0:
                # Rank 0 pushes 16 w0, the others 0: the mean is exactly w0, and w0 - w0 = 0.
                grads = weights.params * (WORKERS if worker.rank == 0 else 0)
                expected = torch.zeros_like(weights.params)
            else:
                c = coefficient(worker.rank, weights.version)
                grads = c * b
                worker.coefficients += c
                if worker.rank == 0:
                    assert expected is not None
                    assert torch.equal(weights.params, expected), f"version {weights.version}"
                    mean = (
                        sum(coefficient(r, weights.version) * vectors[r] for r in range(WORKERS))
                        / WORKERS
                    )
                    expected = expected - mean
            if worker.rank == 0:
                epochs_seen.add(weights.epoch)
            ack = push(client, worker_id, weights, grads)
            assert isinstance(ack, PushAck), ack
            assert ack == PushAck(weights.version + 1, 0, True), ack
            worker.acks.append(ack)

    started = time.monotonic()
    run_threads(workers, train, "sync")
    seconds = time.monotonic() - started
    print(f"sync: {WORKERS} threads x {steps} steps in {seconds:.1f} s")

    assert [len(w.acks) for w in workers] == [steps] * WORKERS
    assert all(w.stopped for w in workers)
    assert epochs_seen == {0, 1, 2}
    cluster.wait(server, timeout=60)
    summary = json.loads((cluster.workdir / "summary.json").read_text())
    assert summary["global_steps"] == steps
    assert summary["epochs"] == 2
    step, params = final_params(cluster.workdir / "checkpoints")
    assert step == steps
    # Weights are multiples of 1/16 below 2^10: float64 sums of them are exact too.
    expected = -sum(w.coefficients * vectors[w.rank].double() for w in workers)
    assert torch.equal(params.double(), expected / WORKERS)
    assert "Traceback" not in server.stderr()
    for client, _ in clients:
        client.close()


def test_sixteen_async_workers_apply_every_acknowledged_push_exactly_once(
    cluster: Cluster, zmq_context: zmq.Context
) -> None:
    updates = 600
    # 128 images / 16 = 8 steps per shard: 128 updates an epoch, and --max-steps 600 ends
    # the run in the fifth epoch while workers still have pushes in flight.
    server, endpoint = start_server(
        cluster,
        "async",
        "--no-staleness-lr",  # exact sums: every gradient at the full learning rate
        "--train-limit",
        "128",
        "--epochs",
        "10",
        "--max-steps",
        str(updates),
    )
    clients = register_all(zmq_context, endpoint)
    workers = [Worker(rank) for rank in range(WORKERS)]
    vectors = directions()
    zeroed = threading.Event()  # rank 0's first push (w0 itself) has been applied
    refused = collections.Counter[str]()  # replies to pushes other than an applied ack
    lock = threading.Lock()

    def train(worker: Worker) -> None:
        client, worker_id = clients[worker.rank]
        b = vectors[worker.rank]
        pushes = 0
        while True:
            weights = client.request(Pull(worker_id, client.token))
            if isinstance(weights, Stop):
                worker.stopped = True
                return
            assert isinstance(weights, Weights), weights
            assert weights.params.numel() == b.numel()
            if worker.rank == 0 and pushes == 0:
                assert weights.version == 0
                grads, c = weights.params.clone(), 0  # w0 - w0 = 0 exactly
            else:
                # Every other push waits for the zeroing; until then the weights hold w0.
                assert zeroed.wait(30), "rank 0 never zeroed the weights"
                c = coefficient(worker.rank, pushes)
                grads = c * b
            pushes += 1
            reply = push(client, worker_id, weights, grads)
            if isinstance(reply, Stop):  # the run ended while this push was on its way
                with lock:
                    refused["stop"] += 1
                worker.stopped = True
                return
            assert isinstance(reply, PushAck), reply
            if not reply.applied:
                with lock:
                    refused["not-applied"] += 1
                continue
            worker.acks.append(reply)
            worker.coefficients += c
            if worker.rank == 0 and pushes == 1:
                assert reply == PushAck(1, 0, True), reply
                zeroed.set()

    started = time.monotonic()
    run_threads(workers, train, "async")
    seconds = time.monotonic() - started

    acks = [ack for w in workers for ack in w.acks]
    staleness = collections.Counter(ack.staleness for ack in acks)
    print(
        f"async: {WORKERS} threads, {len(acks)} applied pushes in {seconds:.1f} s, "
        f"max staleness {max(staleness)}, refused {dict(refused)}, "
        f"staleness histogram {dict(sorted(staleness.items()))}"
    )
    assert all(w.stopped for w in workers)
    assert refused["not-applied"] == 0  # async never drops a gradient
    assert len(acks) == updates
    # Each applied push made exactly one new version.
    assert sorted(ack.version for ack in acks) == list(range(1, updates + 1))

    cluster.wait(server, timeout=60)
    summary = json.loads((cluster.workdir / "summary.json").read_text())
    assert summary["global_steps"] == updates
    assert summary["staleness"]["count"] == updates
    assert summary["staleness"]["histogram"] == {str(k): v for k, v in sorted(staleness.items())}
    assert summary["staleness"]["max"] == max(staleness)
    step, params = final_params(cluster.workdir / "checkpoints")
    assert step == updates
    expected = -sum(w.coefficients * vectors[w.rank] for w in workers)
    assert torch.equal(params, expected)
    assert "Traceback" not in server.stderr()
    for client, _ in clients:
        client.close()
