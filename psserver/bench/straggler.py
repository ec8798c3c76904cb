"""`ps-bench straggler`: one slow worker, three policies. How much throughput and accuracy do
sync, async and SSP keep when one of N workers takes twice as long per step?

The slow worker sleeps `delay` seconds before each push (`ps-worker --step-delay`); pick the
delay near one step's compute time to make it about 2x slower. Every run trains the same job
on the embedded data set and reports images/s (applied samples over wall time), test accuracy
and the staleness the policy allowed.
"""

import functools
import json
from typing import Any

from psserver.bench.options import announced
from psserver.bench.procs import ProcessGroup

POLICIES = ("sync", "async", "ssp")


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
    delay: float,
    threads: int,
) -> dict[str, Any]:
    runs = [
        announced(
            index,
            len(POLICIES),
            f"ps {mode}: ps-server + {workers} ps-workers, worker 0 {delay:g} s slower a step, "
            f"{epochs} epoch(s) of {train_limit} images",
            functools.partial(
                run_policy, mode, workers, model, batch_size, epochs, train_limit, delay, threads
            ),
            _outcome,
        )
        for index, mode in enumerate(POLICIES, start=1)
    ]
    return {
        "benchmark": "straggler",
        "workers": workers,
        "model": model,
        "batch_size": batch_size,
        "epochs": epochs,
        "train_limit": train_limit,
        "slow_worker_delay_s": delay,
        "threads": threads,
        "runs": runs,
    }
