"""The parameter-server phases of `ps-bench train` (and `ps-bench link`): a real ps-server,
or K shards of one, and N ps-workers, here or on a link lab's hosts; the rate is the server
summary's steady images/s.

What this is not: the PyTorch runs it is compared with (psserver.bench.baselines), nor the
choice of phase (psserver.bench.train).
"""

import json
import math
from pathlib import Path
from typing import Any

from common.errors import PSError
from common.roles import SERVER, WORKER, WorkerSpec
from psserver.bench.netns import LinkLab
from psserver.bench.procs import WHOLE_GRADIENT, ProcessGroup, bucketed
from psserver.bench.trainbench import TEST_LIMIT, TIMEOUT_HINT, TrainBench
from psserver.shards.joining import FollowerConfig


def run_parameter_server(
    mode: str,
    bench: TrainBench,
    devices: list[str],
    num_shards: int = 1,
    overlap: bool = True,
    lab: LinkLab | None = None,
    stream: bool = True,
) -> float:
    """With a `lab`, the server runs on its host 0, worker r on host r + 1 and a sharded
    server's follower i on the host after the workers' i - 1. `stream`: updated buckets go
    back as soon as they are applied (ps-server --stream-weights)."""
    updates = bench.steps if mode == "sync" else bench.workers * bench.steps
    # Enough epochs for S steps per worker; --max-steps ends the run first.
    epochs = math.ceil(bench.steps / bench.epoch_steps()) + 1
    followers_elsewhere = num_shards > 1 and lab is not None
    with ProcessGroup(bench.threads) as group:
        summary = group.scratch / "summary.json"
        secret, secret_file = group.shard_secret() if followers_elsewhere else (None, None)
        job = {
            "mode": mode, "workers": bench.workers, "model": bench.model,
            "batch_size": bench.batch_size, "epochs": epochs, "max_steps": updates,
            "test_limit": TEST_LIMIT, "summary": summary, "threads": bench.threads,
            "num_shards": num_shards,
            # Without overlap the gradient is also applied whole: the baseline of before.
            **(bucketed(bench.bucket_mb) if overlap else WHOLE_GRADIENT),
            "stream_weights": None if stream else False,
            # On hosts, each shard runs on a host of its own: the leader is shard 0 only.
            "shard": 0 if secret else None, "shard_secret_file": secret_file,
        }  # fmt: skip
        _, endpoint = group.start_server(
            mode,
            job,
            bind=f"tcp://{lab.address(0)}:5555" if lab else "tcp://127.0.0.1:*",
            prefix=lab.prefix_for(0) if lab else (),
        )
        if lab is not None and secret_file is not None:  # else the leader starts its own
            start_followers(group, lab, endpoint, num_shards, bench, secret_file)
        for rank, device in enumerate(devices):
            worker = WorkerSpec(
                server=endpoint,
                device=device,
                threads=bench.threads,
                progress="none",
                log_level="warning",
                name=f"bench-{rank}",
                overlap=overlap,
            )
            group.start_role(
                f"worker{rank}", WORKER, worker, prefix=lab.prefix_for(rank + 1) if lab else ()
            )
        group.wait(bench.timeout, mode, hint=TIMEOUT_HINT)
        return steady_rate(json.loads(summary.read_text()))


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
        config = FollowerConfig(
            shard, num_shards, leader, bind=f"tcp://{lab.address(host)}:5555", threads=bench.threads
        )
        told = {"log_level": "warning", "shard_secret_file": secret_file}
        group.start_role(
            f"shard{shard}", SERVER, config, told, prefix=lab.prefix_for(host), follower=True
        )
