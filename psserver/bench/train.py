"""`ps-bench train`: end-to-end training throughput of this system against plain PyTorch.

Runs of the same model, the same per-worker batch B and the same step count S, one after
another in one invocation, so that they see the same machine:

- `sync`, `async`: a real ps-server and N real ps-worker processes. Images/s is the server's
  summary `steady_images_per_second`: training samples applied / wall time, from the
  2 N-th push (in sync, every worker's first 2 gradients: the steps that pull the whole model
  and warm up; in async, the first 2 N pushes whoever sent them, so a worker that started
  late may still warm up inside the window, which counts against this system) to the last
  update. It leaves out process start-up and the final
  evaluation. Async runs N·S updates, so that each worker does about S steps. Workers
  overlap: they send gradient buckets during backward.
- `sync_no_overlap`: sync again, but workers push the whole gradient after backward and the
  server applies it whole (`--no-overlap`, `--bucket-mb 0`). `sync` over this is the gain
  of overlap (`overlap_gain`).
- `single_process`: plain PyTorch in one process with the global batch N·B
  (`psserver.bench.ddp single`).
- `ddp`: DistributedDataParallel, N ranks of batch B (gloo on the CPU, NCCL on GPUs).
- with `--num-shards K` (K > 1), two more sync runs on K server shards: `sync_sharded`, whose
  workers push each shard's slice from autograd hooks during backward (overlap), and
  `sync_sharded_no_overlap`, whose workers push after backward. Their ratio is
  `sharded_overlap_gain`. The K - 1 follower shards get T threads each, like the leader.

`--phases` runs some of them (DDP always: every rate is reported against it); a ratio is
reported when both of its phases ran.

The two PyTorch runs time S - 2 steps too, after the same 2 warm-up steps (see
`psserver.bench.ddp`), so that every run is timed over the same steps. (Before, the
parameter server's rate included its first steps: at 100 Mbit/s that cost it about a tenth.)

CPU budget: every ps-worker and every DDP rank gets T torch threads; the single process gets
N·T, the CPU the cluster's workers get together. The ps-server gets T more threads of its own:
it applies the updates, which PyTorch does inside the training processes.

Across hosts (`--agent HOST`, repeatable, with `ps-bench agent` running on each): the
servers run here, worker and DDP rank r on agent r mod A, the single process on the first
agent, each on a device chosen from the GPUs that agent reported. The DDP rendezvous store
runs in this process, so that every rank dials this host, as ps-workers dial the server.

What this is not: a measure of convergence (see the summary's test accuracy for that), nor of
communication alone (that is `ps-bench comm`).
"""

import contextlib
import dataclasses
import functools
import json
import math
import socket
import statistics
from pathlib import Path
from typing import Any

import torch.distributed as dist

from common.data import DataSource, load_split, steps_per_epoch
from common.errors import ConfigError, PSError
from common.models import MODELS
from psserver.bench.addresses import tcp_endpoint
from psserver.bench.buckets import without_one_bucket_gains
from psserver.bench.clients import server_bind
from psserver.bench.ddp import RENDEZVOUS_TIMEOUT
from psserver.bench.netns import LinkLab
from psserver.bench.options import PhasesError, check_phases
from psserver.bench.procs import WHOLE_GRADIENT, ProcessGroup, bucket_args
from psserver.bench.remote import RemoteClients
from psserver.bench.trainjob import TrainJob, TrainRole
from psserver.local import worker_devices
from psserver.report import WARMUP_STEPS

TIMEOUT_HINT = "raise --timeout or lower --steps"

PHASES = ("sync", "sync_no_overlap", "async", "single_process", "ddp")
SHARDED_PHASES = ("sync_sharded", "sync_sharded_no_overlap")
LABELS = {
    "sync": "ps sync",
    "sync_no_overlap": "ps sync, no overlap",
    "async": "ps async",
    "single_process": "single process",
    "ddp": "pytorch ddp",
    "sync_sharded": "ps sync, sharded, overlap",
    "sync_sharded_no_overlap": "ps sync, sharded, no overlap",
}
# Ratios reported when both phases ran: name -> (numerator, denominator).
GAINS = {
    "overlap_gain": ("sync", "sync_no_overlap"),
    "sharded_overlap_gain": ("sync_sharded", "sync_sharded_no_overlap"),
}
TEST_LIMIT = 100  # the server evaluates at the end; keep that short (it is not timed anyway)


@dataclasses.dataclass(frozen=True)
class TrainBench:
    """What `ps-bench train` measures; validated once, then passed to every phase."""

    workers: int
    model: str
    batch_size: int
    steps: int
    threads: int
    device: str = "auto"  # auto | cpu | cuda, as ps-local's --device
    timeout: float = 1800.0  # seconds per phase
    num_shards: int = 1  # > 1 adds the sharded runs, with and without overlap
    bucket_mb: float | None = None  # the overlapping runs' buckets; None: the server's default
    only: tuple[str, ...] = ()  # --phases: these phases (in PHASES' order); (): every one

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ConfigError(f"--model must be one of {sorted(MODELS)}, got {self.model!r}")
        if min(self.workers, self.batch_size, self.threads) < 1:
            raise ConfigError("--workers, --batch-size and --threads must be at least 1")
        if self.steps <= WARMUP_STEPS:
            raise ConfigError(
                f"--steps must be more than the {WARMUP_STEPS} warm-up steps, got {self.steps}"
            )
        if self.num_shards < 1:
            raise ConfigError(f"--num-shards must be at least 1, got {self.num_shards}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"--device must be auto, cpu or cuda, got {self.device!r}")
        sharded = [phase for phase in self.only if phase in SHARDED_PHASES]
        if self.num_shards == 1 and sharded:
            raise PhasesError(
                f"names sharded phases ({','.join(sharded)}): they need --num-shards 2 or more"
            )
        if self.only:
            check_phases(self.only, self.available_phases())

    def available_phases(self) -> tuple[str, ...]:
        return PHASES + (SHARDED_PHASES if self.num_shards > 1 else ())

    def phases(self) -> tuple[str, ...]:
        """The phases this invocation runs, in order."""
        return self.only or self.available_phases()

    def epoch_steps(self) -> int:
        """Steps in one epoch of the embedded training set, which every run trains on."""
        train_size = len(load_split(DataSource(), train=True))
        return steps_per_epoch(train_size, self.workers, self.batch_size)

    def epoch_end_inside(self) -> str | None:
        """A warning when an epoch ends within the timed steps: the server then evaluates
        there (TEST_LIMIT images) while its workers wait, a pause that the PyTorch runs do
        not have. Not refused: large batches have short epochs."""
        per_epoch = self.epoch_steps()
        if self.steps <= per_epoch:
            return None
        # Fewer steps than WARMUP_STEPS + 1 are refused: then only smaller batches help.
        advice = f"--steps {per_epoch}" if per_epoch > WARMUP_STEPS else "a smaller --batch-size"
        return (
            f"--steps {self.steps} crosses an epoch's end ({per_epoch} steps of {self.workers} "
            f"x {self.batch_size}): the server's evaluation there falls inside the parameter "
            f"server's timed steps; {advice} avoids it"
        )

    def devices(self) -> list[str]:
        """One device per worker / DDP rank: one GPU each if there are enough, else the CPU."""
        return worker_devices(self.workers, self.device)


def describe(phase: str, bench: TrainBench, devices: list[str]) -> str:
    where = devices[0] if len(set(devices)) == 1 else f"{devices[0]}..{devices[-1]}"
    n, b, t = bench.workers, bench.batch_size, bench.threads
    if phase in ("sync", "sync_no_overlap", "async", *SHARDED_PHASES):
        steps = bench.steps if phase != "async" else n * bench.steps
        servers = f"{bench.num_shards} server shards" if phase in SHARDED_PHASES else "ps-server"
        return (
            f"{LABELS[phase]}: {servers} + {n} ps-workers on {where}, {steps} updates of "
            f"batch {b}, {t} thread(s) each"
        )
    if phase == "single_process":
        return (
            f"{LABELS[phase]}: batch {n * b} on {devices[0]}, {n * t} thread(s), "
            f"{bench.steps} steps"
        )
    return f"{LABELS[phase]}: {n} ranks of batch {b} on {where}, {t} thread(s) each"


def run_phase(
    phase: str, bench: TrainBench, devices: list[str], remote: RemoteClients | None = None
) -> float:
    """Run one phase and return its images per second; with `remote`, the workers, ranks
    and single process run on its agents' hosts."""
    if phase in ("sync", "async"):
        return run_parameter_server(phase, bench, devices, remote=remote)
    if phase == "sync_no_overlap":
        return run_parameter_server("sync", bench, devices, overlap=False, remote=remote)
    if phase in SHARDED_PHASES:
        overlap = phase == "sync_sharded"
        return run_parameter_server(
            "sync", bench, devices, bench.num_shards, overlap, remote=remote
        )
    if phase == "single_process":
        return run_single_process(bench, devices[0], remote)
    if phase == "ddp":
        return run_ddp(bench, devices, remote=remote)
    raise ValueError(f"unknown phase {phase!r}")


def remote_job(
    bench: TrainBench, role: TrainRole, endpoint: str, devices: list[str], overlap: bool = True
) -> TrainJob:
    """A TrainJob of this benchmark's settings, for `ps-bench agent`s."""
    single = role == "single"
    return TrainJob(
        role,
        endpoint,
        bench.model,
        bench.workers * bench.batch_size if single else bench.batch_size,
        bench.steps,
        bench.workers * bench.threads if single else bench.threads,
        1 if single else bench.workers,
        tuple(devices),
        overlap,
    )


def run_parameter_server(
    mode: str,
    bench: TrainBench,
    devices: list[str],
    num_shards: int = 1,
    overlap: bool = True,
    lab: LinkLab | None = None,
    stream: bool = True,
    remote: RemoteClients | None = None,
) -> float:
    """With a `lab`, the server runs on its host 0 and worker r on host r + 1; with
    `remote`, the server runs here and the workers on its agents (and a sharded server's
    followers on its shard agents, if it has any). `stream`: updated buckets go back as
    soon as they are applied (ps-server --stream-weights)."""
    updates = bench.steps if mode == "sync" else bench.workers * bench.steps
    # Enough epochs for S steps per worker; --max-steps ends the run first.
    epochs = math.ceil(bench.steps / bench.epoch_steps()) + 1
    followers_elsewhere = num_shards > 1 and (
        lab is not None or (remote is not None and remote.places_followers)
    )
    with ProcessGroup(bench.threads) as group:
        summary = group.scratch / "summary.json"
        secret, secret_file = group.shard_secret() if followers_elsewhere else (None, None)
        _, endpoint = group.start_server(
            mode,
            *("--mode", mode, "--workers", str(bench.workers), "--model", bench.model),
            *("--batch-size", str(bench.batch_size), "--epochs", str(epochs)),
            *("--max-steps", str(updates), "--test-limit", str(TEST_LIMIT)),
            *("--summary", str(summary), "--threads", str(bench.threads)),
            *("--num-shards", str(num_shards)),
            # Without overlap the gradient is also applied whole: the baseline of before.
            *(bucket_args(bench.bucket_mb) if overlap else WHOLE_GRADIENT),
            *(() if stream else ("--no-stream-weights",)),
            # On hosts, each shard runs on a host of its own: the leader is shard 0 only.
            *(("--shard", "0", "--shard-secret-file", str(secret_file)) if secret else ()),
            bind=where_the_server_listens(lab, remote),
            prefix=lab.prefix_for(0) if lab else (),
        )
        if lab is not None and secret_file is not None:  # else the leader starts its own
            start_followers(group, lab, endpoint, num_shards, bench, secret_file)
        if remote is not None:
            job = remote_job(bench, "ps-worker", endpoint, devices, overlap)
            # The followers last through the workers' run and then the server's wait.
            lifetime = 2 * bench.timeout
            with (
                remote.followers(endpoint, num_shards, bench.threads, lifetime, secret)
                if followers_elsewhere
                else contextlib.nullcontext()
            ):
                remote.run(group, mode, job, bench.workers, bench.timeout)
                # The server's summary; its last evaluation still fetches the followers' slices,
                # so a follower that fails meanwhile is reported now, not at the timeout.
                watch = functools.partial(remote.watch_followers, mode)
                group.wait(bench.timeout, mode, hint=TIMEOUT_HINT, watch=watch)
            return steady_rate(json.loads(summary.read_text()))
        for rank, device in enumerate(devices):
            group.start(
                f"worker{rank}",
                "psworker.cli",
                *("--server", endpoint, "--device", device, "--threads", str(bench.threads)),
                *("--progress", "none", "--log-level", "warning", "--name", f"bench-{rank}"),
                "--overlap" if overlap else "--no-overlap",
                prefix=lab.prefix_for(rank + 1) if lab else (),
            )
        group.wait(bench.timeout, mode, hint=TIMEOUT_HINT)
        return steady_rate(json.loads(summary.read_text()))


def where_the_server_listens(lab: LinkLab | None, remote: RemoteClients | None) -> str:
    """Its lab host's address, the address the agents reach, or loopback."""
    if lab is not None:
        return f"tcp://{lab.address(0)}:5555"
    return server_bind(remote) if remote is not None else "tcp://127.0.0.1:*"


def steady_rate(summary: dict[str, Any]) -> float:
    """The server summary's images/s after the warm-up pushes."""
    rate = summary.get("steady_images_per_second")
    if rate is None:
        raise PSError(
            f"the server's summary has no steady rate: the run ended within its "
            f"{summary.get('warmup_pushes')} warm-up pushes; give it more --steps"
        )
    return float(rate)


def start_followers(
    group: ProcessGroup, lab: LinkLab, leader: str, num_shards: int, bench: TrainBench,
    secret_file: Path,
) -> None:  # fmt: skip
    """Shards 1..K-1, each on a host of its own after the server's and the workers'."""
    for shard in range(1, num_shards):
        host = bench.workers + shard
        group.start(
            f"shard{shard}",
            "psserver.cli",
            *("--shard", str(shard), "--num-shards", str(num_shards), "--leader", leader),
            *("--bind", f"tcp://{lab.address(host)}:5555", "--log-level", "warning"),
            *("--threads", str(bench.threads), "--shard-secret-file", str(secret_file)),
            prefix=lab.prefix_for(host),
            follower=True,
        )


def run_single_process(
    bench: TrainBench, device: str, remote: RemoteClients | None = None
) -> float:
    # The same total CPU as the cluster's workers: N·T threads (the server's T are extra).
    threads = bench.workers * bench.threads
    with ProcessGroup(threads) as group:
        if remote is not None:  # on the first agent's host, like worker 0
            job = remote_job(bench, "single", "", [device])
            [result] = remote.run(group, "single_process", job, 1, bench.timeout)
            return float(result["images_per_second"])
        group.start(
            "single",
            "psserver.bench.ddp",
            "single",
            *_reference_args(bench, bench.workers * bench.batch_size, threads, device),
            *("--out", str(group.scratch / "single.json")),
        )
        group.wait(bench.timeout, "single_process", hint=TIMEOUT_HINT)
        return float(group.read_json("single.json")["images_per_second"])


def run_ddp(
    bench: TrainBench,
    devices: list[str],
    lab: LinkLab | None = None,
    remote: RemoteClients | None = None,
) -> float:
    """With a `lab`, rank r runs on its host r + 1 (host 0 is the server's); with `remote`,
    on its agents."""
    if remote is not None:
        return run_remote_ddp(bench, devices, remote)
    port = free_port() if lab is None else 29500
    master = lab.address(1) if lab else "127.0.0.1"
    with ProcessGroup(bench.threads) as group:
        if lab is not None:  # gloo would look for the address of the machine's host name
            group.env["GLOO_SOCKET_IFNAME"] = "eth0"
        for rank, device in enumerate(devices):
            group.start(
                f"rank{rank}",
                "psserver.bench.ddp",
                "rank",
                *_reference_args(bench, bench.batch_size, bench.threads, device),
                *("--rank", str(rank), "--world-size", str(bench.workers)),
                *("--master-addr", master, "--master-port", str(port)),
                *("--out", str(group.scratch / "ddp.json")),
                prefix=lab.prefix_for(rank + 1) if lab else (),
            )
        group.wait(bench.timeout, "ddp", hint=TIMEOUT_HINT)
        return float(group.read_json("ddp.json")["images_per_second"])


def run_remote_ddp(bench: TrainBench, devices: list[str], remote: RemoteClients) -> float:
    """DDP ranks on the agents, around a rendezvous store in this process: each rank dials
    this host, the one that asked its agent."""
    store = dist.TCPStore(
        remote.server_host,
        remote.server_port or 0,
        is_master=True,
        wait_for_workers=False,
        timeout=RENDEZVOUS_TIMEOUT,
    )
    job = remote_job(bench, "ddp-rank", tcp_endpoint(remote.server_host, store.port), devices)
    with ProcessGroup(bench.threads) as group:
        results = remote.run(group, "ddp", job, bench.workers, bench.timeout)
    del store  # closes its listening socket
    return float(results[0]["images_per_second"])  # rank 0 timed the world


def _reference_args(bench: TrainBench, batch_size: int, threads: int, device: str) -> list[str]:
    return [
        *("--model", bench.model, "--batch-size", str(batch_size)),
        *("--steps", str(bench.steps), "--threads", str(threads), "--device", device),
    ]


def free_port() -> int:
    """A port that was free a moment ago; another process could take it first (unlikely)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


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
