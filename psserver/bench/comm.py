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
how short that is. With `--agent`, the clients run on other hosts (psserver.bench.remote)
and the bound is the busiest host's.
"""

import contextlib
import dataclasses
import functools
import socket
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from common.errors import PSError
from common.models import build_model
from psserver.bench.buckets import gradient_buckets, one_bucket_note
from psserver.bench.clients import ClientJob, Clients, LocalClients, server_bind, usable_cores
from psserver.bench.floor import WARMUP_ROUNDS
from psserver.bench.options import announced, in_turns
from psserver.bench.procs import WHOLE_GRADIENT, ProcessGroup, bucket_args

# (host, its cores, CPU seconds): the clients that ran on one host other than this one.
HostCpu = tuple[str, int, float]


@dataclasses.dataclass(frozen=True)
class RoundStats:
    median_ms: float
    min_ms: float
    max_ms: float

    @classmethod
    def of(cls, seconds: list[float]) -> "RoundStats":
        ms = [s * 1000 for s in seconds]
        return cls(statistics.median(ms), min(ms), max(ms))


@dataclasses.dataclass(frozen=True)
class CpuTally:
    """CPU seconds spent in the timed rounds of one or more runs."""

    server_s: float  # the server's (a sharded server's leader only)
    workers_s: float  # all the workers' together, wherever they ran
    rounds: int  # the rounds both cover, summed over runs
    # A sharded server's followers, all together (0 without shards); None: not counted (the
    # server did not start them itself, or could not read their CPU time).
    followers_s: float | None = 0.0
    # The workers' CPU seconds on each other host (with `--agent`), which has cores of its
    # own; empty when every worker ran beside the server.
    elsewhere: tuple[HostCpu, ...] = ()

    def __add__(self, other: "CpuTally") -> "CpuTally":
        followers = (
            None
            if self.followers_s is None or other.followers_s is None
            else self.followers_s + other.followers_s
        )
        return CpuTally(
            self.server_s + other.server_s,
            self.workers_s + other.workers_s,
            self.rounds + other.rounds,
            followers,
            by_host([*self.elsewhere, *other.elsewhere]),
        )

    def per_round_ms(self, workers: int) -> dict[str, float | None]:
        rounds = max(self.rounds, 1)
        return {
            "server": 1000 * self.server_s / rounds,
            "followers": None if self.followers_s is None else 1000 * self.followers_s / rounds,
            "each_worker": 1000 * self.workers_s / workers / rounds,
        }

    def bound_ms(self, cores: int) -> float | None:
        """The shortest round the CPU allows: on each host, the CPU time a round of what ran
        there (the server, its followers and the workers beside them on this one, with its
        `cores`), spread perfectly over its cores; the busiest host's. None when the
        followers' was not counted."""
        if self.followers_s is None:
            return None
        elsewhere_s = sum(seconds for _, _, seconds in self.elsewhere)
        here_s = self.server_s + self.followers_s + self.workers_s - elsewhere_s
        busiest_s = max([here_s / cores] + [s / c for _, c, s in self.elsewhere])
        return 1000 * busiest_s / max(self.rounds, 1)


def clients_cpu(
    server_s: float, results: Sequence[dict[str, Any]], rounds: int, followers_s: float | None
) -> CpuTally:
    """The CPU tally of one run from its clients' results, each host's apart."""
    # A host of the same name is this one: the link lab's namespaces share its cores too.
    here = socket.gethostname()
    elsewhere = [(r["host"], r["cores"], r["cpu_seconds"]) for r in results if r["host"] != here]
    return CpuTally(
        server_s,
        sum(result["cpu_seconds"] for result in results),
        rounds,
        followers_s,
        by_host(elsewhere),
    )


def by_host(entries: Sequence[HostCpu]) -> tuple[HostCpu, ...]:
    """One entry per host: the CPU seconds of the entries of each added up."""
    seconds: dict[tuple[str, int], float] = {}
    for host, cores, spent in entries:
        seconds[host, cores] = seconds.get((host, cores), 0.0) + spent
    return tuple((host, cores, spent) for (host, cores), spent in seconds.items())


NO_CPU = CpuTally(0.0, 0.0, 0)


def model_bytes(model: str) -> int:
    import torch

    with torch.device("meta"):
        return 4 * sum(p.numel() for p in build_model(model).parameters())


def _per_round(groups: list[list[float]]) -> list[float]:
    """A sync round lasts until its slowest client is done."""
    if len({len(times) for times in groups}) > 1:  # zip would quietly drop the extra rounds
        raise PSError(
            f"the clients timed {[len(times) for times in groups]} rounds, where each should "
            "have timed as many: one stopped early (its log says why)"
        )
    return [max(times) for times in zip(*groups, strict=True)]


def run_floor(
    workers: int, nbytes: int, rounds: int, clients: Clients
) -> tuple[list[float], CpuTally]:
    """`rounds` timed rounds after the warm-up ones, as a synthetic worker times them."""
    total = rounds + WARMUP_ROUNDS
    with ProcessGroup() as group:
        server = group.start(
            "floor-server",
            "psserver.bench.floor",
            "server",
            *("--bind", server_bind(clients)),
            *("--clients", str(workers), "--nbytes", str(nbytes), "--rounds", str(total)),
            *("--endpoint-file", str(group.scratch / "floor.endpoint")),
            *("--out", str(group.scratch / "floor-server.json")),
            server=True,
        )
        endpoint = group.endpoint("floor.endpoint", server, "floor")
        job = ClientJob("floor", endpoint, total, nbytes)
        results = clients.run(group, "floor", job, workers)
        group.wait(60, "floor", roles=["floor-server"])  # it writes its CPU time last
        groups = [result["round_seconds"][WARMUP_ROUNDS:] for result in results]
        server_s = group.read_json("floor-server.json")["cpu_seconds"]
        return _per_round(groups), clients_cpu(server_s, results, rounds, 0.0)


def peak_rss_mb(pid: int) -> float:
    """The high-water mark of a live process's resident memory (Linux), in MB, plus that of
    its children (the follower shards a sharded server started); 0 elsewhere."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return 0.0
    own = next(
        (int(line.split()[1]) / 1024 for line in status.splitlines() if line.startswith("VmHWM:")),
        0.0,
    )
    return own + sum(peak_rss_mb(int(child)) for child in children)


@dataclasses.dataclass(frozen=True)
class SystemRun:
    rounds: list[float]  # seconds: sync rounds (the slowest client's), or every async round
    peak_rss_mb: float  # the server's (with its shards)
    streamed_pulls: int  # pulls that found the weights streamed already, over all workers
    cpu: CpuTally


def run_system(
    mode: str,
    workers: int,
    model: str,
    rounds: int,
    clients: Clients,
    num_shards: int = 1,
    server_args: tuple[str, ...] = (),
) -> SystemRun:
    """Synthetic workers against a real server.

    A sharded server's leader starts its followers beside it, unless `clients` places them
    elsewhere: then the leader runs as `--shard 0` and waits for them to join."""
    followers_elsewhere = num_shards > 1 and clients.places_followers
    max_steps = workers * (rounds + 2) + 10
    with ProcessGroup() as group:
        secret, secret_file = group.shard_secret() if followers_elsewhere else (None, None)
        server, endpoint = group.start_server(
            mode,
            *("--mode", mode, "--workers", str(workers), "--model", model),
            *("--batch-size", "1", "--test-limit", "1", "--threads", "1"),
            # As many epochs as steps: --max-steps ends the job, never the data (at batch 1,
            # one epoch of the embedded set is 3,000 rounds for 2 workers).
            *("--max-steps", str(max_steps), "--epochs", str(max_steps), "--stop-grace", "2"),
            *("--num-shards", str(num_shards)),
            *(("--shard", "0", "--shard-secret-file", str(secret_file)) if secret else ()),
            *server_args,
            bind=server_bind(clients),
        )
        with (
            clients.followers(endpoint, num_shards, shard_secret=secret)
            if followers_elsewhere
            else contextlib.nullcontext()
        ):
            # The workers stop after their rounds; the server then waits for steps in vain.
            results = clients.run(group, mode, ClientJob("synthetic", endpoint, rounds), workers)
            rss = peak_rss_mb(server.pid)  # still alive: it waits for steps nobody will push
        groups = [result["round_seconds"] for result in results]
        rounds_seen = _per_round(groups) if mode == "sync" else [t for g in groups for t in g]
        cpu = clients_cpu(  # worker 0 asked the server for its (and its followers') CPU time
            results[0].get("server_cpu_seconds", 0.0),
            results,
            len(groups[0]),
            results[0].get("followers_cpu_seconds") if num_shards > 1 else 0.0,
        )
        return SystemRun(rounds_seen, rss, sum(r["streamed_pulls"] for r in results), cpu)


def merge_runs(runs: list[SystemRun]) -> SystemRun:
    """Several runs of one phase as one: all their rounds, the highest peak, all pulls."""
    return SystemRun(
        [seconds for run in runs for seconds in run.rounds],
        max(run.peak_rss_mb for run in runs),
        sum(run.streamed_pulls for run in runs),
        sum((run.cpu for run in runs), NO_CPU),
    )


def _median_ms(rounds: list[float]) -> str:
    return f"{statistics.median(rounds) * 1000:.1f} ms a round (median)"


def _floor_outcome(result: tuple[list[float], CpuTally]) -> str:
    return _median_ms(result[0])


def _system_outcome(mode: str, workers: int, run: SystemRun) -> str:
    if mode == "async":
        return f"{updates_per_second(run, workers):.1f} updates/s"
    return _median_ms(run.rounds)


def updates_per_second(run: SystemRun, workers: int) -> float:
    """Async: every round of every worker is one update, and the workers run at once."""
    return workers / statistics.median(run.rounds)


def run_comm(
    workers: int,
    model: str,
    rounds: int,
    num_shards: int = 1,
    bucket_mb: float | None = None,
    repeat: int = 1,
    clients: Clients | None = None,
) -> dict[str, Any]:
    """With `repeat` > 1 the runs take turns, each turn starting one run later than the one
    before (floor, sync, whole, async, sharded; then sync, whole, ..., floor), so that neither
    a slow minute of a shared machine nor the run before it weighs on one kind only. Each row
    then holds the rounds of all its turns.

    `clients` runs the floor's clients and the synthetic workers: on this host by default."""
    clients = clients or LocalClients()
    nbytes = model_bytes(model)
    buckets = bucket_args(bucket_mb)
    floor_rounds: list[float] = []
    floor_cpu = NO_CPU
    phases: dict[str, list[SystemRun]] = {"sync": [], "whole": [], "async": [], "sharded": []}
    kinds = {  # mode, server shards, server args
        "sync": ("sync", 1, buckets),
        "whole": ("sync", 1, WHOLE_GRADIENT),
        "async": ("async", 1, buckets),
    }
    if num_shards > 1:
        kinds["sharded"] = ("sync", num_shards, buckets)
    order = ["floor", *kinds]
    descriptions = {
        "floor": f"zeromq floor: 1 server, {workers} clients",
        "sync": f"ps sync, buckets streamed back: ps-server + {workers} synthetic workers",
        "whole": f"ps sync, whole gradient: ps-server + {workers} synthetic workers",
        "async": f"ps async: ps-server + {workers} synthetic workers",
        "sharded": f"ps sync on {num_shards} server shards + {workers} synthetic workers",
    }
    runs = in_turns(order, repeat)
    floor_turns: list[float] = []  # each floor run's median ms, turn by turn
    for index, kind in enumerate(runs, start=1):
        description = f"{descriptions[kind]}, {rounds} rounds"
        if kind == "floor":
            run = functools.partial(run_floor, workers, nbytes, rounds, clients)
            seconds, used = announced(index, len(runs), description, run, _floor_outcome)
            floor_rounds += seconds
            floor_turns.append(statistics.median(seconds) * 1000)
            floor_cpu += used
        else:
            mode, shards, args = kinds[kind]
            run_ps = functools.partial(
                run_system, mode, workers, model, rounds, clients, shards, args
            )
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
        "server_host": clients.server_host,
        "client_hosts": clients.describe(workers),
        **sharded,
    }
