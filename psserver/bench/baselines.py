"""The PyTorch baselines of `ps-bench train` (and `ps-bench link`): one process with the
global batch, and DDP's N ranks (or the same N ranks training apart, the compute bound), each
a `psserver.bench.ddp` child process here, on a link lab's hosts or on the agents' (around a
rendezvous store in this process).

What this is not: the training loop the children run (psserver.bench.ddp), nor the
parameter-server runs they are compared with (psserver.bench.trainps).
"""

import socket
from typing import Any

import torch.distributed as dist

from common.errors import PSError
from psserver.bench.addresses import tcp_endpoint
from psserver.bench.ddp import RENDEZVOUS_TIMEOUT
from psserver.bench.netns import LinkLab
from psserver.bench.procs import ProcessGroup
from psserver.bench.remote import RemoteClients
from psserver.bench.trainbench import TIMEOUT_HINT, TrainBench, remote_job
from psserver.bench.trainjob import TrainRole


def run_single_process(
    bench: TrainBench, device: str, remote: RemoteClients | None = None
) -> float:
    # The same total CPU as the cluster's workers: N·T threads (the server's T are extra).
    threads = bench.workers * bench.threads
    with ProcessGroup(threads) as group:
        if remote is not None:  # on the first agent's host, like worker 0
            job = remote_job(bench, "single", "", [device])
            [result] = remote.run(group, "single_process", job, 1, bench.timeout)
            return float(result["images_per_second"])
        group.start(
            "single",
            "psserver.bench.ddp",
            "single",
            *_reference_args(bench, bench.workers * bench.batch_size, threads, device),
            *("--out", str(group.scratch / "single.json")),
        )
        group.wait(bench.timeout, "single_process", hint=TIMEOUT_HINT)
        return float(group.read_json("single.json")["images_per_second"])


def run_ddp(
    bench: TrainBench,
    devices: list[str],
    lab: LinkLab | None = None,
    remote: RemoteClients | None = None,
    sync: bool = True,
) -> float:
    """With a `lab`, rank r runs on its host r + 1 (host 0 is the server's); with `remote`,
    on its agents. With `sync` False the ranks train apart (no all-reduce)."""
    if remote is not None:
        return run_remote_ddp(bench, devices, remote, sync)
    port = free_port() if lab is None else 29500
    master = lab.address(1) if lab else "127.0.0.1"
    with ProcessGroup(bench.threads) as group:
        if lab is not None:  # gloo would look for the address of the machine's host name
            group.env["GLOO_SOCKET_IFNAME"] = "eth0"
        for rank, device in enumerate(devices):
            group.start(
                f"rank{rank}",
                "psserver.bench.ddp",
                "rank",
                *_reference_args(bench, bench.batch_size, bench.threads, device),
                *("--rank", str(rank), "--world-size", str(bench.workers)),
                *("--master-addr", master, "--master-port", str(port)),
                *("--out", str(group.scratch / "ddp.json")),
                *(() if sync else ("--no-sync",)),
                prefix=lab.prefix_for(rank + 1) if lab else (),
            )
        group.wait(bench.timeout, "ddp" if sync else "compute_bound", hint=TIMEOUT_HINT)
        return rank_rate(group.read_json("ddp.json"), sync, bench.workers)


def run_remote_ddp(
    bench: TrainBench, devices: list[str], remote: RemoteClients, sync: bool = True
) -> float:
    """DDP ranks (or ranks training apart) on the agents, around a rendezvous store in this
    process: each rank dials this host, the one that asked its agent."""
    store = dist.TCPStore(
        remote.server_host,
        remote.server_port or 0,
        is_master=True,
        wait_for_workers=False,
        timeout=RENDEZVOUS_TIMEOUT,
    )
    role: TrainRole = "ddp-rank" if sync else "apart-rank"
    job = remote_job(bench, role, tcp_endpoint(remote.server_host, store.port), devices)
    with ProcessGroup(bench.threads) as group:
        phase = "ddp" if sync else "compute_bound"
        results = remote.run(group, phase, job, bench.workers, bench.timeout)
    del store  # closes its listening socket
    return rank_rate(results[0], sync, bench.workers)  # rank 0 timed the world


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


def _reference_args(bench: TrainBench, batch_size: int, threads: int, device: str) -> list[str]:
    return [
        *("--model", bench.model, "--batch-size", str(batch_size)),
        *("--steps", str(bench.steps), "--threads", str(threads), "--device", device),
    ]


def free_port() -> int:
    """A port that was free a moment ago; another process could take it first (unlikely)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
