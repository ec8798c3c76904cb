"""Gradient buckets: workers send their gradient bucket by bucket while backward runs, and the
server applies each bucket as soon as every worker's part of it is in. The arithmetic is that
of a whole gradient, so the weights and the momentum equal a run without buckets bit for bit."""

import itertools
import json
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import zmq

from common.catalog import build_model
from common.errors import RequestRejected
from common.job import JobSpec
from common.sharding import bucket_bounds, shard_bounds, shard_bucket_bounds, shard_range
from common.wire.protocol import (
    Error,
    Message,
    MessageType,
    Pull,
    Push,
    PushAck,
    Status,
    StatusReply,
    Weights,
    Welcome,
    decode,
    encode,
)
from psserver.config import ServerConfig
from psserver.policies import AsyncPolicy, StepResult, SyncPolicy
from psserver.serving.pushes import PartLedger
from psserver.store.optimizer import FlatSGD, OptimizerSpec, SGDSettings
from psserver.store.parameters import ParameterStore
from tests.harness import CPU_WORKER, Cluster, kill
from tests.raw_peers import RawClient, bucket_push
from tests.test_sharding import JOB, assert_identical, train

BUCKETS = ["--bucket-mb", "0.05"]  # lenet (129k values) in nine buckets, fc1 in seven pieces
NO_INDICES = torch.empty(0, dtype=torch.int32)


def test_buckets_are_cut_at_tensor_boundaries_from_the_end() -> None:
    sizes = [4, 10, 3, 20, 5]  # ends at 4, 14, 17, 37, 42
    assert bucket_bounds(sizes, 0, 42, 0) == (0, 42)
    # From the end: 42 -> 37 is 5 (< 13), 42 -> 17 is 25, then 17 -> 4 is 13, and 4 is left.
    assert bucket_bounds(sizes, 0, 42, 13) == (0, 4, 17, 42)
    assert bucket_bounds(sizes, 0, 42, 100) == (0, 42)
    # Within a shard's range [10, 40): offsets from 10, cuts only at tensor ends inside it.
    assert bucket_bounds(sizes, 10, 40, 13) == (0, 7, 30)
    # Every shard's: the leader owns the last range [20, 42), follower 1 [0, 20).
    assert shard_bucket_bounds(sizes, (0, 20, 42), 13) == [(0, 22), (0, 4, 20)]
    resnet = [p.numel() for p in build_model("resnet18").parameters()]
    bounds = bucket_bounds(resnet, 0, sum(resnet), 2 * 2**20)  # 8 MB of float32
    assert bounds[0] == 0 and bounds[-1] == sum(resnet) and len(bounds) - 1 == 5


def test_default_buckets_cut_every_shard_as_finely_as_one_server() -> None:
    """Without --bucket-mb each of K shards gets 2/K MB buckets (at least 0.5 MB): ResNet-18's
    slices keep about 20 buckets each up to 4 shards, where 8 MB ones would leave one or
    two."""
    resnet = [p.numel() for p in build_model("resnet18").parameters()]
    sizes = {1: 2.0, 2: 1.0, 4: 0.5, 8: 0.5, 16: 0.5}
    for shards, mb in sizes.items():
        config = ServerConfig(num_shards=shards)
        assert config.bucket_size_mb == mb
        layout = shard_bucket_bounds(resnet, shard_bounds(sum(resnet), shards), config.bucket_numel)
        if shards <= 4:  # beyond, the 0.5 MB floor leaves fewer
            assert all(19 <= len(cuts) - 1 <= 21 for cuts in layout), (shards, layout)
        else:
            assert all(4 <= len(cuts) - 1 <= 10 for cuts in layout), (shards, layout)
    fixed = shard_bucket_bounds(
        resnet, shard_bounds(sum(resnet), 4), ServerConfig(num_shards=4, bucket_mb=8).bucket_numel
    )
    assert [len(cuts) - 1 for cuts in fixed] == [2, 2, 1, 1]
    # Given, --bucket-mb is used as it is: 0 still means one piece.
    assert ServerConfig(num_shards=4, bucket_mb=0).bucket_numel == 0
    assert ServerConfig(num_shards=4, bucket_mb=3).bucket_size_mb == 3


def test_buckets_of_twice_the_size_or_more_are_cut_into_equal_pieces() -> None:
    sizes = [4, 10, 3, 20, 5]
    # [17, 42) is 25 values: three pieces of at least 8 (8, 8, 9); [4, 17) is 13: one.
    assert bucket_bounds(sizes, 0, 42, 8) == (0, 4, 17, 25, 33, 42)
    assert bucket_bounds(sizes, 0, 42, 1) == tuple(range(43))  # every value on its own
    assert bucket_bounds(sizes, 10, 40, 8) == (0, 7, 18, 30)  # [7, 30) is 23: two pieces
    # ResNet-18 in 2 MB buckets: its 9.4 MB convolutions come in pieces, so no bucket is
    # more than twice the size asked for, and none but the first layers' is less.
    resnet = [p.numel() for p in build_model("resnet18").parameters()]
    numel = 2**19  # 2 MB of float32
    bounds = bucket_bounds(resnet, 0, sum(resnet), numel)
    sizes_cut = [end - start for start, end in itertools.pairwise(bounds)]
    assert max(sizes_cut) < 2 * numel and min(sizes_cut[1:]) >= numel and len(sizes_cut) == 19


def test_job_checks_its_buckets() -> None:
    base = JobSpec("sync", "lenet", "embedded", 2, 8, 0, None, 64, 4, 1, None, 10, 0, "none")
    assert base.num_buckets == 1 and base.bucket_range(0) == (0, 10)
    two = JobSpec.from_dict({**base.to_dict(), "bucket_bounds": [0, 4, 10]})
    assert two.num_buckets == 2 and two.bucket_range(1) == (4, 10)
    for wrong in ([0, 4], [0, 4, 4, 10], [1, 10], [0, 12]):
        with pytest.raises(Exception, match="bucket_bounds"):
            JobSpec.from_dict({**base.to_dict(), "bucket_bounds": wrong})
    # Three shards: the leader owns [6, 10), followers 1 and 2 [0, 3) and [3, 6).
    sharded = {**base.to_dict(), "shard_bounds": [0, 3, 6, 10]}
    layout = JobSpec.from_dict({**sharded, "slice_bucket_bounds": [[0, 1, 3], [0, 3]]})
    assert layout.shard_bucket_ranges(1) == [(0, 1), (1, 3)]
    assert layout.shard_bucket_ranges(2) == [(0, 3)] and layout.shard_bucket_ranges(0) == [(0, 4)]
    assert JobSpec.from_dict(sharded).shard_bucket_ranges(1) == [(0, 3)]  # none: one each
    for wrong_slices in ([[0, 3]], [[0, 1, 3], [0, 4]], [[0, 3, 3], [0, 3]]):
        with pytest.raises(Exception, match=r"slice_bucket_bounds|bucket layout"):
            JobSpec.from_dict({**sharded, "slice_bucket_bounds": wrong_slices})


def test_flat_sgd_steps_ranges_exactly_like_torch_sgd() -> None:
    torch.manual_seed(0)
    params, grads = torch.randn(1000), torch.empty(1000)
    reference = torch.nn.Parameter(params.clone())
    torch_sgd = torch.optim.SGD([reference], lr=0.1, momentum=0.9, weight_decay=5e-4)
    ours = FlatSGD(params, grads, SGDSettings(0.1, 0.9, 5e-4))
    for _ in range(4):
        gradient = torch.randn(1000)
        reference.grad = gradient.clone()
        torch_sgd.step()
        grads.copy_(gradient)
        ours.step(600, 1000)  # the last layers first, as buckets are applied
        ours.step(0, 600)
        assert torch.equal(params, reference.detach())
        assert torch.equal(ours.momentum_buffer, torch_sgd.state[reference]["momentum_buffer"])


def test_push_part_round_trips() -> None:
    part = bucket_push(3, "t", 7, 1, 2, 32, 1, torch.arange(5.0).half())
    decoded = decode(encode(part))
    assert isinstance(decoded, Push) and decoded.TYPE is MessageType.PUSH
    assert (decoded.shard, decoded.bucket, decoded.samples) == (0, 1, 32)
    assert torch.equal(decoded.grads, part.grads)
    push = Push(3, "t", 7, 1, 2, 32, 0.5, 4, torch.empty(0), NO_INDICES, torch.ones(2), 3)
    assert decode(encode(push)).parts == 3


SYNC = ["--mode", "sync", "--batch-size", "32", "--epochs", "2"]


@pytest.fixture(scope="module")
def whole_gradient_run(
    tmp_path_factory: pytest.TempPathFactory, starts_processes: None
) -> Iterator[dict]:
    """The sync run without buckets that every case below is compared with, trained once for
    all of them (its checkpoint; a run is deterministic)."""
    cluster = Cluster(tmp_path_factory.mktemp("whole"))
    try:
        yield train(cluster, "whole", 1, *SYNC, "--bucket-mb", "0")
    finally:
        cluster.kill_all()


@pytest.mark.parametrize(
    ("shards", "worker_args", "server_args"),
    [
        (1, ("--overlap",), ()),
        (1, ("--overlap",), ("--no-stream-weights",)),
        (1, ("--no-overlap",), ()),
        (3, ("--overlap",), ()),
    ],
)
def test_buckets_train_exactly_like_a_whole_gradient(
    cluster: Cluster,
    whole_gradient_run: dict,
    shards: int,
    worker_args: tuple[str, ...],
    server_args: tuple[str, ...],
) -> None:
    # --overlap sends parts from autograd hooks; --no-overlap sends the whole gradient, which
    # the server still applies bucket by bucket. With 3 shards the leader's third is cut.
    whole = whole_gradient_run
    summary_path = cluster.workdir / "bucketed.json"
    bucketed = train(
        cluster, "bucketed", shards, *SYNC, *BUCKETS, "--summary", str(summary_path),
        *server_args, worker_args=worker_args,
    )  # fmt: skip
    steps = whole["step"]
    assert steps == 2 * 640 // 64
    assert_identical(whole, bucketed)
    # With --overlap and buckets, every updated bucket went to both workers as soon as it
    # was applied, so every pull but each worker's first left the parameters out; and the
    # weights they trained on were right, or the runs would differ. With 3 shards each
    # streams its own slice, and the summary adds the followers' bytes to the leader's.
    summary = json.loads(summary_path.read_text())
    sizes = [p.numel() for p in build_model("lenet").parameters()]
    lo, hi = shard_range(shard_bounds(sum(sizes), shards), 0)
    buckets = len(bucket_bounds(sizes, lo, hi, int(0.05 * 2**20) // 4)) - 1
    streams = "--overlap" in worker_args and buckets > 1 and not server_args
    assert streams or shards == 3 or "--no-overlap" in worker_args or server_args
    assert summary["streamed_bytes"] == (2 * steps * 4 * sum(sizes) if streams else 0)
    assert summary["streamed_pulls"] == (2 * (steps - 1) if streams else 0)


def test_a_job_in_tens_of_thousands_of_buckets_finishes_its_steps(cluster: Cluster) -> None:
    """--bucket-mb 0.00002 cuts LeNet into 26k buckets of 5 values, each a message of its own
    from a worker that sends them as backward makes them: the job ends, and its weights are
    those of the whole gradient. (Each step once cost the server buckets squared, and with
    0.00001 and two workers no step finished; what a part costs the server is counted in
    test_thousands_of_buckets_cost_each_part_only_its_own_bucket.)"""
    args = ["--batch-size", "16", "--max-steps", "2"]
    whole = train(cluster, "whole", 1, *args, "--bucket-mb", "0", workers=1)
    # Only a guard against a hang: the job takes 15 to 70 s on 2 cores shared with other
    # runs, and a bound near that failed when the load grew.
    _, tiny = cluster.train_to_end(
        "tiny", [*JOB, *args, "--bucket-mb", "0.00002"], [CPU_WORKER], timeout=600,
        worker_args=["--overlap"],
    )  # fmt: skip
    sizes = [p.numel() for p in build_model("lenet").parameters()]
    assert len(bucket_bounds(sizes, 0, sum(sizes), 5)) - 1 > 25_000
    assert_identical(whole, tiny)


def test_fp16_buckets_train_exactly_like_a_whole_fp16_gradient(cluster: Cluster) -> None:
    # Each bucket is compressed on its own; the server widens and sums it the same way.
    args = [*SYNC, "--compress", "fp16"]
    whole = train(cluster, "whole", 1, *args, "--bucket-mb", "0")
    bucketed = train(cluster, "bucketed", 1, *args, *BUCKETS)
    assert_identical(whole, bucketed)


def test_async_buckets_apply_like_a_whole_gradient(cluster: Cluster) -> None:
    # One async worker is deterministic: every part is applied with staleness 0.
    args = ["--mode", "async", "--batch-size", "32", "--epochs", "1"]
    whole = train(cluster, "whole", 1, *args, "--bucket-mb", "0", workers=1)
    bucketed = train(cluster, "bucketed", 1, *args, *BUCKETS, workers=1)
    assert_identical(whole, bucketed)


def test_parts_add_up_exactly_and_bad_parts_are_refused_at_the_push(
    cluster: Cluster, zmq_context: zmq.Context
) -> None:
    """A raw client sends integer gradients in parts. lr 1 without momentum: after each PUSH
    the weights moved by exactly the gradient. Missing, wrong and forged parts never land."""
    checkpoints = cluster.workdir / "ckpt"
    server, endpoint = cluster.start_server(
        "--mode", "async", "--no-staleness-lr", "--model", "lenet", "--workers", "1",
        "--lr", "1", "--max-steps", "3", "--train-limit", "64", "--batch-size", "8",
        "--test-limit", "20", "--checkpoint-dir", str(checkpoints), "--bucket-mb", "0.15",
    )  # fmt: skip
    client = RawClient(zmq_context, endpoint)
    welcome = client.register()
    assert isinstance(welcome, Welcome), welcome
    job = JobSpec.from_dict(welcome.job)
    wid, token, buckets = welcome.worker_id, client.token, job.num_buckets
    assert buckets == 3

    def pull() -> Weights:
        weights = client.request(Pull(wid, token))
        assert isinstance(weights, Weights), weights
        return weights

    def part(w: Weights, bucket: int, grads: torch.Tensor, token: str = token) -> None:
        lo, hi = job.bucket_range(bucket)
        client.send_frames(
            [bytes(f) for f in encode(bucket_push(wid, token, w.version, w.epoch, w.batch, 8,
                                                  bucket, grads[lo:hi]))]
        )  # fmt: skip

    def push(w: Weights, parts: int = buckets) -> Message:
        empty = torch.empty(0)
        return client.request(
            Push(wid, token, w.version, w.epoch, w.batch, 8, 0.0, 0, empty, NO_INDICES,
                 torch.zeros(job.num_buffers), parts)
        )  # fmt: skip

    generator = torch.Generator().manual_seed(1)
    weights = pull()
    expected = weights.params.clone()
    grads = torch.randint(-8, 9, (job.num_params,), generator=generator).float()

    # A part under a stolen id (wrong token) gets no reply and changes nothing.
    part(weights, 0, torch.full((job.num_params,), 1e6), token="impostor")
    # A part of the wrong size is refused, and so is its PUSH, with the reason.
    part(weights, 2, grads[:-1])
    refused = push(weights)
    assert isinstance(refused, Error) and refused.code == "wrong-shape", refused
    # A PUSH whose parts did not all come is refused; they count once when sent again.
    part(weights, 2, grads)
    part(weights, 2, grads)  # sent twice: applied once
    incomplete = push(weights)
    assert isinstance(incomplete, Error) and incomplete.code == "incomplete-push", incomplete
    assert "buckets [0, 1] did not arrive" in incomplete.message
    for bucket in (1, 0):
        part(weights, bucket, grads)
    ack = push(weights)
    assert isinstance(ack, PushAck) and ack.version == 1, ack
    expected -= grads
    assert torch.equal(pull().params, expected)

    status = client.request(Status())  # the server is alive and counted what it refused
    assert isinstance(status, StatusReply) and status.status["rejected_requests"] >= 3
    client.close()
    kill(server)


# ---- the sync policy, in-process: when each bucket is applied, and with what -------------


def bucketed_policy(
    bounds: tuple[int, ...], min_workers: int = 1
) -> tuple[SyncPolicy, ParameterStore]:
    store = ParameterStore("lenet", seed=0, optimizer=OptimizerSpec(lr=1.0))
    job = JobSpec(
        "sync", "lenet", "embedded", 3, 8, 0, None, 96, 4, 1, None, store.num_params,
        store.num_buffers, "none", bucket_bounds=bounds,
    )  # fmt: skip
    policy = SyncPolicy(store, job, epochs=1, max_steps=None, min_workers=min_workers)
    policy.begin_epoch([1, 2, 3])
    return policy, store


def send_part(policy: SyncPolicy, worker: int, bucket: int, value: float, live: set[int]) -> None:
    lo, hi = policy.job.bucket_range(bucket)
    part = bucket_push(
        worker, "t", policy.store.version, 0, 0, 8, bucket, torch.full((hi - lo,), value)
    )
    policy.on_part(worker, part, live)


def finish(policy: SyncPolicy, worker: int, live: set[int]) -> list[int]:
    buffers = torch.zeros(policy.store.num_buffers)
    push = Push(worker, "t", policy.store.version, 0, 0, 8, 0.0, 0, torch.empty(0), NO_INDICES,
                buffers, parts=policy.job.num_buckets)  # fmt: skip
    return policy.on_push(worker, push, live).acknowledged


def test_a_bucket_is_applied_once_every_live_worker_has_sent_it() -> None:
    n = ParameterStore("lenet", seed=0, optimizer=OptimizerSpec(lr=1.0)).num_params
    policy, store = bucketed_policy((0, 1000, n))
    before = store.flat.params.clone()
    live = {1, 2, 3}
    for worker, value in ((1, 3.0), (2, 6.0)):
        send_part(policy, worker, 1, value, live)
    assert torch.equal(store.flat.params, before)  # worker 3's part is missing
    send_part(policy, 3, 1, 0.0, live)
    send_part(policy, 3, 1, 99.0, live)  # sent again: ignored
    # The last layers' bucket moved by the mean (3 + 6 + 0) / 3 = 3, the first not at all,
    # and the version waits for the step to close.
    assert torch.equal(store.flat.params[1000:], before[1000:] - 3.0)
    assert torch.equal(store.flat.params[:1000], before[:1000]) and store.version == 0
    for worker in (1, 2, 3):
        send_part(policy, worker, 0, float(worker), live)
    assert [finish(policy, w, live) for w in (1, 2)] == [[], []]
    assert sorted(finish(policy, 3, live)) == [1, 2, 3] and store.version == 1
    assert torch.equal(store.flat.params[:1000], before[:1000] - 2.0)
    assert torch.equal(store.flat.params[1000:], before[1000:] - 3.0)  # applied once


def test_a_worker_lost_between_parts_and_push_counts_where_its_parts_came() -> None:
    n = ParameterStore("lenet", seed=0, optimizer=OptimizerSpec(lr=1.0)).num_params
    policy, store = bucketed_policy((0, 1000, n))
    before = store.flat.params.clone()
    live = {1, 2, 3}
    send_part(policy, 1, 1, 3.0, live)
    send_part(policy, 2, 1, 6.0, live)
    send_part(policy, 3, 1, 9.0, live)  # worker 3 then dies before its first bucket and PUSH
    for worker in (1, 2):
        send_part(policy, worker, 0, float(worker), live)
        finish(policy, worker, live)
    closed = policy.try_close({1, 2})  # worker 3 declared dead
    assert sorted(closed.acknowledged) == [1, 2] and store.version == 1
    # Bucket 1 had all three parts: their mean, 6. Bucket 0 had two: (1 + 2) / 2.
    assert torch.equal(store.flat.params[1000:], before[1000:] - 6.0)
    assert torch.equal(store.flat.params[:1000], before[:1000] - 1.5)


def test_half_precision_gradients_sum_the_same_in_any_order() -> None:
    # fp16 gradients are often subnormal (below 6e-5). Scaled in fp16 they would round, and
    # the sum of two workers would depend on whose push came first.
    from psserver.store.parameters import add_weighted

    torch.manual_seed(0)
    a, b = (torch.randn(1000) * 1e-5).half(), (torch.randn(1000) * 1e-5).half()
    sums = []
    for first, second in ((a, b), (b, a)):
        total = torch.empty(1000)
        add_weighted(total, first, NO_INDICES, 0.5, first=True, sparse=False)
        add_weighted(total, second, NO_INDICES, 0.5, first=False, sparse=False)
        sums.append(total)
    assert torch.equal(sums[0], sums[1])
    assert torch.equal(sums[0], (a.float() + b.float()) * 0.5)


def test_an_async_step_computed_again_applies_each_bucket_once_at_one_learning_rate() -> None:
    """Async with the staleness-aware lr, two buckets, lr 1, gradients of ones. Worker 1's
    bucket 0 is applied at version 0 (staleness 0), its bucket 1 is lost, so its PUSH is
    "incomplete-push"; worker 2 moves the version to 2; worker 1 computes the same batch again
    on version 2 and sends both parts. Bucket 0 must not be applied a second time, and bucket 1
    and the COMMIT for the follower shards take the lr the push began with (staleness 0, not
    2). Before the fix the ledger keyed parts by version, so bucket 0 was applied again."""
    store = ParameterStore("lenet", seed=0, optimizer=OptimizerSpec(lr=1.0))
    n, half = store.num_params, store.num_params // 2
    job = JobSpec(
        "async", "lenet", "embedded", 2, 8, 0, None, 64, 4, 1, None, n, store.num_buffers,
        "none", bucket_bounds=(0, half, n),
    )  # fmt: skip
    policy, ledger, live = AsyncPolicy(store, job, 1, None), PartLedger(2), {1, 2}
    policy.begin_epoch([1, 2])
    buffers, before = torch.zeros(store.num_buffers), store.flat.params.clone()

    def part(worker: int, bucket: int) -> None:
        lo, hi = job.bucket_range(bucket)
        message = bucket_push(worker, "t", store.version, 0, 0, 8, bucket, torch.ones(hi - lo))
        if ledger.admit(worker, message):  # as psserver.serving.pushes.PushHandler.on_part
            policy.on_part(worker, message, live)
            ledger.record(worker, message)

    def push(worker: int, batch: int, parts: int) -> StepResult:
        grads = torch.empty(0) if parts else torch.ones(n)
        message = Push(worker, "t", store.version, 0, batch, 8, 0.0, 0, grads, NO_INDICES,
                       buffers, parts)  # fmt: skip
        if parts:
            ledger.complete(worker, message)
        return policy.on_push(worker, message, live)

    part(1, 1)  # bucket 1 comes first (last layers first); bucket 0 is lost
    with pytest.raises(RequestRejected, match=r"buckets \[0\] did not arrive"):
        push(1, 0, parts=2)
    push(2, 0, parts=0)
    push(2, 1, parts=0)
    assert store.version == 2
    part(1, 1)  # in already: ignored
    part(1, 0)
    result = push(1, 0, parts=2)
    assert result.staleness == 0 and result.commit is not None and result.commit.lr_scale == 1.0
    # Every value took three steps of -1 (lr 1 x 1): no more, no fewer, none of them halved.
    assert torch.equal(store.flat.params, before - 1.0 - 1.0 - 1.0)


def test_thousands_of_buckets_cost_each_part_only_its_own_bucket() -> None:
    """Every part used to scan every bucket for one that had become ready, so a step cost
    buckets squared: LeNet in 4,960 buckets took 3.5 s a step, and in 30,000 it never finished
    one. Here every 4 values are a bucket (32k buckets, 64k parts a step), and the books of
    the buckets count how often they are read: a few times per part and bucket, not once per
    bucket for every part (a count, not a clock, so that a loaded machine cannot fail it). The
    weights and the momentum equal those of one bucket fed the same gradients, bit for bit."""
    n = ParameterStore("lenet", seed=0, optimizer=OptimizerSpec(lr=0.1, momentum=0.9)).num_params
    tiny = (*range(0, n, 4), n)
    stores, policies = [], []
    for bounds in (tiny, ()):
        store = ParameterStore("lenet", seed=0, optimizer=OptimizerSpec(lr=0.1, momentum=0.9))
        job = JobSpec(
            "sync", "lenet", "embedded", 2, 8, 0, None, 64, 4, 1, None, n, store.num_buffers,
            "none", bucket_bounds=bounds,
        )  # fmt: skip
        policy = SyncPolicy(store, job, epochs=1, max_steps=None)
        policy.begin_epoch([1, 2])
        stores.append(store)
        policies.append(policy)
    bucketed, whole = policies
    assert bucketed.job.num_buckets == len(tiny) - 1 > 30_000
    live, buffers = {1, 2}, torch.zeros(stores[0].num_buffers)
    generator = torch.Generator().manual_seed(0)
    # A part reads its bucket's books to add itself and again to see whether the bucket is
    # ready, and an applied bucket once more: 5 reads per bucket with two workers, and 6 in
    # the first step, whose first part scans every bucket (the roster is new). The old scan
    # read every bucket not yet applied for every part: thousands per part.
    buckets = bucketed.job.num_buckets
    books = bucketed._bucket_samples = ReadsCounted(bucketed._bucket_samples)
    for batch in range(2):
        grads = {w: torch.randn(n, generator=generator) for w in live}
        books.reads, books.budget = 0, 8 * buckets
        # Last layers first, as backward makes them, the two workers' parts interleaved.
        for bucket in reversed(range(buckets)):
            for worker in (1, 2):
                lo, hi = tiny[bucket], tiny[bucket + 1]
                part = bucket_push(worker, "t", batch, 0, batch, 8, bucket, grads[worker][lo:hi])
                bucketed.on_part(worker, part, live)
        for policy in (bucketed, whole):
            for worker in (1, 2):
                dense = torch.empty(0) if policy is bucketed else grads[worker]
                parts = bucketed.job.num_buckets if policy is bucketed else 0
                push = Push(worker, "t", batch, 0, batch, 8, 0.0, 0, dense, NO_INDICES, buffers,
                            parts=parts)  # fmt: skip
                policy.on_push(worker, push, live)
        assert stores[0].version == stores[1].version == batch + 1
    assert torch.equal(stores[0].flat.params, stores[1].flat.params)
    momentum = [store.momentum() for store in stores]
    assert momentum[0] is not None and momentum[1] is not None
    assert torch.equal(momentum[0], momentum[1])


class ReadsCounted(list[dict[int, int]]):
    """A policy's books of its buckets that count how often a bucket is read, and fail the
    test at once when the reads pass `budget`: a step that cost buckets squared would
    otherwise take minutes to fail."""

    def __init__(self, books: list[dict[int, int]]) -> None:
        super().__init__(books)
        self.reads, self.budget = 0, 0

    def __getitem__(self, index: Any) -> Any:
        self.reads += 1
        if self.reads > self.budget:  # not an assert: its message would print the books
            raise AssertionError(
                f"over {self.budget} reads of the bucket books in one step of {len(self)} "
                "buckets: a part costs work for more than its own bucket"
            )
        return super().__getitem__(index)
