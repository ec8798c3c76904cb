"""A worker that computes nothing: it pulls weights and pushes a fixed gradient of the model's
size, timing each round. `ps-bench comm` runs these to measure the system's own overhead.

    python -m psworker.synthetic --server ENDPOINT --rounds R --out times.json
"""

import json
import os
import socket
import sys
import time
from pathlib import Path

import click
import torch

from common.errors import PSError
from common.job import JobSpec
from common.memory import reuse_large_buffers
from common.models import all_fingerprints
from common.protocol import Pull, Push, PushAck, Register, Stop, Weights, Welcome
from psworker.client import ServerConnection


@click.command()
@click.option("--server", "endpoint", required=True)
@click.option("--rounds", type=int, required=True, help="Timed rounds after 2 warm-up rounds.")
@click.option("--out", type=click.Path(path_type=Path), required=True)
def command(endpoint: str, rounds: int, out: Path) -> None:
    """Pull, push a constant gradient, repeat; write the round times as JSON."""
    reuse_large_buffers()
    connection = ServerConnection(endpoint, timeout_s=120, retries=0)
    try:
        welcome = connection.request(
            Register("synthetic", socket.gethostname(), "none", os.getpid(), all_fingerprints())
        )
        assert isinstance(welcome, Welcome), welcome
        connection.start_heartbeat(welcome.worker_id, welcome.token, welcome.heartbeat_interval)
        job = JobSpec.from_dict(welcome.job)
        grads = torch.full((job.num_params,), 1e-6)  # (P,) reused every round
        buffers = torch.zeros(job.num_buffers)
        params = torch.empty(job.num_params)  # where a real worker would copy the weights
        no_indices = torch.empty(0, dtype=torch.int32)
        times: list[float] = []
        wid, token = welcome.worker_id, welcome.token
        while len(times) < rounds + 2:
            started = time.perf_counter()
            weights = connection.request(Pull(wid, token))
            if isinstance(weights, Stop):
                break
            assert isinstance(weights, Weights), weights
            params.copy_(weights.params)
            ack = connection.request(
                Push(
                    wid,
                    token,
                    weights.version,
                    weights.epoch,
                    weights.batch,
                    1,
                    0.0,
                    0,
                    grads,
                    no_indices,
                    buffers,
                )
            )
            if isinstance(ack, Stop):
                break
            assert isinstance(ack, PushAck), ack
            times.append(time.perf_counter() - started)
        out.write_text(json.dumps({"round_seconds": times[2:]}))
    except PSError as exc:
        sys.exit(f"synthetic worker: {exc}")
    finally:
        connection.close()


if __name__ == "__main__":
    command()
