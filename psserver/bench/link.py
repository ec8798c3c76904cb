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
- `sync_2_shards`: sync with overlap on 2 server shards, each on a host of its own, so that
  the servers' links carry half the bytes each;
- `ddp`: PyTorch DDP over the same links (its ranks on the workers' hosts; it overlaps its
  all-reduce with backward too).

`overlap_gain` is sync over sync_no_overlap, `streaming_gain` sync over sync_no_stream. The
hosts still share this machine's CPU cores.
Needs root, `ip` and `tc`.
"""

import dataclasses
from typing import Any

from psserver.bench.netns import LinkLab
from psserver.bench.train import TrainBench, median_rates, run_ddp, run_parameter_server

LINK_PHASES = ("sync", "sync_no_stream", "sync_no_overlap", "sync_2_shards", "ddp")
LINK_LABELS = {
    "sync": "ps sync, overlap",
    "sync_no_stream": "ps sync, overlap, weights not streamed",
    "sync_no_overlap": "ps sync, no overlap",
    "sync_2_shards": "ps sync, overlap, 2 server hosts",
    "ddp": "pytorch ddp",
}


@dataclasses.dataclass(frozen=True)
class LinkBench:
    train: TrainBench  # workers, model, batch, steps, threads, timeout; on the CPU
    mbit: float  # every host's link, each way

    @property
    def hosts(self) -> int:
        """The server's, one per worker, and the second shard's."""
        return self.train.workers + 2


def describe_link(phase: str, bench: LinkBench) -> str:
    t = bench.train
    servers = 2 if phase == "sync_2_shards" else 1
    where = f"{t.workers} hosts" if phase == "ddp" else f"{servers} server + {t.workers} hosts"
    return f"{LINK_LABELS[phase]}: {where} on {bench.mbit:g} Mbit/s links, batch {t.batch_size}"


def run_link_phase(phase: str, bench: LinkBench, lab: LinkLab) -> float:
    devices = ["cpu"] * bench.train.workers
    if phase == "ddp":
        return run_ddp(bench.train, devices, lab)
    if phase == "sync_2_shards":
        return run_parameter_server("sync", bench.train, devices, num_shards=2, lab=lab)
    overlap, stream = phase != "sync_no_overlap", phase != "sync_no_stream"
    return run_parameter_server(
        "sync", bench.train, devices, overlap=overlap, lab=lab, stream=stream
    )


def summarize_link(bench: LinkBench, runs: dict[str, list[float]]) -> dict[str, Any]:
    rates = median_rates(runs)
    t = bench.train
    return {
        "benchmark": "link",
        "link_mbit": bench.mbit,
        "workers": t.workers,
        "model": t.model,
        "batch_size": t.batch_size,
        "steps": t.steps,
        "threads": t.threads,
        "bucket_mb": t.bucket_mb,
        "images_per_second": rates,
        "images_per_second_runs": runs,
        "overlap_gain": rates["sync"] / rates["sync_no_overlap"],
        "streaming_gain": rates["sync"] / rates["sync_no_stream"],
        "sync_over_ddp": rates["sync"] / rates["ddp"],
        "sync_no_overlap_over_ddp": rates["sync_no_overlap"] / rates["ddp"],
        "sync_2_shards_over_ddp": rates["sync_2_shards"] / rates["ddp"],
    }
