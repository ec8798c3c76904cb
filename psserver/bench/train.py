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
- `compute_bound`: the same N ranks, each training its own copy with no all-reduce at all
  (`psserver.bench.ddp rank --no-sync`). No data-parallel run on these processes and threads
  can be faster, so `compute_bound_over_ddp` is the most any system could gain over DDP
  here, overlap or not; when it is near 1, communication is a small part of DDP's step.
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

What this is not: a measure of convergence (see the summary's test accuracy for that), nor of
communication alone (that is `ps-bench comm`).

Its settings are psserver.bench.trainbench's, its parameter-server runs .trainps's, its
PyTorch runs .baselines', and its record .trainreport's; this module says what each phase
runs and runs it.
"""

from common.logs import counted
from psserver.bench.baselines import run_ddp, run_single_process
from psserver.bench.trainbench import LABELS, SHARDED_PHASES, TrainBench
from psserver.bench.trainps import run_parameter_server


def describe(phase: str, bench: TrainBench, devices: list[str]) -> str:
    where = devices[0] if len(set(devices)) == 1 else f"{devices[0]}..{devices[-1]}"
    n, b, t = bench.workers, bench.batch_size, bench.threads
    if phase in ("sync", "sync_no_overlap", "async", *SHARDED_PHASES):
        steps = bench.steps if phase != "async" else n * bench.steps
        servers = f"{bench.num_shards} server shards" if phase in SHARDED_PHASES else "ps-server"
        return (
            f"{LABELS[phase]}: {servers} + {counted(n, 'ps-worker')} on {where}, {steps} updates "
            f"of batch {b}, {counted(t, 'thread')} each"
        )
    if phase == "single_process":
        return (
            f"{LABELS[phase]}: batch {n * b} on {devices[0]}, {counted(n * t, 'thread')}, "
            f"{counted(bench.steps, 'step')}"
        )
    apart = ", no communication" if phase == "compute_bound" else ""
    ranks = counted(n, "rank")
    return f"{LABELS[phase]}: {ranks} of batch {b} on {where}, {counted(t, 'thread')} each{apart}"


def run_phase(phase: str, bench: TrainBench, devices: list[str]) -> float:
    """Run one phase and return its images per second."""
    if phase in ("sync", "async"):
        return run_parameter_server(phase, bench, devices)
    if phase == "sync_no_overlap":
        return run_parameter_server("sync", bench, devices, overlap=False)
    if phase in SHARDED_PHASES:
        overlap = phase == "sync_sharded"
        return run_parameter_server("sync", bench, devices, bench.num_shards, overlap)
    if phase == "single_process":
        return run_single_process(bench, devices[0])
    if phase in ("ddp", "compute_bound"):
        return run_ddp(bench, devices, sync=phase == "ddp")
    raise ValueError(f"unknown phase {phase!r}")
