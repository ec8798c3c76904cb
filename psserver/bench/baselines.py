"""The PyTorch baselines of `ps-bench train` (and `ps-bench link`): one process with the
global batch, and DDP's N ranks (or the same N ranks training apart, the compute bound), each
a `psserver.bench.ddp` child process here or on a link lab's hosts.

What this is not: the training loop the children run (psserver.bench.ddp), nor the
parameter-server runs they are compared with (psserver.bench.trainps).
"""

import socket
from pathlib import Path
from typing import Any

from common.errors import PSError
from psserver.bench import ddp
from psserver.bench.netns import LinkLab
from psserver.bench.procs import ProcessGroup
from psserver.bench.trainbench import TIMEOUT_HINT, TrainBench


def run_single_process(bench: TrainBench, device: str) -> float:
    # The same total CPU as the cluster's workers: N·T threads (the server's T are extra).
    threads = bench.workers * bench.threads
    with ProcessGroup(threads) as group:
        out = group.scratch / "single.json"
        batch_size = bench.workers * bench.batch_size
        group.start_role("single", ddp.SINGLE, reference(bench, batch_size, threads, device, out))
        group.wait(bench.timeout, "single_process", hint=TIMEOUT_HINT)
        return float(group.read_json(out.name)["images_per_second"])


def run_ddp(
    bench: TrainBench, devices: list[str], lab: LinkLab | None = None, sync: bool = True
) -> float:
    """With a `lab`, rank r runs on its host r + 1 (host 0 is the server's). With `sync`
    False the ranks train apart (no all-reduce)."""
    port = free_port() if lab is None else 29500
    master = lab.address(1) if lab else "127.0.0.1"
    with ProcessGroup(bench.threads) as group:
        if lab is not None:  # gloo would look for the address of the machine's host name
            group.env["GLOO_SOCKET_IFNAME"] = "eth0"
        out = group.scratch / "ddp.json"
        for rank, device in enumerate(devices):
            group.start_role(
                f"rank{rank}",
                ddp.RANK,
                reference(bench, bench.batch_size, bench.threads, device, out),
                {"rank": rank, "world_size": bench.workers, "no_sync": not sync},
                {"master_addr": master, "master_port": port},
                prefix=lab.prefix_for(rank + 1) if lab else (),
            )
        group.wait(bench.timeout, "ddp" if sync else "compute_bound", hint=TIMEOUT_HINT)
        return rank_rate(group.read_json(out.name), sync, bench.workers)


def rank_rate(result: dict[str, Any], sync: bool, ranks: int) -> float:
    """Rank 0's images/s, once its check of the ranks' weights says the run was what it
    claims: identical replicas for DDP, different ones for ranks apart (one rank has no
    other to compare with: DDP of one is its own compute bound)."""
    if ranks > 1 and result.get("replicas_identical") is not sync:
        what = "ended with different weights" if sync else "ended with the same weights"
        raise PSError(
            f"the {'DDP' if sync else 'compute-bound'} ranks {what}: that run did not "
            "measure what it should, so its rate is not reported. Please report this."
        )
    return float(result["images_per_second"])


def reference(
    bench: TrainBench, batch_size: int, threads: int, device: str, out: Path
) -> dict[str, Any]:
    """A PyTorch run's options (psserver.bench.ddp's): the bench's model and steps."""
    return {
        "model": bench.model, "batch_size": batch_size, "steps": bench.steps,
        "threads": threads, "device": device, "out": out,
    }  # fmt: skip


def free_port() -> int:
    """A port that was free a moment ago; another process could take it first (unlikely)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
