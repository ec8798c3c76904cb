"""The training options, shared by `ps-server` and `ps-local` so both accept the same flags."""

from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from common.cli import (
    BucketMegabytes,
    CompressionName,
    DeviceName,
    FiniteFloatRange,
    timeout_seconds,
)
from common.data import DATASETS
from common.job import MODES
from common.model.builtin import MODELS
from common.sharding import MAX_SHARDS
from psserver.config import ServerConfig

PositiveInt = click.IntRange(min=1)

TRAINING_OPTIONS: list[Callable[[Any], Any]] = [
    click.option(
        "--mode",
        type=click.Choice(MODES),
        default="sync",
        show_default=True,
        help="sync: one gradient from every worker per step; async: apply on arrival.",
    ),
    click.option(
        "--workers",
        type=PositiveInt,
        default=2,
        show_default=True,
        help="Number of workers (data shards) the job waits for.",
    ),
    click.option(
        "--model",
        type=click.Choice(sorted(MODELS)),
        default="resnet18",
        show_default=True,
        help="D2L ResNet-18, or the BatchNorm-free LeNet.",
    ),
    click.option(
        "--dataset",
        type=click.Choice(DATASETS),
        default="embedded",
        show_default=True,
        help="embedded: the subset shipped in the package; fashion-mnist: --data-dir.",
    ),
    click.option(
        "--data-dir",
        type=click.Path(file_okay=False, path_type=Path),
        default=None,
        help="Folder holding FashionMNIST/raw (for --dataset fashion-mnist).",
    ),
    click.option(
        "--download/--no-download",
        default=False,
        show_default=True,
        help="Download Fashion-MNIST into --data-dir if it is not there.",
    ),
    click.option(
        "--train-limit",
        type=PositiveInt,
        default=None,
        help="Use only the first N training images.",
    ),
    click.option(
        "--test-limit", type=PositiveInt, default=None, help="Use only the first N test images."
    ),
    click.option(
        "--batch-size",
        type=PositiveInt,
        default=128,
        show_default=True,
        help="Batch size per worker; the global batch is workers x this.",
    ),
    click.option(
        "--lr",
        type=FiniteFloatRange(min=0, min_open=True),
        default=0.1,
        show_default=True,
        help="SGD learning rate.",
    ),
    click.option(
        "--momentum",
        type=FiniteFloatRange(0, 1, max_open=True),
        default=0.0,
        show_default=True,
        help="SGD momentum.",
    ),
    click.option(
        "--weight-decay",
        type=FiniteFloatRange(min=0),
        default=0.0,
        show_default=True,
        help="SGD weight decay.",
    ),
    click.option(
        "--seed",
        type=int,
        default=0,
        show_default=True,
        help="Seed for the initial weights and the data order.",
    ),
    click.option(
        "--epochs",
        type=PositiveInt,
        default=1,
        show_default=True,
        help="Passes over the training set.",
    ),
    click.option(
        "--max-steps",
        type=PositiveInt,
        default=None,
        help="Stop after this many updates, even mid-epoch.",
    ),
    click.option(
        "--checkpoint-dir",
        type=click.Path(file_okay=False, path_type=Path),
        default=None,
        help="Write DIR/latest.pt during and at the end of training.",
    ),
    click.option(
        "--checkpoint-every",
        type=click.IntRange(min=0),
        default=0,
        show_default=True,
        help="Also checkpoint every N steps (0: only at the end); needs --checkpoint-dir.",
    ),
    click.option(
        "--resume/--no-resume",
        default=False,
        show_default=True,
        help="Continue from --checkpoint-dir/latest.pt.",
    ),
    click.option(
        "--resume-from",
        type=click.Path(dir_okay=False, path_type=Path),
        default=None,
        help="Continue from this checkpoint file instead (a DIR/step-N.pt, say); new "
        "checkpoints go to --checkpoint-dir as usual.",
    ),
    click.option(
        "--keep-checkpoints",
        type=click.IntRange(min=0),
        default=0,
        show_default=True,
        help="Also keep the K most recent checkpoints as DIR/step-N.pt, to go back to with "
        "--resume-from (0: only latest.pt and previous.pt).",
    ),
    click.option(
        "--min-workers",
        type=PositiveInt,
        default=1,
        show_default=True,
        help="sync: a step closes with at least this many gradients, and with fewer live "
        "workers the epoch ends early and training pauses until this many are ready. async "
        "and ssp: an epoch after the first begins only once this many workers are ready (the "
        "first waits for --workers); an epoch under way goes on while any worker is left.",
    ),
    click.option(
        "--max-workers",
        type=PositiveInt,
        default=None,
        help="Most workers admitted at once (default: 2 x --workers).",
    ),
    click.option(
        "--step-timeout",
        type=timeout_seconds(),
        default=120.0,
        show_default=True,
        help="sync: close a step after this many seconds with the gradients that came "
        "(async and ssp have no step to close).",
    ),
    click.option(
        "--worker-timeout",
        type=timeout_seconds(),
        default=30.0,
        show_default=True,
        help="Declare a worker dead after this many seconds without a heartbeat.",
    ),
    click.option(
        "--compress",
        type=CompressionName(),
        default="none",
        show_default=True,
        help="Gradient compression on the wire: none, fp16, bf16 or topk:RATIO (e.g. "
        "topk:0.01; the worker keeps what it did not send and adds it to the next step).",
    ),
    click.option(
        "--num-shards",
        type=click.IntRange(1, MAX_SHARDS),
        default=1,
        show_default=True,
        help="Split the parameters over this many server processes (ps-lite style key "
        f"ranges, at most {MAX_SHARDS}); workers push and pull all slices in parallel. "
        "ps-server starts the other K-1 itself unless given --shard.",
    ),
    click.option(
        "--push-credits",
        type=click.IntRange(min=0),
        default=2,
        show_default=True,
        help="Flow control: how many workers may send a gradient at once, which bounds the "
        "server's memory for any number of workers (with K shards, K times as many send "
        "the leader their 1/K slice); 0 turns it off.",
    ),
    click.option(
        "--bucket-mb",
        type=BucketMegabytes(min=0),
        default=None,
        show_default="2 over --num-shards, at least 0.5",
        help="Gradient buckets, in MB of float32 (like DDP's bucket_cap_mb): workers send "
        "each bucket as soon as backward has it (ps-worker --overlap) and the server applies "
        "each as soon as every worker's has come; a tensor of twice this or more is cut into "
        "pieces. Small buckets pay over slow links; 0 makes the gradient one piece, and a "
        "positive size must hold one float32 value (4 bytes, 3.82e-06 MB). Every bucket is a "
        "message per worker and step: thousands of them make each step cost seconds. The "
        "default cuts every shard's slice of ResNet-18 into about 20.",
    ),
    click.option(
        "--stream-weights/--no-stream-weights",
        default=True,
        show_default=True,
        help="Sync mode with buckets: send each updated bucket straight back to the workers "
        "whose parts it summed, so that their next pull carries no parameters.",
    ),
    click.option(
        "--staleness",
        type=click.IntRange(min=0),
        default=2,
        show_default=True,
        help="--mode ssp: a worker may be at most this many steps ahead of the slowest.",
    ),
    click.option(
        "--staleness-lr/--no-staleness-lr",
        default=True,
        show_default=True,
        help="async and ssp: a gradient s versions old counts 1/s: it is scaled before it "
        "enters the momentum (without momentum: a step of lr/s).",
    ),
    click.option(
        "--eval-device",
        type=DeviceName(),
        default="cpu",
        show_default=True,
        help="Where the server evaluates its weights on the test set.",
    ),
    click.option(
        "--log-dir",
        type=click.Path(file_okay=False, path_type=Path),
        default=None,
        help="Write per-step metrics to DIR/server.jsonl and TensorBoard events to DIR/tb "
        "(ps-local: the workers' too); plot them with ps-plot DIR.",
    ),
]


# Options that some modes do not read: (the modes that do, what the option does there). They
# used to be accepted and ignored without a word; given to another mode, the server says so.
MODE_ONLY_OPTIONS: dict[str, tuple[tuple[str, ...], str]] = {
    "staleness": (("ssp",), "bounds how far ahead a worker may run in --mode ssp only"),
    "staleness_lr": (
        ("async", "ssp"),
        "scales a stale gradient's step, and only --mode async and ssp apply stale gradients",
    ),
    "step_timeout": (
        ("sync",),
        "closes a --mode sync step that waits for a gradient (async and ssp apply each one "
        "as it comes, with no step to wait for)",
    ),
    "stream_weights": (
        ("sync",),
        "streams the buckets of a --mode sync step back as they are applied (async and ssp "
        "send weights only when a worker pulls)",
    ),
}


def ignored_by_mode(given: list[str], mode: str) -> list[tuple[str, str]]:
    """(option, what it does) for each option in `given` (names as in the config) that a
    job of `mode` does not read."""
    ignored = []
    for name in given:
        modes, purpose = MODE_ONLY_OPTIONS.get(name, ((mode,), ""))
        if mode not in modes:
            ignored.append((name, purpose))
    return ignored


def training_options(func: Callable[..., Any]) -> Callable[..., Any]:
    for option in reversed(TRAINING_OPTIONS):
        func = option(func)
    return func


def config_from_options(**options: Any) -> ServerConfig:
    return ServerConfig(**options)
