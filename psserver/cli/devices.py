"""Which device each worker of one host trains on: one GPU each when the host has enough,
otherwise every worker on the CPU.

Shared by ps-local and ps-bench. What it is not: the worker's own choice. A worker is given
`--device`, and common.device resolves it and falls back where CUDA is absent.
"""

import click
import torch

from common.errors import PSError
from common.logs import counted


def worker_devices(workers: int, device: str) -> list[str]:
    """One GPU per worker when there are enough GPUs, otherwise every worker on the CPU."""
    if device == "cpu":
        return ["cpu"] * workers
    gpus = gpu_count()
    if gpus >= workers:
        return [f"cuda:{i}" for i in range(workers)]
    if device == "cuda":
        raise PSError(
            f"--device cuda needs {counted(workers, 'GPU')} for {counted(workers, 'worker')}, "
            f"this machine has {gpus}; use --device cpu" + (" or fewer --workers" if gpus else "")
        )
    if gpus:  # said, so that nobody wonders why the GPUs idle
        click.echo(
            f"this machine has {counted(gpus, 'GPU')} for {counted(workers, 'worker')}: every "
            f"worker runs on the CPU (--workers {gpus} trains on the GPUs, one each)",
            err=True,
        )
    return ["cpu"] * workers


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0
