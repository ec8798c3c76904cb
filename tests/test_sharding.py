"""Server sharding: K servers, each owning one slice of the flat parameters, train exactly like
one server. Every shard adds up its slice with the same arithmetic in the leader's order, so
the weights and the momentum are equal bit for bit, not merely close."""

import dataclasses
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from subprocess import CompletedProcess
from typing import NamedTuple

import pytest
import torch
import zmq

from common.catalog import all_fingerprints
from common.errors import ConfigError, ProtocolError
from common.job import JobSpec
from common.sharding import MAX_SHARDS, shard_bounds, shard_range, split_gradient
from common.wire.protocol import (
    LEADER_ID,
    Commit,
    Error,
    Message,
    Pull,
    Push,
    PushAck,
    Register,
    Status,
    StatusReply,
    Weights,
    Welcome,
    decode,
    encode,
)
from psserver.cli.status import request_status
from psserver.config import ServerConfig
from tests.harness import (
    CPU_WORKER,
    Cluster,
    Proc,
    free_port_pair,
    kill,
    wait_for_log,
    wait_for_state,
)
from tests.raw_peers import RawClient, completing_push, slice_pull, slice_push
from tests.test_cli import assert_clean_error, run

JOB = [
    "--model", "lenet", "--train-limit", "640", "--test-limit", "100", "--lr", "0.05",
    "--momentum", "0.9", "--weight-decay", "0.0005", "--seed", "3",
]  # fmt: skip
NO_INDICES = torch.empty(0, dtype=torch.int32)


def train(
    cluster: Cluster,
    name: str,
    shards: int,
    *args: str,
    workers: int = 2,
    folder: str = "",
    worker_args: tuple[str, ...] = (),
    logs: list[str] | None = None,
) -> dict:
    """Run a job with real processes and return its final checkpoint (gathered by shard 0);
    the server's log (and its followers') goes to `logs`."""
    server, checkpoint = cluster.train_to_end(
        name, [*JOB, "--num-shards", str(shards), *args], [CPU_WORKER] * workers,
        timeout=180, worker_args=worker_args, folder=folder,
    )  # fmt: skip
    if logs is not None:
        logs.append(server.stderr())
    return checkpoint


def assert_identical(a: dict, b: dict) -> None:
    assert a["step"] == b["step"]
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    momentum_a = a["optimizer"]["state"][0]["momentum_buffer"]
    momentum_b = b["optimizer"]["state"][0]["momentum_buffer"]
    assert torch.equal(momentum_a, momentum_b)


def test_bounds_are_balanced_and_gradients_split_by_position() -> None:
    assert shard_bounds(10, 3) == (0, 3, 6, 10)
    assert shard_bounds(7, 1) == (0, 7)
    with pytest.raises(ValueError):
        shard_bounds(2, 3)
    dense = torch.arange(10.0)
    pieces = split_gradient(dense, NO_INDICES, (0, 3, 6, 10), sparse=False)
    assert [p[0].tolist() for p in pieces] == [[6, 7, 8, 9], [0, 1, 2], [3, 4, 5]]
    assert [shard_range((0, 3, 6, 10), i) for i in range(3)] == [(6, 10), (0, 3), (3, 6)]
    values, indices = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([9, 0, 4], dtype=torch.int32)
    sparse = split_gradient(values, indices, (0, 3, 6, 10), sparse=True)
    # The leader (shard 0) owns the last range; follower i the i-th from the start.
    expected = [([1.0], [3]), ([2.0], [0]), ([3.0], [1])]
    assert [(v.tolist(), i.tolist()) for v, i in sparse] == expected


def test_job_checks_its_shard_layout() -> None:
    base = JobSpec("sync", "lenet", "embedded", 2, 8, 0, None, 64, 4, 1, None, 10, 0, "none")
    assert base.bounds == (0, 10) and base.num_shards == 1
    assert JobSpec.from_dict({**base.to_dict(), "shard_bounds": [0, 5, 10]}).num_shards == 2
    with pytest.raises(ProtocolError, match="shard_bounds"):
        JobSpec.from_dict({**base.to_dict(), "shard_bounds": [0, 7, 5]})
    with pytest.raises(ProtocolError, match="endpoints"):
        JobSpec.from_dict(
            {**base.to_dict(), "shard_bounds": [0, 5, 10], "shard_endpoints": ["a", "b"]}
        )


def one_shard_args(compress: str) -> list[str]:
    """The sync job of test_three_shards_train_exactly_like_one, in buckets."""
    args = ["--mode", "sync", "--batch-size", "32", "--epochs", "2", "--compress", compress]
    return [*args, "--bucket-mb", "0.05"]


@pytest.fixture(scope="module")
def one_shard_run(
    tmp_path_factory: pytest.TempPathFactory, starts_processes: None
) -> Iterator[Callable[[str], tuple[dict, dict]]]:
    """The one-server run (its checkpoint and summary) that the three-shard runs of each
    --compress are compared with, trained once for all of them: a run is deterministic, and
    the cases that differ only in the workers' --overlap compare with the same run."""
    cluster = Cluster(tmp_path_factory.mktemp("one"))
    runs: dict[str, tuple[dict, dict]] = {}

    def run(compress: str) -> tuple[dict, dict]:
        if compress not in runs:
            name = f"one-{compress.replace(':', '-')}"
            summary = cluster.workdir / f"{name}.json"
            checkpoint = train(
                cluster, name, 1, *one_shard_args(compress), "--summary", str(summary)
            )
            runs[compress] = checkpoint, json.loads(summary.read_text())
        return runs[compress]

    try:
        yield run
    finally:
        cluster.kill_all()


@pytest.mark.parametrize(
    ("compress", "overlap"),
    [("none", "--overlap"), ("none", "--no-overlap"), ("topk:0.05", "--overlap")],
)
def test_three_shards_train_exactly_like_one(
    cluster: Cluster, one_shard_run: Callable[[str], tuple[dict, dict]], compress: str,
    overlap: str,
) -> None:  # fmt: skip
    # Dense slices go out from autograd hooks (--overlap) or after backward; top-k always
    # after backward (it needs the whole gradient). With overlap, follower 1 takes its slice
    # in three buckets and streams each back as soon as it is applied.
    logs: list[str] = []
    one, one_summary = one_shard_run(compress)
    summary_path = cluster.workdir / "three.json"
    three = train(
        cluster, "three", 3, *one_shard_args(compress), "--summary", str(summary_path),
        worker_args=(overlap,), logs=logs,
    )  # fmt: skip
    assert one["step"] == 2 * 640 // 64
    assert_identical(one, three)
    # The same gradients crossed the wire, however they were cut: the summary adds up the
    # followers' slices (they report them to the leader), not the leader's alone.
    three_summary = json.loads(summary_path.read_text())
    assert three_summary["push_bytes"] == one_summary["push_bytes"] > 0
    if overlap == "--overlap" and compress == "none":  # every bucket streamed back, in both
        assert three_summary["streamed_bytes"] == one_summary["streamed_bytes"] > 0
    streamed = re.search(r"shard 1 stops at step 20; ([0-9.]+) MB streamed", logs[0])
    assert streamed is not None, logs[0][-2000:]
    # 20 steps x 2 workers x the slice's 43,022 float32 values, or nothing without buckets.
    expected = 20 * 2 * 43022 * 4 / 1e6 if (compress, overlap) == ("none", "--overlap") else 0
    assert float(streamed.group(1)) == pytest.approx(expected, abs=0.05)  # the log's 0.1 MB


def test_async_and_resume_across_shard_counts(cluster: Cluster) -> None:
    # One async worker is deterministic. A run of 1 epoch on 3 shards, resumed for a second
    # epoch on 2 shards, ends where 2 epochs on 1 shard end: the checkpoint is the same for
    # any K, and the momentum travels to the shards with their slices.
    args = ["--mode", "async", "--batch-size", "32", "--no-staleness-lr"]
    straight = train(cluster, "straight", 1, *args, "--epochs", "2", workers=1)
    checkpoints = cluster.workdir / "split"
    train(cluster, "first", 3, *args, "--epochs", "1", workers=1, folder="split")
    resumed = train(
        cluster, "resumed", 2, *args, "--epochs", "2", "--resume", workers=1, folder="split"
    )
    assert resumed["step"] == 2 * 640 // 32
    assert_identical(straight, resumed)
    assert (checkpoints / "previous.pt").exists()

    # Resumed once more, the run is already over: it is evaluated and ends cleanly, with its
    # follower, and neither checkpoint is written again.
    saved = {p.name: p.read_bytes() for p in checkpoints.iterdir()}
    server, _ = cluster.start_server(
        *JOB, *args, "--workers", "1", "--num-shards", "2", "--checkpoint-dir",
        str(checkpoints), "--epochs", "2", "--resume", "--stop-grace", "1", name="over-server",
    )  # fmt: skip
    cluster.wait(server, timeout=60)
    log = server.stderr()
    assert "the checkpoint's run is already over at step 40" in log
    assert "shard 1 stops at step 40" in log and "Traceback" not in log
    assert re.search(r"final \(step 40\): test accuracy", log), log[-2000:]
    assert {p.name: p.read_bytes() for p in checkpoints.iterdir()} == saved


def test_shards_apply_exactly_what_the_leader_commits(
    cluster: Cluster, zmq_context: zmq.Context
) -> None:
    """Shards started one by one (as on several hosts); a raw client pushes integer gradients
    and garbage. lr 1 without momentum: the weights move by exactly the committed sum."""
    checkpoints = cluster.workdir / "ckpt"
    leader, endpoint, follower = start_leader_and_follower(
        cluster, "--mode", "async", "--no-staleness-lr", "--model", "lenet", "--workers", "1",
        "--lr", "1", "--max-steps", "3", "--train-limit", "64", "--batch-size", "8",
        "--test-limit", "20", "--checkpoint-dir", str(checkpoints), "--stop-grace", "1",
    )  # fmt: skip
    client = RawClient(zmq_context, endpoint)
    welcome = client.register()  # answered once the follower has joined
    assert isinstance(welcome, Welcome), welcome
    job = JobSpec.from_dict(welcome.job)
    assert job.num_shards == 2 and len(job.shard_endpoints) == 1
    wid, (lo, mid, hi) = welcome.worker_id, job.bounds  # the follower owns [lo, mid)
    shard = RawClient(zmq_context, job.shard_endpoints[0])

    # Garbage, a wrong shape and a forged commit are refused; the shard keeps serving.
    shard.send_frames([b"\x00garbage"])
    assert isinstance(shard.receive("an error"), Error)
    wrong = shard.request(slice_push(wid, client.token, 0, 0, 0, torch.ones(3)))
    assert isinstance(wrong, Error) and wrong.code == "wrong-shape"
    forged = shard.request(Commit("not-the-token", 0, [[wid, client.token, 0, 0, 0, 8]], 0, 1.0))
    assert isinstance(forged, Error) and forged.code == "not-leader"
    ping = shard.request(Pull(LEADER_ID, "not-the-token", -1, 1, -1))
    assert isinstance(ping, Error) and ping.code == "not-leader"
    wrong_place = shard.request(Pull(wid, client.token))  # shard 0's slice, sent to shard 1
    assert isinstance(wrong_place, Error) and wrong_place.code == "wrong-shard"
    # A frame bigger than any model's slice is dropped by ZeroMQ before it is read into
    # memory, as on the leader.
    flooder = RawClient(zmq_context, job.shard_endpoints[0], timeout_s=1)
    flooder.send_frames([encode(Pull(wid, "x"))[0], b"\0" * (64 << 20)])
    assert not flooder.socket.poll(1000), "an oversized message got a reply"
    flooder.close()

    start = torch.cat(
        [pull_slice(shard, wid, client.token, 0).params, pull(client, shard, wid, 0)[0].params]
    )
    generator = torch.Generator().manual_seed(1)
    expected = start.clone()  # SGD with lr 1: w - g, one rounding, as computed here
    for version in range(3):
        weights, current = pull(client, shard, wid, version)
        assert weights.version == version
        grads = torch.randint(-8, 9, (hi,), generator=generator).float()
        ack = shard.request(
            slice_push(wid, client.token, version, weights.epoch, weights.batch, grads[lo:mid])
        )
        assert isinstance(ack, PushAck) and ack.applied and ack.shard == 1
        # An impostor's slice under this worker's id but without its token is refused, so it
        # is never applied, nor does it displace the real one.
        forged = torch.full((mid - lo,), 1e6)
        impostor = shard.request(
            slice_push(wid, "impostor", version, weights.epoch, weights.batch, forged)
        )
        assert isinstance(impostor, Error) and impostor.code == "unknown-worker", impostor
        reply = client.request(
            Push(wid, client.token, version, weights.epoch, weights.batch, 8, 0.0, 0,
                 grads[mid:hi], NO_INDICES, torch.empty(0))
        )  # fmt: skip
        assert isinstance(reply, PushAck) and reply.version == version + 1
        assert torch.equal(current, expected)  # the weights this gradient was computed on
        expected = expected - grads
    cluster.wait(leader, timeout=60)
    cluster.wait(follower, timeout=30)
    final = torch.load(checkpoints / "latest.pt", weights_only=True)["model"]
    flat = torch.cat([t.reshape(-1) for k, t in final.items() if "running" not in k])
    assert torch.equal(flat, expected)
    assert not torch.equal(flat, start)


def pull_slice(shard: RawClient, worker_id: int, token: str, version: int) -> Weights:
    """Follower 1's slice at `version` or later; left out if it streamed every bucket of
    `version` to this connection (the pull says it holds that version)."""
    reply = shard.request(slice_pull(worker_id, token, version, have_version=version))
    assert isinstance(reply, Weights) and reply.shard == 1, reply
    return reply


def pull(
    client: RawClient, shard: RawClient, worker_id: int, version: int
) -> tuple[Weights, torch.Tensor]:
    weights = client.request(Pull(worker_id, client.token))
    assert isinstance(weights, Weights), weights
    return weights, torch.cat(
        [pull_slice(shard, worker_id, client.token, version).params, weights.params]
    )


def start_leader_and_follower(cluster: Cluster, *args: str) -> tuple[Proc, str, Proc]:
    leader, endpoint = cluster.start_server(*args, "--shard", "0", "--num-shards", "2")
    follower = cluster.start_follower(endpoint)
    return leader, endpoint, follower


class RawWorkerPair(NamedTuple):
    """A sync leader and one follower (lr 1, no momentum, the follower's slice in three
    buckets), two raw workers that pulled version 0, and integer gradients for them."""

    leader: Proc
    follower: Proc
    job: JobSpec
    buckets: list[tuple[int, int]]  # of the follower's slice, [0, mid)
    mid: int
    a: RawClient
    b: RawClient
    ids: dict[RawClient, int]
    shard: dict[RawClient, RawClient]  # each worker's connection to the follower
    weights: dict[RawClient, Message]  # each worker's first WEIGHTS
    grads: dict[RawClient, torch.Tensor]
    expected: torch.Tensor  # the follower's slice after one step of both gradients

    def leader_push(self, c: RawClient, version: int) -> Push:
        """Worker `c`'s push to the leader: its gradient past the follower's slice, of 8
        samples, on the weights of `version` it pulled."""
        w = self.weights[c]
        assert isinstance(w, Weights) and w.version == version
        return Push(
            self.ids[c], c.token, version, w.epoch, w.batch, 8, 0.0, 0, self.grads[c][self.mid :],
            NO_INDICES, torch.zeros(self.job.num_buffers),
        )  # fmt: skip


def start_two_raw_workers(
    cluster: Cluster, zmq_context: zmq.Context, max_steps: int, seed: int, *options: str
) -> RawWorkerPair:
    leader, endpoint, follower = start_leader_and_follower(
        cluster, "--mode", "sync", "--model", "lenet", "--workers", "2", "--lr", "1",
        "--momentum", "0", "--weight-decay", "0", "--max-steps", str(max_steps),
        "--train-limit", "64", "--batch-size", "8", "--test-limit", "20", "--bucket-mb", "0.08",
        *options,
    )  # fmt: skip
    a, b = RawClient(zmq_context, endpoint), RawClient(zmq_context, endpoint)
    welcome_a, welcome_b = a.register(), b.register()
    assert isinstance(welcome_a, Welcome) and isinstance(welcome_b, Welcome)
    job = JobSpec.from_dict(welcome_a.job)
    buckets = job.shard_bucket_ranges(1)
    assert len(buckets) == 3  # the follower's slice, [0, mid), in three buckets
    ids = {a: welcome_a.worker_id, b: welcome_b.worker_id}
    shard = {c: RawClient(zmq_context, job.shard_endpoints[0]) for c in (a, b)}
    mid = job.shard_range(1)[1]
    a.send_frames([bytes(f) for f in encode(Pull(ids[a], a.token))])
    weights = {b: b.request(Pull(ids[b], b.token)), a: a.receive("the first WEIGHTS")}
    assert all(isinstance(w, Weights) and w.version == 0 for w in weights.values())
    start = pull_slice(shard[a], ids[a], a.token, 0).params.clone()
    generator = torch.Generator().manual_seed(seed)
    grads = {c: torch.randint(-8, 9, (job.num_params,), generator=generator).float() for c in ids}
    expected = start - (grads[a][:mid] * 0.5 + grads[b][:mid] * 0.5)
    return RawWorkerPair(
        leader, follower, job, buckets, mid, a, b, ids, shard, weights, grads, expected
    )


def test_a_lost_shard_stops_the_job_with_a_clear_error(cluster: Cluster) -> None:
    leader, endpoint, follower = start_leader_and_follower(
        cluster, *JOB, "--workers", "1", "--batch-size", "8", "--epochs", "50",
        "--worker-timeout", "3",
    )  # fmt: skip
    worker = cluster.start_worker(endpoint, "--timeout", "5", "--retries", "0")
    wait_for_log(leader, "training starts", timeout=60)
    kill(follower)
    cluster.wait(leader, timeout=60, expect_code=1)
    assert "shard 1" in leader.stderr() and "Restart every shard" in leader.stderr()
    cluster.wait(worker, timeout=60, expect_code=None)


def test_an_abandoned_step_ends_on_the_follower_before_the_leader_evaluates(
    cluster: Cluster, zmq_context: zmq.Context
) -> None:
    """Both workers push their follower slices (which the follower's step plan applies at
    once) and then die, so the epoch is abandoned (--min-workers 2) and the leader evaluates,
    fetching the follower's slice. The follower must be told first that the step is over:
    before the fix it stayed inside the step, never answered the leader's PULL, and it quit
    with "shard 1 did not send its slice"."""
    leader, endpoint, follower = start_leader_and_follower(
        cluster, "--mode", "sync", "--model", "lenet", "--workers", "2", "--min-workers", "2",
        "--train-limit", "64", "--batch-size", "8", "--test-limit", "20",
        "--worker-timeout", "2", "--epochs", "3",
    )  # fmt: skip
    a, b = RawClient(zmq_context, endpoint), RawClient(zmq_context, endpoint)
    welcome_a, welcome_b = a.register(), b.register()
    assert isinstance(welcome_a, Welcome) and isinstance(welcome_b, Welcome)
    job = JobSpec.from_dict(welcome_a.job)
    lo, hi = job.shard_range(1)
    a.send_frames(encode(Pull(welcome_a.worker_id, a.token)))
    weights = {b: b.request(Pull(welcome_b.worker_id, b.token)), a: a.receive("WEIGHTS")}
    for client, welcome in ((a, welcome_a), (b, welcome_b)):
        w = weights[client]
        assert isinstance(w, Weights) and w.version == 0
        shard = RawClient(zmq_context, job.shard_endpoints[0])
        ack = shard.request(slice_push(welcome.worker_id, client.token, 0, w.epoch, w.batch,
                                       torch.ones(hi - lo)))  # fmt: skip
        assert isinstance(ack, PushAck) and ack.applied
        shard.close()
    # The workers fall silent: declared dead after 2 s, then the epoch is abandoned.
    wait_for_log(leader, "epoch 0 abandoned (step 0): test accuracy", timeout=30)
    # Evaluated (the FETCH answered), the job waits for workers, its follower with it.
    wait_for_state(
        leader, endpoint, "a wait for workers",
        lambda status: str(status["waiting_for"]).startswith("workers"),
    )  # fmt: skip
    assert follower.process.poll() is None, follower.describe()


def test_a_flood_of_slice_pulls_cannot_stop_the_leaders_fetch(
    cluster: Cluster, zmq_context: zmq.Context
) -> None:
    """Pulls for versions that have not come yet wait on the follower, in a capped list (one
    per connection); a pull for a version that cannot come soon is refused. A full list
    answers its oldest pull "busy" to make room (the newest may be a real worker's; refusing
    it let a tokenless flood end every worker of the job), and never refuses the leader's
    PULL: before that fix the final evaluation's pull was refused "busy" and the leader quit
    with "did not send its slice"."""
    leader, endpoint, follower = start_leader_and_follower(
        cluster, "--mode", "sync", "--model", "lenet", "--workers", "1", "--max-steps", "1",
        "--train-limit", "64", "--batch-size", "8", "--test-limit", "20", "--stop-grace", "1",
    )  # fmt: skip
    client = RawClient(zmq_context, endpoint)
    welcome = client.register()
    assert isinstance(welcome, Welcome), welcome
    job, wid = JobSpec.from_dict(welcome.job), welcome.worker_id
    shard_endpoint = job.shard_endpoints[0]
    weights, _ = pull(client, RawClient(zmq_context, shard_endpoint), wid, 0)

    far = RawClient(zmq_context, shard_endpoint).request(slice_pull(wid, client.token, 10**9))
    assert isinstance(far, Error) and far.code == "bad-version", far
    cap = 4 * 2 + 16  # 4 x --max-workers (2 x --workers) + 16
    flood = [RawClient(zmq_context, shard_endpoint) for _ in range(cap + 2)]
    for raw in flood:
        raw.send_frames(
            encode(slice_pull(wid, client.token, 5))
        )  # step 5 never comes (--max-steps 1)
        raw.send_frames(encode(slice_pull(wid, client.token, 5)))  # replaces the one before
    poller = zmq.Poller()
    for raw in flood:
        poller.register(raw.socket, zmq.POLLIN)

    def busy_replies(seconds: float) -> list[Message]:
        replies: list[Message] = []
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            for socket, _ in poller.poll(100):
                replies.append(decode(socket.recv_multipart()))
        assert all(isinstance(r, Error) and r.code == "busy" for r in replies), replies
        return replies

    # Which pulls were oldest is ZeroMQ's to choose (it takes connections in turn, not in the
    # order they sent); at least 2 made room.
    assert len(busy_replies(2)) >= 2
    # Then the real worker's pull, for the version its step will make, finds the list full:
    # it is held, and one more of the flood's makes room.
    worker = RawClient(zmq_context, shard_endpoint)
    worker.send_frames(encode(slice_pull(wid, client.token, 1)))
    assert len(busy_replies(1)) == 1
    assert not worker.socket.poll(0), "the newest pull was turned away"

    lo, hi = job.shard_range(1)
    shard = RawClient(zmq_context, shard_endpoint)
    ack = shard.request(slice_push(wid, client.token, 0, weights.epoch, weights.batch,
                                   torch.ones(hi - lo)))  # fmt: skip
    assert isinstance(ack, PushAck) and ack.applied
    reply = client.request(
        Push(wid, client.token, 0, weights.epoch, weights.batch, 8, 0.0, 0,
             torch.ones(job.num_params - hi), NO_INDICES, torch.empty(0))
    )  # fmt: skip
    assert isinstance(reply, PushAck) and reply.applied
    updated = worker.receive("the slice of step 1")
    assert isinstance(updated, Weights) and updated.version == 1, updated
    cluster.wait(leader, timeout=60)  # its final evaluation fetched the follower's slice
    cluster.wait(follower, timeout=30)


def test_a_registration_asked_again_while_shards_join_counts_once(
    cluster: Cluster, zmq_context: zmq.Context
) -> None:
    """The leader holds registrations until its followers have joined; a worker that waited
    past its timeout asks again on a new socket. The same process (REGISTER.process) must be
    welcomed once, on the socket it asked last: it used to be registered twice, or refused
    "busy" once its retries filled the waiting list. A twin alike in host, pid, name and
    device but another process (containers on the host's network) is a worker of its own: it
    used to replace the first one's held registration."""
    leader, endpoint = cluster.start_server(
        "--model", "lenet", "--workers", "1", "--max-workers", "2", "--train-limit", "64",
        "--batch-size", "8", "--test-limit", "20", "--shard", "0", "--num-shards", "2",
    )  # fmt: skip
    register = Register("raw", "host-a", "cpu", 4242, "p1", all_fingerprints())
    first, second, third, twin = (RawClient(zmq_context, endpoint) for _ in range(4))

    def held(client: RawClient, request: Register) -> None:
        """Send `request` and wait until the leader has read it: it handles a connection's
        requests in order, so its answer to a STATUS sent after it says so."""
        client.send_frames(encode(request))
        assert isinstance(client.request(Status()), StatusReply)

    held(first, register)
    held(second, register)  # the same process, after a timeout
    held(third, register)  # and once more: still one in the waiting list
    held(twin, dataclasses.replace(register, process="p2"))
    cluster.start_follower(endpoint)
    welcome = third.receive("the WELCOME, once the follower joined")
    assert isinstance(welcome, Welcome), welcome
    twins = twin.receive("the twin's WELCOME")
    assert isinstance(twins, Welcome) and twins.worker_id != welcome.worker_id, twins
    assert not first.socket.poll(1000) and not second.socket.poll(0)
    wait_for_log(leader, "all 2 shards have joined", timeout=30)
    assert leader.stderr().count("registered: raw on cpu (pid 4242)") == 2, leader.stderr()


def test_a_shard_that_does_not_fit_is_refused(cluster: Cluster) -> None:
    leader, endpoint = cluster.start_server(
        *JOB, "--workers", "1", "--num-shards", "2", "--shard", "0"
    )
    wrong = cluster.start_follower(endpoint, name="wrong", shard=2, num_shards=3)
    cluster.wait(wrong, timeout=60, expect_code=1)
    assert "this job has 2 shards" in wrong.stderr()
    assert "Traceback" not in wrong.stderr()
    # Meanwhile the leader's status says what it waits for.
    status = request_status(endpoint, timeout_s=10)
    assert status["phase"] == "waiting" and status["waiting_for"] == "follower shards [1] to join"
    # Without a shard secret or CURVE it takes any hello, as this test's, and says so once.
    assert leader.stderr().count("any host that reaches") == 1, leader.stderr()
    kill(leader)


def test_overlap_sends_each_slice_once_when_it_is_final() -> None:
    from common.catalog import build_model
    from common.model.flat import FlatModel
    from psworker.pusher import GradientStreamer

    torch.manual_seed(0)
    model = build_model("lenet", seed=0)
    flat = FlatModel(model)
    bounds = shard_bounds(flat.num_params, 4)
    sent: list[tuple[int, torch.Tensor]] = []

    def send(shard: int) -> None:
        lo, hi = shard_range(bounds, shard)
        sent.append((shard, flat.grads[lo:hi].clone()))

    streamer = GradientStreamer(model, [shard_range(bounds, s) for s in range(4)], send)
    for _ in range(2):  # armed twice: the counters start over every step
        sent.clear()
        flat.zero_grad()
        streamer.arm()
        loss = model(torch.randn(8, 1, 28, 28)).square().mean()
        loss.backward()
        assert streamer.flush() == []  # every slice went out from a hook
        # The leader's range (the last layers) is final first and follower 1's (the first
        # layers) last; in between, autograd's order of weights and biases decides.
        order = [shard for shard, _ in sent]
        assert order[0] == 0 and order[-1] == 1 and sorted(order) == [0, 1, 2, 3]
        for shard, values in sent:
            lo, hi = shard_range(bounds, shard)
            assert torch.equal(values, flat.grads[lo:hi])  # nothing changed after sending
    streamer.remove()
    flat.zero_grad()
    model(torch.randn(2, 1, 28, 28)).sum().backward()
    assert len(sent) == 4  # removed hooks send nothing


def test_shards_talk_curve_with_each_other_and_with_workers(
    cluster: Cluster, tmp_path: Path
) -> None:
    """With CURVE the shards share the server's key pair: the leader and its followers admit
    each other by it, and a worker with an authorized key reaches every shard."""
    import subprocess
    import sys

    keys = tmp_path / "keys"
    subprocess.run(
        [sys.executable, "-m", "psserver.cli.keys", str(keys)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    checkpoints = cluster.workdir / "ckpt"
    server, endpoint = cluster.start_server(
        *JOB, "--workers", "1", "--num-shards", "3", "--batch-size", "32", "--max-steps", "4",
        "--checkpoint-dir", str(checkpoints),
        "--curve-secret-key", str(keys / "server.key_secret"),
        "--curve-authorized-clients", str(keys / "authorized_clients"),
    )  # fmt: skip
    cluster.start_worker(
        endpoint,
        *("--curve-secret-key", str(keys / "client-1.key_secret")),
        *("--curve-server-key", str(keys / "server.key")),
    )
    cluster.wait_all(timeout=120)
    assert "all 3 shards have joined" in server.stderr()
    assert "rejected a connection" not in server.stderr()
    assert torch.load(checkpoints / "latest.pt", weights_only=True)["step"] == 4


def test_a_follower_applies_and_streams_each_bucket_as_it_is_complete(
    cluster: Cluster, zmq_context: zmq.Context
) -> None:
    """Sync, 2 raw workers, lr 1: the follower applies a bucket of its slice as soon as the
    leader has committed the step and every worker's part of that bucket is in, and sends it
    straight back to the worker that pushed in buckets; that worker's pull then leaves the
    slice out. Integer gradients of 8 samples each: every value is exact."""
    pair = start_two_raw_workers(cluster, zmq_context, 2, 4, "--stop-grace", "1")
    leader, follower, _, buckets, mid, a, b, ids, shard, weights, grads, expected = pair

    def push(c: RawClient, bucket: int, values: torch.Tensor) -> Push:
        w = weights[c]
        assert isinstance(w, Weights)
        return slice_push(ids[c], c.token, w.version, w.epoch, w.batch, values, bucket)

    def send_bucket(c: RawClient, bucket: int, values: torch.Tensor | None = None) -> None:
        lo, hi = buckets[bucket]
        values = grads[c][lo:hi] if values is None else values
        shard[c].send_frames([bytes(f) for f in encode(push(c, bucket, values))])

    def complete(c: RawClient) -> Message:
        """The PUSH that completes `c`'s slice sent in its three buckets."""
        w = weights[c]
        assert isinstance(w, Weights)
        return shard[c].request(completing_push(ids[c], c.token, w.version, w.epoch, w.batch, 3))

    def push_leader_slices(version: int) -> None:
        for c in (a, b):
            c.send_frames([bytes(f) for f in encode(pair.leader_push(c, version))])
        for c in (a, b):
            ack = c.receive("PUSH_ACK")
            assert isinstance(ack, PushAck) and ack.version == version + 1, ack

    # Both leader pushes first: the step closes and the leader commits it to the follower.
    push_leader_slices(0)
    # A's last bucket is not answered (a bucket never is) nor applied (B's is missing).
    send_bucket(a, 2)
    assert not shard[a].socket.poll(300)
    # B's whole slice completes every bucket but A's bucket 2 is the only one A sent: it is
    # applied and streamed to A at once; B, who pushed whole, is answered and not streamed to.
    ack = shard[b].request(push(b, -1, grads[b][:mid]))
    assert isinstance(ack, PushAck) and ack.applied
    lo, hi = buckets[2]
    assert_streamed(shard[a], 1, 2, expected[lo:hi])
    send_bucket(a, 0)
    lo, hi = buckets[0]
    assert_streamed(shard[a], 1, 0, expected[lo:hi])
    send_bucket(a, 1)
    lo, hi = buckets[1]
    assert_streamed(shard[a], 1, 1, expected[lo:hi])
    # The PUSH that completes A's slice is answered, as on the leader.
    ack = complete(a)
    assert isinstance(ack, PushAck) and ack.applied and ack.shard == 1, ack

    # A was streamed every bucket of version 1: its pull leaves them out, unless it asks.
    pulled = pull_slice(shard[a], ids[a], a.token, 1)
    assert pulled.streamed and pulled.params.numel() == 0 and pulled.version == 1
    full = shard[a].request(slice_pull(ids[a], a.token, 1, have_version=-1))
    assert isinstance(full, Weights) and torch.equal(full.params, expected)
    assert torch.equal(pull_slice(shard[b], ids[b], b.token, 1).params, expected)

    # Step 2: a bucket the follower refuses is not answered, nor are the rest of that slice;
    # the PUSH that completes it gets the refusal, and the commit leaves A out (B's gradient
    # alone, renormalised to weight 1).
    weights.update({c: c.request(Pull(ids[c], c.token)) for c in (a, b)})  # pair's too
    send_bucket(a, 2, torch.ones(3))
    send_bucket(a, 1)
    send_bucket(a, 0)
    assert not shard[a].socket.poll(300)
    wrong = complete(a)
    assert isinstance(wrong, Error) and wrong.code == "wrong-shape", wrong
    assert isinstance(shard[b].request(push(b, -1, grads[b][:mid])), PushAck)
    push_leader_slices(1)
    final = pull_slice(shard[b], ids[b], b.token, 2)
    assert torch.equal(final.params, expected - grads[b][:mid])
    assert not shard[a].socket.poll(300)  # nothing was streamed to A
    cluster.wait(leader, timeout=60)
    cluster.wait(follower, timeout=30)


def test_a_gradient_the_leader_drops_as_late_reaches_no_shard(
    cluster: Cluster, zmq_context: zmq.Context
) -> None:
    """Sync, 2 raw workers, --step-timeout 1: both send their whole follower slice, but only
    A's leader push comes before the step times out. The leader applies A's gradient alone
    and answers B's late push `applied=False`; the follower must do the same, or K shards no
    longer train like one (and top-k would put B's values back into its residual, applying
    them twice). The follower used to apply both slices by the step's plan before its update."""
    pair = start_two_raw_workers(cluster, zmq_context, 3, 6, "--step-timeout", "1")
    leader, _, _, _, mid, a, b, ids, shard, weights, grads, _ = pair
    start = pull_slice(shard[a], ids[a], a.token, 0).params.clone()  # at version 0
    leader_start = {c: w.params.clone() for c, w in weights.items() if isinstance(w, Weights)}
    for c in (a, b):
        w = weights[c]
        assert isinstance(w, Weights)
        whole = slice_push(ids[c], c.token, 0, w.epoch, w.batch, grads[c][:mid])
        assert isinstance(shard[c].request(whole), PushAck)

    def leader_push(c: RawClient) -> Message:
        return c.request(pair.leader_push(c, 0))

    ack_a = leader_push(a)  # answered once the step closes without B, after 1 s
    assert isinstance(ack_a, PushAck) and ack_a.applied and ack_a.version == 1, ack_a
    wait_for_log(leader, "closed after", timeout=30)
    ack_b = leader_push(b)
    assert isinstance(ack_b, PushAck) and not ack_b.applied, ack_b
    after, leader_slice = pull(a, shard[a], ids[a], 1)
    assert after.version == 1
    # A's gradient alone, renormalised to its 8 samples: weight 1, on every shard.
    assert torch.equal(leader_slice[mid:], leader_start[a] - grads[a][mid:])
    assert torch.equal(leader_slice[:mid], start - grads[a][:mid])


def assert_streamed(client: RawClient, version: int, bucket: int, values: torch.Tensor) -> None:
    part = client.receive(f"bucket {bucket} of version {version}")
    assert isinstance(part, Weights), part
    assert (part.version, part.shard, part.bucket) == (version, 1, bucket)
    assert torch.equal(part.params, values)


def test_staging_applies_buckets_independently_and_skips_what_never_comes() -> None:
    from psserver.serving.staging import AppliedBucket, SliceStaging
    from psserver.store.optimizer import OptimizerSpec
    from psserver.store.parameters import SliceStore

    params = torch.zeros(4)
    store = SliceStore(params, torch.zeros(4), OptimizerSpec(lr=1.0))
    store.publish_live = True
    applied: list[AppliedBucket] = []
    staging = SliceStaging(store, [(0, 1), (1, 4)], capacity=4, slice_wait=3600, shard=1)
    staging.on_bucket_applied = applied.append
    key = (0, 0, 0)
    entries = [[1, "t1", 0, 0, 0, 8], [2, "t2", 0, 0, 0, 8]]  # two workers, 8 samples each
    staging.add_commit(Commit("leader", 0, entries, 16, 1.0))
    # Worker 1 sends bucket 1 in parts; worker 2 its whole slice: bucket 1 is complete.
    staging.stage(1, "t1", key, b"one", 1, (torch.full((3,), 2.0), NO_INDICES))
    staging.stage(2, "t2", key, b"two", -1, (torch.tensor([4.0, 4.0, 4.0, 4.0]), NO_INDICES))
    staging.apply_ready()
    assert params.tolist() == [0.0, -3.0, -3.0, -3.0] and staging.mid_commit
    assert applied == [AppliedBucket(1, 1, [b"one"])] and store.version == 0
    # Worker 1's bucket 0 never comes: once the commit has waited long enough, bucket 0 is
    # worker 2's gradient alone, renormalised to the step's samples, and the step completes.
    staging.slice_wait = 0.0
    staging.apply_ready()
    assert params.tolist() == [-4.0, -3.0, -3.0, -3.0] and not staging.mid_commit
    assert applied[1:] == [] and store.version == 1 and not staging.staged


def test_an_async_slice_that_never_comes_still_steps_the_momentum() -> None:
    """The leader applied the push's own slice, with momentum: a follower whose slice of it
    never came (the worker died between the two) used to skip the step altogether, so its
    momentum and weight decay fell a step behind the leader's."""
    from psserver.serving.staging import SliceStaging
    from psserver.store.optimizer import OptimizerSpec
    from psserver.store.parameters import SliceStore

    params = torch.zeros(4)
    store = SliceStore(params, torch.zeros(4), OptimizerSpec(lr=1.0, momentum=0.5))
    staging = SliceStaging(store, [(0, 4)], capacity=4, slice_wait=0.0, shard=1)
    first = [[1, "t1", 0, 0, 0, 8]]
    staging.add_commit(Commit("leader", 0, first, 0, 1.0))  # async: expected 0
    staging.stage(1, "t1", (0, 0, 0), b"one", -1, (torch.full((4,), 2.0), NO_INDICES))
    staging.apply_ready()
    assert params.tolist() == [-2.0] * 4 and store.version == 1
    staging.add_commit(Commit("leader", 1, [[1, "t1", 1, 0, 1, 8]], 0, 1.0))  # never sent
    staging.apply_ready()
    # A zero gradient's step: the momentum 0.5 * 2 moves the weights on by 1.
    assert params.tolist() == [-3.0] * 4 and store.version == 2


def test_a_follower_refuses_buckets_that_do_not_fit_its_slice() -> None:
    """The checks of a PUSH are the same code on every shard (psserver.serving.validation):
    here a follower's slice [0, 4) in buckets [0, 1) and [1, 4)."""
    from common.errors import RequestRejected
    from psserver.serving.validation import check_push

    base = JobSpec("sync", "lenet", "embedded", 2, 8, 0, None, 64, 4, 1, None, 10, 0, "none")
    job = JobSpec.from_dict(
        {**base.to_dict(), "shard_bounds": [0, 4, 10], "slice_bucket_bounds": [[0, 1, 4]]}
    )

    def push(bucket: int, values: torch.Tensor, **fields: object) -> Push:
        return dataclasses.replace(slice_push(1, "t", 0, 0, 0, values, bucket), **fields)

    check_push(job, 1, push(-1, torch.ones(4)))
    check_push(job, 1, push(1, torch.ones(3)))
    check_push(job, 1, push(-1, torch.empty(0), parts=2))  # completes two buckets
    for bucket, values, fields, reason in [
        (1, torch.ones(4), {}, "3 dense values"),
        (2, torch.ones(3), {}, "bucket 2 does not exist: shard 1 takes 2 buckets"),
        (-2, torch.ones(4), {}, "-1 means the whole slice"),
        (0, torch.tensor([float("nan")]), {}, "NaN"),
        (-1, torch.ones(4), {"shard": 2}, "this is shard 1 of 2"),
        (-1, torch.ones(4), {"buffers": torch.zeros(2)}, "buffers travel in shard 0's"),
        (-1, torch.ones(4).half(), {}, r"travel as float32 \(--compress none\), got float16"),
        (-1, torch.ones(4), {"parts": 2}, "carries no gradient of its own"),
        (1, torch.ones(3), {"parts": 2}, "a bucket's PUSH has parts 0"),
        (-1, torch.ones(4), {"samples": 0}, "samples must be 1..8"),
    ]:
        with pytest.raises(RequestRejected, match=reason):
            check_push(job, 1, push(bucket, values, **fields))
    topk = JobSpec.from_dict({**job.to_dict(), "compress": "topk:0.5"})
    with pytest.raises(RequestRejected, match="whole top-k slices"):
        check_push(topk, 1, push(0, torch.ones(1)))
    # A half-precision gradient only where the job sends one (--compress fp16 or bf16), and
    # float32 there too (a piece beyond the half type's range goes in float32).
    fp16 = JobSpec.from_dict({**job.to_dict(), "compress": "fp16"})
    check_push(fp16, 1, push(-1, torch.ones(4).half()))
    check_push(fp16, 1, push(-1, torch.ones(4)))
    bf16 = JobSpec.from_dict({**job.to_dict(), "compress": "bf16"})
    with pytest.raises(RequestRejected, match=r"float32 or bfloat16 \(--compress bf16\), got"):
        check_push(bf16, 1, push(-1, torch.ones(4).half()))


# ---- shards the leader starts itself, and options that do not fit a shard's role ----------


def run_server(*args: str, cwd: Path, env: dict[str, str] | None = None) -> CompletedProcess:
    """ps-server to its end, within 60 s (a hang fails the test rather than stalling it)."""
    return subprocess.run(
        [sys.executable, "-m", "psserver.cli.server", *args],
        capture_output=True, text=True, timeout=60, cwd=cwd,
        env={**os.environ, **(env or {})},
    )  # fmt: skip


def test_a_follower_that_exits_before_joining_ends_the_leader_that_started_it(
    cluster: Cluster, zmq_context: zmq.Context
) -> None:
    """The follower the leader starts on PORT+1 cannot bind there. The leader used to wait
    for it for ever; a worker that registered meanwhile heard nothing."""
    import socket

    port = free_port_pair()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port + 1))
        taken.listen()
        leader = cluster.start(
            "leader", "psserver.cli.server", "--bind", f"tcp://127.0.0.1:{port}",
            "--num-shards", "2", "--model", "lenet", "--workers", "1", "--train-limit", "64",
            "--test-limit", "20", "--threads", "1",
        )  # fmt: skip
        worker = RawClient(zmq_context, f"tcp://127.0.0.1:{port}", timeout_s=40)
        refusal = worker.register()
        cluster.wait(leader, timeout=40, expect_code=1)
    assert isinstance(refusal, Error) and refusal.code == "job-lost", refusal
    assert "follower shard it started exited" in refusal.message
    stderr = leader.stderr()
    assert "Traceback" not in stderr, stderr
    assert "waits: it is welcomed once shards [1] have joined" in stderr
    errors = [line for line in stderr.splitlines() if line.startswith("Error:")]
    assert errors[-1] == (
        "Error: shard 1 (started by this command) exited with code 1 before joining; see its "
        "error above"
    ), stderr
    assert "shard 1: cannot bind" in errors[0], stderr  # the follower's own word, above


@pytest.mark.integration
def test_follower_ports_past_65535_are_refused_before_anything_starts(tmp_path: Path) -> None:
    result = run_server(
        "--bind", "tcp://127.0.0.1:65535", "--num-shards", "2", "--model", "lenet",
        cwd=tmp_path,
    )  # fmt: skip
    assert_clean_error(result, 1, "up to 65536, past 65535", "port 65534 or lower")
    assert "started" not in result.stderr


@pytest.mark.integration
def test_too_many_shards_are_refused_in_one_line(tmp_path: Path) -> None:
    for module in ("psserver.cli.server", "psserver.cli.local"):
        result = run(module, "--num-shards", "200000", "--model", "lenet", cwd=tmp_path)
        assert_clean_error(result, 2, "--num-shards", "1<=x<=64")
    with pytest.raises(ConfigError, match="--num-shards"):
        ServerConfig(num_shards=MAX_SHARDS + 1)
    from psserver.store.optimizer import OptimizerSpec
    from psserver.store.parameters import ParameterStore

    with pytest.raises(ConfigError, match="lenet has 129068 parameters, so at most 129068"):
        ParameterStore("lenet", 0, OptimizerSpec(0.1), num_shards=200000)


@pytest.mark.integration
@pytest.mark.parametrize(
    ("role", "wanted"),
    [([], "without --shard this server is the leader"), (["--shard", "0"], "--shard 0 makes")],
)
def test_leader_without_a_follower_shard_is_refused(
    tmp_path: Path, role: list[str], wanted: str
) -> None:
    """It used to be ignored: the server became a second leader and waited for ever."""
    result = run_server(
        *role, "--num-shards", "2", "--leader", "tcp://127.0.0.1:1", "--model", "lenet",
        "--bind", "tcp://127.0.0.1:*", cwd=tmp_path,
    )  # fmt: skip
    assert_clean_error(result, 1, wanted, "did you mean --shard 1?")


@pytest.mark.integration
def test_a_follower_refuses_the_options_of_the_job(tmp_path: Path) -> None:
    """A follower takes the job from its leader: --lr 9 or PS_SEED used to be dropped without
    a word."""
    result = run_server(
        "--shard", "1", "--num-shards", "2", "--leader", "tcp://127.0.0.1:1",
        "--bind", "tcp://127.0.0.1:*", "--leader-timeout", "5", "--threads", "1",
        "--lr", "9", "--mode", "async", "--summary", str(tmp_path / "s.json"),
        cwd=tmp_path, env={"PS_SEED": "99"},
    )  # fmt: skip
    assert_clean_error(
        result, 1, "shard 1 is a follower", "--lr, --mode, PS_SEED, --summary",
        "give these options to the leader (shard 0) only",
    )  # fmt: skip


def test_followers_the_leader_starts_ignore_its_ps_variables(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The leader's job may come from PS_ variables (Docker, Kubernetes); the followers it
    starts do not inherit them, so they do not refuse them."""
    for name, value in {"PS_MODEL": "lenet", "PS_LR": "0.05", "PS_SEED": "3"}.items():
        monkeypatch.setenv(name, value)
    leader, endpoint = cluster.start_server(
        "--num-shards", "2", "--workers", "1", "--train-limit", "64", "--test-limit", "20",
        "--batch-size", "16", "--max-steps", "2",
    )  # fmt: skip
    for name in ("PS_MODEL", "PS_LR", "PS_SEED"):
        monkeypatch.delenv(name)
    worker = cluster.start_worker(endpoint)
    cluster.wait(leader, timeout=90)
    cluster.wait(worker, timeout=30)
    assert "all 2 shards have joined" in leader.stderr()
    assert "lenet" in leader.stderr() and "Error" not in leader.stderr()
