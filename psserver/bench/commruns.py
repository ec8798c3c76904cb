"""The runs of `ps-bench comm`: the bare ZeroMQ floor and a real ps-server with synthetic
workers, each timed round by round, with its CPU tally and the server's peak memory.

What this is not: the order the runs take turns in, nor the record they add up to
(psserver.bench.comm); the clients themselves are psserver.bench.clients'.
"""

import dataclasses
import statistics
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from common.errors import PSError
from psserver.bench import floor
from psserver.bench.clients import ClientJob, run_clients, server_bind
from psserver.bench.cputally import NO_CPU, CpuTally, clients_cpu
from psserver.bench.procs import ProcessGroup


def _per_round(groups: list[list[float]]) -> list[float]:
    """A sync round lasts until its slowest client is done."""
    if len({len(times) for times in groups}) > 1:  # zip would quietly drop the extra rounds
        raise PSError(
            f"the clients timed {[len(times) for times in groups]} rounds, where each should "
            "have timed as many: one stopped early (its log says why)"
        )
    return [max(times) for times in zip(*groups, strict=True)]


def run_floor(workers: int, nbytes: int, rounds: int) -> tuple[list[float], CpuTally]:
    """`rounds` timed rounds after the warm-up ones, as a synthetic worker times them."""
    total = rounds + floor.WARMUP_ROUNDS
    with ProcessGroup() as group:
        server = group.start_role(
            "floor-server",
            floor.SERVER,
            {"bind": server_bind(None), "clients": workers, "nbytes": nbytes, "rounds": total},
            {"endpoint_file": group.scratch / "floor.endpoint"},
            {"out": group.scratch / "floor-server.json"},
            server=True,
        )
        endpoint = group.endpoint("floor.endpoint", server, "floor")
        job = ClientJob("floor", endpoint, total, nbytes)
        results = run_clients(group, "floor", job, workers)
        group.wait(60, "floor", roles=["floor-server"])  # it writes its CPU time last
        groups = [result["round_seconds"][floor.WARMUP_ROUNDS :] for result in results]
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
    num_shards: int = 1,
    job: Mapping[str, Any] | None = None,
    port: int | None = None,
) -> SystemRun:
    """Synthetic workers against a real server (its leader starts its followers beside it),
    given `job`'s options too; on `port` (a sharded server's followers on the next ports),
    or any free one."""
    max_steps = workers * (rounds + 2) + 10
    with ProcessGroup() as group:
        run = {
            "mode": mode, "workers": workers, "model": model, "batch_size": 1, "test_limit": 1,
            "threads": 1,
            # As many epochs as steps: --max-steps ends the job, never the data (at batch 1,
            # one epoch of the embedded set is 3,000 rounds for 2 workers).
            "max_steps": max_steps, "epochs": max_steps, "stop_grace": 2.0,
            "num_shards": num_shards,
        }  # fmt: skip
        server, endpoint = group.start_server(mode, {**run, **(job or {})}, server_bind(port))
        # The workers stop after their rounds; the server then waits for steps in vain.
        results = run_clients(group, mode, ClientJob("synthetic", endpoint, rounds), workers)
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


def updates_per_second(run: SystemRun, workers: int) -> float:
    """Async: every round of every worker is one update, and the workers run at once."""
    return workers / statistics.median(run.rounds)
