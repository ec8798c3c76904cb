"""The server's SGD step over ResNet-18's flat parameters: separate ops against the fused kernel.

FlatSGD (psserver/store/optimizer.py) steps the bulk of each range through torch's fused CPU SGD
kernel, and falls back to four separate ops (weight decay, momentum, momentum add, update)
where the kernel does not round as the ops do. This times both on the same vectors, taking
turns, for the whole vector and for the server's default gradient buckets, and prints a
markdown table (and writes JSON).

    python scripts/bench_optimizer.py --repeat 20 --json benchmarks/optimizer-resnet18.json
"""

import argparse
import itertools
import statistics
import time
from pathlib import Path

import torch

from common.catalog import build_model
from common.sharding import bucket_bounds
from psserver.bench.report import markdown_table, write_json
from psserver.store.optimizer import FlatSGD, SGDSettings


def time_steps(sgd: FlatSGD, ranges: list[tuple[int, int]]) -> float:
    """Milliseconds for one step over every range (the last one first, as buckets go)."""
    started = time.perf_counter()
    for lo, hi in reversed(ranges):
        sgd.step(lo, hi)
    return (time.perf_counter() - started) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=20, help="Timed steps of each kind.")
    parser.add_argument("--bucket-mb", type=float, default=8.0, help="The server's buckets.")
    parser.add_argument("--json", type=Path, help="Write the results here.")
    args = parser.parse_args()
    torch.set_num_threads(1)  # as ps-bench runs the server
    with torch.device("meta"):
        sizes = [p.numel() for p in build_model("resnet18").parameters()]
    n = sum(sizes)
    cuts = bucket_bounds(sizes, 0, n, int(args.bucket_mb * 1e6 / 4))
    layouts = {"whole vector": [(0, n)], f"{len(cuts) - 1} buckets": list(itertools.pairwise(cuts))}
    settings = SGDSettings(lr=0.1, momentum=0.9, weight_decay=5e-4)
    params, grads = torch.randn(n), torch.randn(n)
    optimizers = {
        fused: FlatSGD(params, grads, settings, allow_fused=fused) for fused in (False, True)
    }
    agrees = optimizers[True].fused
    rows, results = [], []
    for layout, ranges in layouts.items():
        times: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(args.repeat + 1):  # the first of each is a warm-up
            for fused in (False, True):
                times[fused].append(time_steps(optimizers[fused], ranges))
        ops_ms, fused_ms = (statistics.median(times[f][1:]) for f in (False, True))
        rows.append([layout, ops_ms, fused_ms, ops_ms / fused_ms])
        results.append({"layout": layout, "ops_ms": ops_ms, "fused_ms": fused_ms})
    print(f"SGD step, momentum 0.9, weight decay 5e-4, {n:,} values, 1 thread")
    print(f"fused kernel agrees with the ops here: {agrees}")
    print(markdown_table(["ranges", "ops ms", "fused ms", "speed-up"], rows))
    if args.json:
        write_json(args.json, {"numel": n, "fused_agrees": agrees, "runs": results})


if __name__ == "__main__":
    main()
