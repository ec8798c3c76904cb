"""The runs of `ps-bench comm`: the bare ZeroMQ floor and a real ps-server with synthetic
workers, each timed round by round, with its CPU tally and the server's peak memory.

What this is not: the order the runs take turns in, nor the record they add up to
(psserver.bench.comm); where the clients run is the `Clients`' business
(psserver.bench.clients, .remote).
"""

import contextlib
import dataclasses
import statistics
from pathlib import Path

from common.errors import PSError
from psserver.bench.clients import ClientJob, Clients, server_bind
from psserver.bench.cputally import NO_CPU, CpuTally, clients_cpu
from psserver.bench.floor import WARMUP_ROUNDS
from psserver.bench.procs import ProcessGroup


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


def updates_per_second(run: SystemRun, workers: int) -> float:
    """Async: every round of every worker is one update, and the workers run at once."""
    return workers / statistics.median(run.rounds)
