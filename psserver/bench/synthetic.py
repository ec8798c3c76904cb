"""A worker that computes nothing: it pulls weights and pushes a fixed gradient of the model's
size, timing each round. `ps-bench comm` runs these to measure the system's own overhead.
With a sharded server it moves every shard's slice in parallel, as a real worker does; with
gradient buckets it sends them bucket by bucket, last layers first, and takes the updated
buckets the server streams back in sync mode, as a worker with --overlap does. The weights go
into a model of the job's, as ps-worker puts them there (`FlatModel.load_params`, which on the
CPU uses whole parameters where they were received and copies the rest). It counts
its own CPU time over the timed rounds and, with --server-cpu, the server's too (read from
the live status before and after them).

    python -m psserver.bench.synthetic --server ENDPOINT --rounds R --out times.json
"""

import json
import os
import socket
import sys
import time
from pathlib import Path

import click
import torch

from common.catalog import all_fingerprints, build_model
from common.errors import PSError
from common.job import JobSpec
from common.memory import reuse_large_buffers
from common.model.flat import FlatModel
from common.options import Option, options
from common.roles import Role
from common.sharding import split_gradient
from common.startup import freeze_imported_objects
from common.wire.protocol import (
    Pull,
    Push,
    PushAck,
    PushReady,
    Register,
    Status,
    StatusReply,
    Stop,
    Weights,
    Welcome,
)
from psworker.connection.registration import new_process_identity
from psworker.connection.requests import ServerConnection
from psworker.connection.shards import ShardClients
from psworker.connection.streaming import WeightStream

WARMUP_ROUNDS = 2  # untimed; ps-bench comm's floor (psserver.bench.floor) drops as many


class CpuClock:
    """This process's CPU time over the timed rounds and, given a connection, the server's
    and that of the follower shards it started (its live status carries both)."""

    def __init__(self, connection: ServerConnection | None) -> None:
        self.connection = connection
        self.own_started = time.process_time()
        self.server_started: dict[str, float | None] = {}

    def server_seconds(self) -> dict[str, float | None]:
        """{"server": its CPU seconds so far, "followers": theirs or None}; empty without a
        connection."""
        if self.connection is None:
            return {}
        reply = self.connection.request(Status())
        assert isinstance(reply, StatusReply), reply
        cpu = reply.status["server_cpu"]
        followers = cpu.get("followers_seconds")
        return {"server": float(cpu["seconds"]), "followers": followers}

    def start(self) -> None:
        self.server_started = self.server_seconds()
        self.own_started = time.process_time()

    def stop(self) -> dict[str, float]:
        result = {"cpu_seconds": time.process_time() - self.own_started}
        server_now = self.server_seconds()
        for name, key in (("server", "server_cpu_seconds"), ("followers", "followers_cpu_seconds")):
            now, started = server_now.get(name), self.server_started.get(name)
            if now is not None and started is not None:
                result[key] = float(now) - float(started)
        return result


SYNTHETIC = Role(
    "psserver.bench.synthetic",
    (
        Option("--server", name="endpoint", required=True),
        Option("--rounds", type=int, required=True, help="Timed rounds after 2 warm-up rounds."),
        Option("--out", type=click.Path(path_type=Path), required=True),
        Option("--server-cpu", is_flag=True, help="Also count the server's CPU time (one worker)."),
    ),
)


@click.command()
@options(SYNTHETIC.options)
def command(endpoint: str, rounds: int, out: Path, server_cpu: bool) -> None:
    """Pull, push a constant gradient, repeat; write the round times as JSON."""
    reuse_large_buffers()
    connection = ServerConnection(endpoint, timeout_s=120, retries=0)
    shards: ShardClients | None = None
    try:
        welcome = connection.request(
            Register(
                "synthetic",
                socket.gethostname(),
                "none",
                os.getpid(),
                new_process_identity(),
                all_fingerprints(),
            )
        )
        assert isinstance(welcome, Welcome), welcome
        connection.start_heartbeat(welcome.worker_id, welcome.token, welcome.heartbeat_interval)
        job = JobSpec.from_dict(welcome.job)
        grads = torch.full((job.num_params,), 1e-6)  # (P,) reused every round
        buffers = torch.zeros(job.num_buffers)
        flat = FlatModel(build_model(job.model))  # where the weights go, as in ps-worker
        no_indices = torch.empty(0, dtype=torch.int32)
        no_values = torch.empty(0)
        pieces = split_gradient(grads, no_indices, job.bounds, sparse=False)
        if job.num_shards > 1:
            shards = ShardClients(job, flat.load_params, 120, 0, None, connection.last_heard)
        stream = WeightStream(job, flat.load_params)
        connection.on_weights_part = stream.accept
        times: list[float] = []
        streamed_pulls = 0
        wid, token = welcome.worker_id, welcome.token
        min_version = 0
        cpu = CpuClock(connection if server_cpu else None)
        while len(times) < rounds + WARMUP_ROUNDS:
            if len(times) == WARMUP_ROUNDS:
                cpu.start()
            started = time.perf_counter()
            if shards is not None:
                shards.request_slices(wid, token, min_version)
            weights = connection.request(Pull(wid, token, stream.whole_version()))
            if isinstance(weights, Stop):
                break
            assert isinstance(weights, Weights), weights
            if not weights.streamed:
                flat.load_params(job.shard_range(0)[0], weights.params)
            streamed_pulls += weights.streamed
            parts = job.num_buckets if job.num_buckets > 1 else 0

            def push(
                shard: int, bucket: int, values: torch.Tensor, parts: int, at: Weights = weights
            ) -> Push:
                kept = buffers if shard == 0 and bucket == -1 else no_values
                return Push(
                    wid, token, at.version, at.epoch, at.batch, 1, 0.0, 0, values, no_indices,
                    kept, parts, shard, bucket,
                )  # fmt: skip

            if shards is not None:
                shards.receive_slices(wid, token, weights.version)
                for shard in range(1, job.num_shards):
                    # As an overlapping worker: in buckets (streamed back) when the leader
                    # takes parts, the whole slice otherwise.
                    if not parts:
                        shards.send_push(push(shard, -1, pieces[shard][0], 0))
                        continue
                    ranges = job.shard_bucket_ranges(shard)
                    for bucket in reversed(range(len(ranges))):
                        start, end = ranges[bucket]
                        shards.post_bucket(push(shard, bucket, pieces[shard][0][start:end], 0))
                    shards.send_push(push(shard, -1, no_values, len(ranges)))
            if job.push_credits and not weights.push_granted:  # flow control, as a worker does
                go = connection.request(PushReady(wid, token))
                if isinstance(go, Stop):
                    break
                assert isinstance(go, PushAck) and go.go, go
            leader = pieces[0][0]
            for bucket in reversed(range(parts)):
                start, end = job.bucket_range(bucket)
                connection.post(push(0, bucket, leader[start:end], 0))
            ack = connection.request(push(0, -1, leader[:0] if parts else leader, parts))
            if isinstance(ack, Stop):
                break  # the followers' answers are not waited for
            if shards is not None and shards.finish_pushes() is not None:
                break
            assert isinstance(ack, PushAck), ack
            min_version = ack.version if job.mode == "sync" else 0
            times.append(time.perf_counter() - started)
        out.write_text(
            json.dumps(
                {
                    "round_seconds": times[WARMUP_ROUNDS:],
                    "streamed_pulls": streamed_pulls,
                    **cpu.stop(),
                }
            )
        )
    except PSError as exc:
        sys.exit(f"synthetic worker: {exc}")
    finally:
        if shards is not None:
            shards.close()
        connection.close()


def main() -> None:
    freeze_imported_objects()
    command()


if __name__ == "__main__":
    main()
