"""`ps-bench link`: training over a network of a given speed, where overlap has work to hide.

On one machine, processes talk over loopback at memory speed, and sending costs CPU that
backward needs too, so overlap has nothing to hide (see `ps-bench train`). Between machines
the link is often the bottleneck: ResNet-18's 45 MB gradient takes 0.36 s on 1 Gbit/s. This
benchmark puts the server and each worker on their own host of a `LinkLab` (network
namespaces with every link shaped to `--mbit` both ways) and runs, side by side:

- `sync`: workers send gradient buckets during backward (overlap), and the server sends each
  updated bucket straight back;
- `sync_no_stream`: the same, but the updated weights wait for the next pull;
- `sync_no_overlap`: workers push the whole gradient after backward;
- `sync_sharded`: sync with overlap on `--server-hosts` K server shards, each on a host of its
  own, so that each server's link carries 1/K of the bytes;
- `ddp`: PyTorch DDP over the same links (its ranks on the workers' hosts; it overlaps its
  all-reduce with backward too).

Every run also meters the links (psserver.bench.linkuse): `link_use` is the fraction of the
link rate the hosts that took part used, each way, over the run's busy window; it tells a
system that waits between transfers from one that is short of bandwidth.

`overlap_gain` is sync over sync_no_overlap, `streaming_gain` sync over sync_no_stream,
`sharding_gain` sync_sharded over sync; `--phases` runs a subset (DDP always runs: every rate
is reported against it). The hosts still share this machine's CPU cores.
Needs root, `ip` and `tc`.

Why more server hosts can beat DDP: a worker sends its gradient once and receives the weights
once, whatever the number of workers, while each rank of a ring all-reduce sends and receives
2 (N - 1) / N times the gradient: 1.5 times at N = 4. With as many server hosts as workers,
no link carries more than a worker's, so where the links are the bottleneck the parameter
server moves a third less per link at N = 4 (the reasoning of BytePS).
"""

import dataclasses
import statistics
from collections.abc import Iterable
from typing import Any

from common.errors import ConfigError
from common.logs import counted
from psserver.bench.baselines import run_ddp
from psserver.bench.buckets import without_one_bucket_gains
from psserver.bench.linkuse import MIN_BUSY_INTERVALS, SAMPLE_INTERVAL_S
from psserver.bench.netns import LinkLab
from psserver.bench.options import check_phases
from psserver.bench.report import markdown_table
from psserver.bench.trainbench import TrainBench
from psserver.bench.trainps import run_parameter_server
from psserver.bench.trainreport import median_rates, ratios

LINK_PHASES = ("sync", "sync_no_stream", "sync_no_overlap", "sync_sharded", "ddp")
LINK_LABELS = {
    "sync": "ps sync, overlap",
    "sync_no_stream": "ps sync, overlap, weights not streamed",
    "sync_no_overlap": "ps sync, no overlap",
    "sync_sharded": "ps sync, overlap, {K} server hosts",
    "ddp": "pytorch ddp",
}
WAYS = ("sent", "received")  # of psserver.bench.linkuse.link_use, averaged over a phase's runs
# Ratios reported when both phases ran: name -> (numerator, denominator).
GAINS = {
    "overlap_gain": ("sync", "sync_no_overlap"),
    "streaming_gain": ("sync", "sync_no_stream"),
    "sharding_gain": ("sync_sharded", "sync"),
}


@dataclasses.dataclass(frozen=True)
class LinkBench:
    train: TrainBench  # workers, model, batch, steps, threads, timeout; on the CPU
    mbit: float  # every host's link, each way
    server_hosts: int = 2  # the shards of the sync_sharded phase, one host each
    phases: tuple[str, ...] = LINK_PHASES  # in LINK_PHASES' order

    def __post_init__(self) -> None:
        if self.server_hosts < 2:
            raise ConfigError(f"--server-hosts must be at least 2, got {self.server_hosts}")
        check_phases(self.phases, LINK_PHASES)

    @property
    def hosts(self) -> int:
        """One per worker, and one per server shard (the leader's is host 0)."""
        return self.train.workers + self.server_hosts

    def label(self, phase: str) -> str:
        return LINK_LABELS[phase].format(K=self.server_hosts)


def describe_link(phase: str, bench: LinkBench) -> str:
    t = bench.train
    servers = bench.server_hosts if phase == "sync_sharded" else 1
    hosts = counted(t.workers, "host")
    where = hosts if phase == "ddp" else f"{servers} server + {hosts}"
    return f"{bench.label(phase)}: {where} on {bench.mbit:g} Mbit/s links, batch {t.batch_size}"


def run_link_phase(phase: str, bench: LinkBench, lab: LinkLab) -> float:
    devices = ["cpu"] * bench.train.workers
    if phase == "ddp":
        return run_ddp(bench.train, devices, lab)
    if phase == "sync_sharded":
        return run_parameter_server(
            "sync", bench.train, devices, num_shards=bench.server_hosts, lab=lab
        )
    overlap, stream = phase != "sync_no_overlap", phase != "sync_no_stream"
    return run_parameter_server(
        "sync", bench.train, devices, overlap=overlap, lab=lab, stream=stream
    )


def summarize_link(
    bench: LinkBench,
    runs: dict[str, list[float]],
    uses: dict[str, list[dict[str, Any]]] | None = None,
    congestion_control: str | None = None,
) -> dict[str, Any]:
    """`uses`: each run's `psserver.bench.linkuse.link_use`, by phase; averaged into
    `link_use` {phase: {"sent", "received"}}. `congestion_control`: the hosts' TCP's."""
    rates = median_rates(runs)
    t = bench.train
    results: dict[str, Any] = {
        "benchmark": "link",
        "link_mbit": bench.mbit,
        "congestion_control": congestion_control,
        "workers": t.workers,
        "server_hosts": bench.server_hosts,
        "model": t.model,
        "batch_size": t.batch_size,
        "steps": t.steps,
        "threads": t.threads,
        "bucket_mb": t.bucket_mb,
        "phases": list(bench.phases),
        "images_per_second": rates,
        "images_per_second_runs": runs,
    }
    if uses:
        results["link_use_runs"] = uses
        results["link_use"] = {
            phase: {way: mean_use(run[way] for run in phase_runs) for way in WAYS}
            for phase, phase_runs in uses.items()
        }
    return without_one_bucket_gains(
        {**results, **ratios(rates, GAINS)}, ("overlap_gain", "streaming_gain")
    )


def mean_use(values: Iterable[float | None]) -> float | None:
    """The mean of the runs' link use that could be measured; None if none could."""
    measured = [value for value in values if value is not None]
    return statistics.fmean(measured) if measured else None


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0%}"


def link_report(bench: LinkBench, results: dict[str, Any]) -> str:
    """The markdown table of images/s against DDP (and, when metered, how busy the links
    were each way), and a line of the gains measured."""
    rates, use = results["images_per_second"], results.get("link_use")
    rows = [
        [bench.label(p), rates[p], rates[p] / rates["ddp"]]
        + ([_percent(use[p]["sent"]), _percent(use[p]["received"])] if use else [])
        for p in bench.phases
    ]
    gains = [
        f"{name.replace('_', ' ')}: "
        + ("n/a (1 bucket)" if results[name] is None else f"{results[name]:.2f}")
        for name in GAINS
        if name in results
    ]
    headers = ["run", "images/s", "vs DDP"] + (["link use out", "link use in"] if use else [])
    lines = [markdown_table(headers, rows)] + (["; ".join(gains)] if gains else [])
    notes = list(results.get("notes", []))
    if use and any(use[p]["sent"] is None for p in bench.phases):
        notes.append(
            "link use n/a: the run's traffic was too short or too light to measure (busy for "
            f"less than {MIN_BUSY_INTERVALS} samples of {SAMPLE_INTERVAL_S:g} s); give it "
            "more --steps"
        )
    return "\n".join(lines + [f"note: {note}" for note in notes])
