"""`ps-bench straggler`: one slow worker, three policies. How much throughput and accuracy do
sync, async and SSP keep when one of N workers takes twice as long per step?

The slow worker sleeps before each push (`ps-worker --step-delay`). By default the sleep is
calibrated: a short sync run of the same job with no sleep times a worker's whole step
(compute, pull and push) first, and the sleep is (slowdown - 1) times that, so that the slow
worker takes `slowdown` times as long per step as the others. A `--delay` given skips that
run, and then the slowdown is not known. Every run trains the same job on the first
`--train-limit` images of the embedded data set and reports images/s (applied samples over
wall time), test accuracy and the staleness the policy allowed.
"""

import functools
import json
from typing import Any

from common.catalog import load_training_set
from common.data import DataSource
from common.errors import ConfigError
from common.logs import counted
from common.roles import WORKER, WorkerSpec
from psserver.bench.options import announced
from psserver.bench.procs import ProcessGroup

POLICIES = ("sync", "async", "ssp")
CALIBRATION_STEPS = 12  # steps of the calibration run; its first 2 per worker are not timed


def check_train_limit(train_limit: int, workers: int, batch_size: int) -> None:
    """A ConfigError unless every step can take a full batch from each worker out of the
    `train_limit` images, and the data set has that many: the server quietly used all its
    images for a larger limit, and the report named the larger number."""
    have = len(load_training_set(DataSource()))
    if train_limit > have:
        raise ConfigError(
            f"{train_limit} is more than the {have} images of the embedded training set: "
            f"give at most {have}"
        )
    step = workers * batch_size
    if train_limit < step:
        raise ConfigError(
            f"{counted(train_limit, 'image')} are less than one step's batches "
            f"({counted(workers, 'worker')} x {batch_size}): give at least {step}, or a smaller "
            "--batch-size"
        )


def time_one_step(workers: int, model: str, batch_size: int, threads: int) -> float:
    """Seconds of one worker step of this job on this machine, with nobody slowed down: the
    steady rate of a short sync run, where every worker computes, pushes and pulls once a
    step."""
    run = run_policy(
        "sync", workers, model, batch_size, 1, workers * batch_size * CALIBRATION_STEPS, 0.0,
        threads,
    )  # fmt: skip
    rate = run["steady_images_per_second"] or run["images_per_second"]
    return workers * batch_size / rate


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
        job = {
            "mode": mode, "staleness": 2 if mode == "ssp" else None, "workers": workers,
            "model": model, "batch_size": batch_size, "epochs": epochs,
            "train_limit": train_limit, "lr": 0.05, "momentum": 0.9, "threads": threads,
            "summary": summary_path, "step_timeout": 600.0,
        }  # fmt: skip
        _, endpoint = group.start_server(mode, job)
        for rank in range(workers):
            worker = WorkerSpec(
                server=endpoint,
                device="cpu",
                threads=threads,
                progress="none",
                log_level="warning",
                step_delay=delay if rank == 0 else 0.0,
            )
            group.start_role(f"worker{rank}", WORKER, worker)
        group.wait(3600, mode)
        summary = json.loads(summary_path.read_text())
    staleness = summary.get("staleness", {"mean": 0.0, "max": 0})
    return {
        "mode": mode,
        "images_per_second": summary["images_per_second"],
        "steady_images_per_second": summary["steady_images_per_second"],
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
    otherwise it is calibrated to make that worker `slowdown` times as slow (one run more)."""
    calibrate = delay is None
    total = len(POLICIES) + calibrate
    step_s: float | None = None  # one worker step with nobody slowed; not timed with a delay
    if delay is None:
        step_s = announced(
            1,
            total,
            f"calibration: ps sync with {workers} ps-workers and no sleep, "
            f"{CALIBRATION_STEPS} steps of batch {batch_size}",
            functools.partial(time_one_step, workers, model, batch_size, threads),
            lambda seconds: f"{seconds * 1000:.1f} ms a step",
        )
        delay = (slowdown - 1) * step_s
    runs = [
        announced(
            index,
            total,
            f"ps {mode}: ps-server + {workers} ps-workers, worker 0 {delay:.3g} s slower a step, "
            f"{counted(epochs, 'epoch')} of {counted(train_limit, 'image')}",
            functools.partial(
                run_policy, mode, workers, model, batch_size, epochs, train_limit, delay, threads
            ),
            _outcome,
        )
        for index, mode in enumerate(POLICIES, start=1 + calibrate)
    ]
    return {
        "benchmark": "straggler",
        "workers": workers,
        "model": model,
        "batch_size": batch_size,
        "epochs": epochs,
        "train_limit": train_limit,
        "slow_worker_delay_s": delay,
        "step_s": step_s,  # one worker step with nobody slowed, timed before the runs
        # How many times as long the slow worker takes per step as the others; None (as
        # step_s) with --delay, which skips the calibration that times a step.
        "slowdown": None if step_s is None else (step_s + delay) / step_s,
        "threads": threads,
        "runs": runs,
    }
