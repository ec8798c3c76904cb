"""Which device each worker of one host trains on: one GPU each when the host has enough,
otherwise every worker on the CPU.

Shared by ps-local and ps-bench (its local runs, its agents and the coordinator that places
workers on them). What it is not: the worker's own choice. A worker is given `--device`, and
common.device resolves it and falls back where CUDA is absent.
"""

import click
import torch

from common.errors import PSError
from common.logs import counted


def worker_devices(workers: int, device: str) -> list[str]:
    """One GPU per worker when there are enough GPUs, otherwise every worker on the CPU."""
    gpus = gpu_count() if device != "cpu" else 0
    chosen = choose_devices(workers, device, gpus)
    if gpus and chosen[0] == "cpu":  # said, so that nobody wonders why the GPUs idle
        click.echo(
            f"this machine has {gpus} GPU(s) for {workers} workers: every worker runs on the "
            f"CPU (--workers {gpus} trains on the GPUs, one each)",
            err=True,
        )
    return chosen


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def choose_devices(workers: int, device: str, gpus: int) -> list[str]:
    """worker_devices' choice on a machine with `gpus` GPUs (another host's, say)."""
    if device == "cpu":
        return ["cpu"] * workers
    if gpus >= workers:
        return [f"cuda:{i}" for i in range(workers)]
    if device == "cuda":
        raise PSError(
            f"--device cuda needs {counted(workers, 'GPU')} for {counted(workers, 'worker')}, "
            f"this machine has {gpus}; use --device cpu" + (" or fewer --workers" if gpus else "")
        )
    return ["cpu"] * workers
