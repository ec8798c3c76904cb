"""The parameter-server phases of `ps-bench train` (and `ps-bench link`): a real ps-server,
or K shards of one, and N ps-workers, here, on the agents' hosts or on a link lab's hosts;
the rate is the server summary's steady images/s.

What this is not: the PyTorch runs it is compared with (psserver.bench.baselines), nor the
choice of phase (psserver.bench.train).
"""

import contextlib
import functools
import json
import math
from pathlib import Path
from typing import Any

from common.errors import PSError
from psserver.bench.clients import server_bind
from psserver.bench.netns import LinkLab
from psserver.bench.procs import WHOLE_GRADIENT, ProcessGroup, bucket_args
from psserver.bench.remote import RemoteClients
from psserver.bench.trainbench import TEST_LIMIT, TIMEOUT_HINT, TrainBench, remote_job


def run_parameter_server(
    mode: str,
    bench: TrainBench,
    devices: list[str],
    num_shards: int = 1,
    overlap: bool = True,
    lab: LinkLab | None = None,
    stream: bool = True,
    remote: RemoteClients | None = None,
) -> float:
    """With a `lab`, the server runs on its host 0 and worker r on host r + 1; with
    `remote`, the server runs here and the workers on its agents (and a sharded server's
    followers on its shard agents, if it has any). `stream`: updated buckets go back as
    soon as they are applied (ps-server --stream-weights)."""
    updates = bench.steps if mode == "sync" else bench.workers * bench.steps
    # Enough epochs for S steps per worker; --max-steps ends the run first.
    epochs = math.ceil(bench.steps / bench.epoch_steps()) + 1
    followers_elsewhere = num_shards > 1 and (
        lab is not None or (remote is not None and remote.places_followers)
    )
    with ProcessGroup(bench.threads) as group:
        summary = group.scratch / "summary.json"
        secret, secret_file = group.shard_secret() if followers_elsewhere else (None, None)
        _, endpoint = group.start_server(
            mode,
            *("--mode", mode, "--workers", str(bench.workers), "--model", bench.model),
            *("--batch-size", str(bench.batch_size), "--epochs", str(epochs)),
            *("--max-steps", str(updates), "--test-limit", str(TEST_LIMIT)),
            *("--summary", str(summary), "--threads", str(bench.threads)),
            *("--num-shards", str(num_shards)),
            # Without overlap the gradient is also applied whole: the baseline of before.
            *(bucket_args(bench.bucket_mb) if overlap else WHOLE_GRADIENT),
            *(() if stream else ("--no-stream-weights",)),
            # On hosts, each shard runs on a host of its own: the leader is shard 0 only.
            *(("--shard", "0", "--shard-secret-file", str(secret_file)) if secret else ()),
            bind=where_the_server_listens(lab, remote),
            prefix=lab.prefix_for(0) if lab else (),
        )
        if lab is not None and secret_file is not None:  # else the leader starts its own
            start_followers(group, lab, endpoint, num_shards, bench, secret_file)
        if remote is not None:
            job = remote_job(bench, "ps-worker", endpoint, devices, overlap)
            # The followers last through the workers' run and then the server's wait.
            lifetime = 2 * bench.timeout
            with (
                remote.followers(endpoint, num_shards, bench.threads, lifetime, secret)
                if followers_elsewhere
                else contextlib.nullcontext()
            ):
                remote.run(group, mode, job, bench.workers, bench.timeout)
                # The server's summary; its last evaluation still fetches the followers' slices,
                # so a follower that fails meanwhile is reported now, not at the timeout.
                watch = functools.partial(remote.shards.watch, mode)
                group.wait(bench.timeout, mode, hint=TIMEOUT_HINT, watch=watch)
            return steady_rate(json.loads(summary.read_text()))
        for rank, device in enumerate(devices):
            group.start(
                f"worker{rank}",
                "psworker.cli",
                *("--server", endpoint, "--device", device, "--threads", str(bench.threads)),
                *("--progress", "none", "--log-level", "warning", "--name", f"bench-{rank}"),
                "--overlap" if overlap else "--no-overlap",
                prefix=lab.prefix_for(rank + 1) if lab else (),
            )
        group.wait(bench.timeout, mode, hint=TIMEOUT_HINT)
        return steady_rate(json.loads(summary.read_text()))


def where_the_server_listens(lab: LinkLab | None, remote: RemoteClients | None) -> str:
    """Its lab host's address, the address the agents reach, or loopback."""
    if lab is not None:
        return f"tcp://{lab.address(0)}:5555"
    return server_bind(remote) if remote is not None else "tcp://127.0.0.1:*"


def steady_rate(summary: dict[str, Any]) -> float:
    """The server summary's images/s after the warm-up pushes."""
    rate = summary.get("steady_images_per_second")
    if rate is None:
        raise PSError(
            f"the server's summary has no steady rate: the run ended within its "
            f"{summary.get('warmup_pushes')} warm-up pushes; give it more --steps"
        )
    return float(rate)


def start_followers(
    group: ProcessGroup, lab: LinkLab, leader: str, num_shards: int, bench: TrainBench,
    secret_file: Path,
) -> None:  # fmt: skip
    """Shards 1..K-1, each on a host of its own after the server's and the workers'."""
    for shard in range(1, num_shards):
        host = bench.workers + shard
        group.start(
            f"shard{shard}",
            "psserver.cli.server",
            *("--shard", str(shard), "--num-shards", str(num_shards), "--leader", leader),
            *("--bind", f"tcp://{lab.address(host)}:5555", "--log-level", "warning"),
            *("--threads", str(bench.threads), "--shard-secret-file", str(secret_file)),
            prefix=lab.prefix_for(host),
            follower=True,
        )
