"""`ps-bench comm`: the cost of moving a model's weights and gradients, with no compute.

Three measurements in one run, side by side:
- floor: a bare zero-copy ZeroMQ exchange of the same bytes with the same number of clients;
- sync: real ps-server, N synthetic workers (pull weights, push a gradient) in sync mode.
  The gradient goes in buckets (the server's default --bucket-mb), each applied and streamed
  back as soon as every worker's part of it is in, as with workers that overlap;
- sync, whole: the same with one bucket (`--bucket-mb 0`): push all, apply all, pull all;
- async: the same in async mode, reported as updates per second.
- with `--num-shards K` (K > 1), sync again on K server shards: each worker moves the K
  slices in parallel.

For the floor and each sync run it also counts CPU time per round, the server's and each
worker's (ZeroMQ's I/O threads included): on a machine whose cores the server and workers
share, a round can be no shorter than their CPU time over the cores, and the report says
how short that is.

The runs themselves are in psserver.bench.commruns, their CPU tally in
psserver.bench.cputally; this module takes them in turns and makes the record. What this is
not: the table printed from that record (psserver.bench.commreport).
"""

import dataclasses
import functools
import statistics
from typing import Any

from common.catalog import build_model
from common.logs import counted
from psserver.bench.buckets import gradient_buckets, one_bucket_note
from psserver.bench.clients import usable_cores
from psserver.bench.commruns import SystemRun, merge_runs, run_floor, run_system, updates_per_second
from psserver.bench.cputally import NO_CPU, CpuTally
from psserver.bench.options import announced, in_turns
from psserver.bench.procs import WHOLE_GRADIENT, bucketed


@dataclasses.dataclass(frozen=True)
class RoundStats:
    median_ms: float
    min_ms: float
    max_ms: float

    @classmethod
    def of(cls, seconds: list[float]) -> "RoundStats":
        ms = [s * 1000 for s in seconds]
        return cls(statistics.median(ms), min(ms), max(ms))


def model_bytes(model: str) -> int:
    import torch

    with torch.device("meta"):
        return 4 * sum(p.numel() for p in build_model(model).parameters())


def _median_ms(rounds: list[float]) -> str:
    return f"{statistics.median(rounds) * 1000:.1f} ms a round (median)"


def _floor_outcome(result: tuple[list[float], CpuTally]) -> str:
    return _median_ms(result[0])


def _system_outcome(mode: str, workers: int, run: SystemRun) -> str:
    if mode == "async":
        return f"{updates_per_second(run, workers):.1f} updates/s"
    return _median_ms(run.rounds)


def run_comm(
    workers: int,
    model: str,
    rounds: int,
    num_shards: int = 1,
    bucket_mb: float | None = None,
    repeat: int = 1,
) -> dict[str, Any]:
    """With `repeat` > 1 the runs take turns, each turn starting one run later than the one
    before (floor, sync, whole, async, sharded; then sync, whole, ..., floor), so that neither
    a slow minute of a shared machine nor the run before it weighs on one kind only. Each row
    then holds the rounds of all its turns."""
    nbytes = model_bytes(model)
    buckets = bucketed(bucket_mb)
    floor_rounds: list[float] = []
    floor_cpu = NO_CPU
    phases: dict[str, list[SystemRun]] = {"sync": [], "whole": [], "async": [], "sharded": []}
    kinds = {  # mode, server shards, server options
        "sync": ("sync", 1, buckets),
        "whole": ("sync", 1, WHOLE_GRADIENT),
        "async": ("async", 1, buckets),
    }
    if num_shards > 1:
        kinds["sharded"] = ("sync", num_shards, buckets)
    order = ["floor", *kinds]
    synthetic = counted(workers, "synthetic worker")
    descriptions = {
        "floor": f"zeromq floor: 1 server, {counted(workers, 'client')}",
        "sync": f"ps sync, buckets streamed back: ps-server + {synthetic}",
        "whole": f"ps sync, whole gradient: ps-server + {synthetic}",
        "async": f"ps async: ps-server + {synthetic}",
        "sharded": f"ps sync on {num_shards} server shards + {synthetic}",
    }
    runs = in_turns(order, repeat)
    floor_turns: list[float] = []  # each floor run's median ms, turn by turn
    for index, kind in enumerate(runs, start=1):
        description = f"{descriptions[kind]}, {rounds} rounds"
        if kind == "floor":
            run = functools.partial(run_floor, workers, nbytes, rounds)
            seconds, used = announced(index, len(runs), description, run, _floor_outcome)
            floor_rounds += seconds
            floor_turns.append(statistics.median(seconds) * 1000)
            floor_cpu += used
        else:
            mode, shards, job = kinds[kind]
            run_ps = functools.partial(run_system, mode, workers, model, rounds, shards, job)
            outcome = functools.partial(_system_outcome, mode, workers)
            phases[kind].append(announced(index, len(runs), description, run_ps, outcome))
    floor = RoundStats.of(floor_rounds)
    sync_run, async_run = merge_runs(phases["sync"]), merge_runs(phases["async"])
    sync = RoundStats.of(sync_run.rounds)
    whole_run = merge_runs(phases["whole"])
    whole = RoundStats.of(whole_run.rounds)
    tallies = {"floor": floor_cpu, "sync": sync_run.cpu, "whole": whole_run.cpu}
    moved = 2 * nbytes * workers  # each worker: gradient up, weights down
    async_rate = updates_per_second(async_run, workers)
    sharded: dict[str, Any] = {}
    if num_shards > 1:
        sharded_run = merge_runs(phases["sharded"])
        stats = RoundStats.of(sharded_run.rounds)
        sharded = {
            "num_shards": num_shards,
            "sync_sharded_round_ms": stats.median_ms,
            "sync_sharded_round_stats_ms": dataclasses.asdict(stats),
            "sync_sharded_over_floor": stats.median_ms / floor.median_ms,
            "sync_sharded_gb_per_s": moved / (stats.median_ms / 1000) / 1e9,
            # all shards together, or the leader alone when its followers ran elsewhere
            "sync_sharded_peak_rss_mb": sharded_run.peak_rss_mb,
        }
        tallies["sharded"] = sharded_run.cpu  # the leader's as the server's, and its followers'
    cores = usable_cores()
    note = one_bucket_note(model, bucket_mb)
    cpu = {kind: tally.per_round_ms(workers) for kind, tally in tallies.items()}
    bounds = {kind: tally.bound_ms(cores) for kind, tally in tallies.items()}
    return {
        "benchmark": "comm",
        "model": model,
        "workers": workers,
        "rounds": rounds,
        "repeat": repeat,
        "model_bytes": nbytes,
        "bytes_per_round": moved,
        "floor_round_ms": dataclasses.asdict(floor),
        "sync_round_ms": sync.median_ms,
        "sync_round_stats_ms": dataclasses.asdict(sync),
        "sync_over_floor": sync.median_ms / floor.median_ms,
        "bucket_mb": bucket_mb,
        # With 1, the streamed row does what the whole one does (and `notes` says so).
        "sync_buckets": gradient_buckets(model, bucket_mb),
        "notes": [note] if note is not None else [],
        "sync_streamed_pulls": sync_run.streamed_pulls,
        "sync_whole_round_ms": whole.median_ms,
        "sync_whole_round_stats_ms": dataclasses.asdict(whole),
        "sync_whole_over_floor": whole.median_ms / floor.median_ms,
        "sync_gb_per_s": moved / (sync.median_ms / 1000) / 1e9,
        "sync_whole_gb_per_s": moved / (whole.median_ms / 1000) / 1e9,
        "floor_gb_per_s": moved / (floor.median_ms / 1000) / 1e9,
        "async_updates_per_second": async_rate,
        "server_peak_rss_mb": {"sync": sync_run.peak_rss_mb, "async": async_run.peak_rss_mb},
        "async_round_stats_ms": dataclasses.asdict(RoundStats.of(async_run.rounds)),
        "cpu_ms_per_round": cpu,
        # Rounds each sync row timed, over all its runs: the same for every row.
        "timed_rounds": {kind: tally.rounds for kind, tally in tallies.items()},
        "cores": cores,
        "cpu_bound_round_ms": bounds,
        # Each sync row's median over the floor's in the same turn: the spread says how far
        # the machine's drift reaches into the ratios above.
        "over_floor_by_turn": {
            kind: [
                statistics.median(run.rounds) * 1000 / floor_ms
                for run, floor_ms in zip(phases[kind], floor_turns, strict=True)
            ]
            for kind in kinds
            if kind != "async"
        },
        **sharded,
    }
