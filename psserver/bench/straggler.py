"""`ps-bench straggler`: one slow worker, three policies. How much throughput and accuracy do
sync, async and SSP keep when one of N workers takes twice as long per step?

The slow worker sleeps before each push (`ps-worker --step-delay`). By default the sleep is
calibrated: one training step of the model and batch is timed here first, and the sleep is
(slowdown - 1) times that, so that the slow worker computes `slowdown` times as long as the
others on this machine. Every run trains the same job on the embedded data set and reports
images/s (applied samples over wall time), test accuracy and the staleness the policy allowed.
"""

import functools
import json
from typing import Any

import torch

from psserver.bench.ddp import run_single
from psserver.bench.options import announced
from psserver.bench.procs import ProcessGroup

POLICIES = ("sync", "async", "ssp")
CALIBRATION_STEPS = 12  # the first 2 are not timed (ddp.WARMUP_STEPS)


def time_one_step(model: str, batch_size: int, threads: int) -> float:
    """Seconds of one training step (forward, backward, SGD) of `model` at `batch_size` on
    this machine's CPU with `threads` torch threads: what a worker computes per push."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        timing = run_single(model, batch_size, CALIBRATION_STEPS, torch.device("cpu"))
    finally:
        torch.set_num_threads(previous)
    return batch_size / timing.images_per_second


def run_policy(
    mode: str,
    workers: int,
    model: str,
    batch_size: int,
    epochs: int,
    train_limit: int,
    delay: float,
    threads: int,
) -> dict[str, Any]:
    with ProcessGroup(threads) as group:
        summary_path = group.scratch / "summary.json"
        _, endpoint = group.start_server(
            mode,
            "--mode",
            mode,
            "--staleness",
            "2",
            "--workers",
            str(workers),
            "--model",
            model,
            "--batch-size",
            str(batch_size),
            "--epochs",
            str(epochs),
            "--train-limit",
            str(train_limit),
            "--lr",
            "0.05",
            "--momentum",
            "0.9",
            "--threads",
            str(threads),
            "--summary",
            str(summary_path),
            "--step-timeout",
            "600",
        )
        for rank in range(workers):
            slow = ["--step-delay", str(delay)] if rank == 0 else []
            group.start(
                f"worker{rank}",
                "psworker.cli",
                "--server",
                endpoint,
                "--device",
                "cpu",
                "--threads",
                str(threads),
                "--progress",
                "none",
                "--log-level",
                "warning",
                *slow,
            )
        group.wait(3600, mode)
        summary = json.loads(summary_path.read_text())
    staleness = summary.get("staleness", {"mean": 0.0, "max": 0})
    return {
        "mode": mode,
        "images_per_second": summary["images_per_second"],
        "test_accuracy": summary["test_accuracy"],
        "global_steps": summary["global_steps"],
        "wall_seconds": summary["wall_seconds"],
        "staleness_mean": staleness["mean"],
        "staleness_max": staleness["max"],
    }


def _outcome(run: dict[str, Any]) -> str:
    return f"{run['images_per_second']:.1f} img/s, test accuracy {run['test_accuracy']:.4f}"


def run_straggler(
    workers: int,
    model: str,
    batch_size: int,
    epochs: int,
    train_limit: int,
    delay: float | None,
    threads: int,
    slowdown: float = 2.0,
) -> dict[str, Any]:
    """The three policies in turn. `delay`, when given, is the slow worker's sleep per step;
    otherwise it is calibrated to make that worker `slowdown` times as slow."""
    total = len(POLICIES) + 1
    step_s = announced(
        1,
        total,
        f"one training step of {model}, batch {batch_size}, {threads} thread(s), timed here",
        functools.partial(time_one_step, model, batch_size, threads),
        lambda seconds: f"{seconds * 1000:.1f} ms",
    )
    if delay is None:
        delay = (slowdown - 1) * step_s
    runs = [
        announced(
            index,
            total,
            f"ps {mode}: ps-server + {workers} ps-workers, worker 0 {delay:.3g} s slower a step, "
            f"{epochs} epoch(s) of {train_limit} images",
            functools.partial(
                run_policy, mode, workers, model, batch_size, epochs, train_limit, delay, threads
            ),
            _outcome,
        )
        for index, mode in enumerate(POLICIES, start=2)
    ]
    return {
        "benchmark": "straggler",
        "workers": workers,
        "model": model,
        "batch_size": batch_size,
        "epochs": epochs,
        "train_limit": train_limit,
        "slow_worker_delay_s": delay,
        "step_compute_s": step_s,  # one step of the others, timed before the runs
        # How many times as long the slow worker takes to compute a step as the others.
        "slowdown": (step_s + delay) / step_s,
        "threads": threads,
        "runs": runs,
    }
