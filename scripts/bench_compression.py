"""Accuracy and bytes on the wire of each gradient compression, on real Fashion-MNIST.

Runs `ps-local` once per `--compress` setting with everything else equal, and prints a
markdown table (and writes JSON) of test accuracy, loss, bytes pushed per step and images/s.

    python scripts/bench_compression.py --data-dir /tmp/fmnist --json results/compression.json

DATA_DIR must hold FashionMNIST/raw (copy ../shared/data/FashionMNIST there; it is extracted
on first use, so it must be writable).
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from psserver.bench.report import markdown_table, write_json

SETTINGS = ("none", "fp16", "bf16", "topk:0.1", "topk:0.01")


def run(compress: str, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as scratch:
        summary = Path(scratch) / "summary.json"
        command = [
            sys.executable,
            "-m",
            "psserver.cli.local",
            "--model",
            args.model,
            "--workers",
            "2",
            "--dataset",
            "fashion-mnist",
            "--data-dir",
            str(args.data_dir),
            "--download",
            "--train-limit",
            str(args.train_limit),
            "--epochs",
            str(args.epochs),
            "--batch-size",
            "64",
            "--lr",
            "0.05",
            "--momentum",
            "0.9",
            "--threads",
            "1",
            "--compress",
            compress,
            "--summary",
            str(summary),
            "--log-level",
            "warning",
        ]
        subprocess.run(command, check=True, capture_output=True, timeout=3600)
        return json.loads(summary.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument("--model", default="lenet")
    parser.add_argument("--train-limit", type=int, default=20000)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    rows, results = [], []
    for compress in SETTINGS:
        print(f"training with --compress {compress} ...", file=sys.stderr)
        summary = run(compress, args)
        results.append(
            {
                "compress": compress,
                **{
                    k: summary[k]
                    for k in (
                        "test_accuracy",
                        "test_loss",
                        "push_bytes_per_push",
                        "images_per_second",
                    )
                },
            }
        )
        rows.append(
            [
                compress,
                summary["test_accuracy"],
                summary["test_loss"],
                summary["push_bytes_per_push"] / 1e3,
                summary["images_per_second"],
            ]
        )
    print(
        markdown_table(["compress", "test accuracy", "test loss", "kB per push", "images/s"], rows)
    )
    if args.json is not None:
        write_json(
            args.json,
            {
                "model": args.model,
                "train_limit": args.train_limit,
                "epochs": args.epochs,
                "runs": results,
            },
        )


if __name__ == "__main__":
    main()
