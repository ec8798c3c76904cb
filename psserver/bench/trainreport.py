"""The record of `ps-bench train` (and the ratios `ps-bench link` shares): each phase's
median images/s, its runs, its rate over DDP's, the gains, and the table's rows.

What this is not: the runs (psserver.bench.trainps, .baselines), nor printing or writing the
record (psserver.bench.traincli, .report).
"""

import statistics
from typing import Any

from psserver.bench.buckets import without_one_bucket_gains
from psserver.bench.trainbench import GAINS, LABELS, TrainBench
from psserver.status.report import WARMUP_STEPS


def median_rates(runs: dict[str, list[float]]) -> dict[str, float]:
    """Each phase's images/s: the median of its runs."""
    return {phase: statistics.median(values) for phase, values in runs.items()}


def summarize(
    bench: TrainBench, devices: list[str], runs: dict[str, list[float]]
) -> dict[str, Any]:
    """The JSON record: config, images/s per phase (the median of its runs, which are
    listed too), and each phase over DDP."""
    rates = median_rates(runs)
    results: dict[str, Any] = {
        "benchmark": "train",
        "workers": bench.workers,
        "model": bench.model,
        "batch_size": bench.batch_size,
        "global_batch_size": bench.workers * bench.batch_size,
        "steps": bench.steps,
        "threads": bench.threads,
        "bucket_mb": bench.bucket_mb,
        "num_shards": bench.num_shards,
        "devices": devices,
        "untimed_warmup_steps": WARMUP_STEPS,  # of every run, per worker
        "phases": list(rates),
        "images_per_second": dict(rates),
        "images_per_second_runs": runs,
    }
    return without_one_bucket_gains({**results, **ratios(rates, GAINS)}, ("overlap_gain",))


def ratios(rates: dict[str, float], gains: dict[str, tuple[str, str]]) -> dict[str, float]:
    """Every phase's rate over DDP's (`PHASE_over_ddp`), and each of `gains` (name ->
    (numerator, denominator)) whose two phases both ran."""
    over_ddp = {f"{p}_over_ddp": rate / rates["ddp"] for p, rate in rates.items() if p != "ddp"}
    both_ran = {
        name: rates[top] / rates[bottom]
        for name, (top, bottom) in gains.items()
        if top in rates and bottom in rates
    }
    return {**over_ddp, **both_ran}


def table_rows(results: dict[str, Any]) -> list[list[Any]]:
    rates, ddp = results["images_per_second"], results["images_per_second"]["ddp"]
    labels = dict(LABELS)
    if results.get("sync_buckets") == 1:  # pushed after backward, as without overlap
        labels["sync"] += " (1 bucket: nothing to overlap)"
    return [[labels[phase], rate, rate / ddp] for phase, rate in rates.items()]
