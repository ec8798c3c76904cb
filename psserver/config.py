"""The server's configuration: built from the command line, validated once, then passed down."""

import dataclasses
import math
import os
from pathlib import Path
from typing import Any

from common.assignment import sample_assignment
from common.catalog import DATASET_NAMES, MODEL_NAMES
from common.compression import CompressionSpec
from common.data import DataSource
from common.device import check_device
from common.errors import ConfigError, DeviceError
from common.job import MODES, JobSpec
from common.sharding import MAX_SHARDS, bucket_numel_of, too_small_bucket
from common.wire.endpoints import check_endpoint
from psserver.checkpoints.files import LATEST, PREVIOUS
from psserver.checkpoints.kept_steps import kept_checkpoints

# Gradient buckets when --bucket-mb is not given: this many MB over the number of shards, so
# that every shard's slice is cut into about 20 buckets (ResNet-18, up to 4 shards). A
# server sends a bucket back once every worker's part of it is in, so over a slow link the
# weights start back, and finish, about a bucket's share of the transfer after the
# gradients: 20 buckets make that 5 %. With 4 shards over 100 Mbit/s links, 0.5 MB buckets
# gave 0.95 to 1.07 of DDP where 2 MB ones gave 0.82 (BENCHMARKS.md); at 1 Gbit/s and
# over loopback smaller buckets cost nothing measurable.
DEFAULT_BUCKET_MB = 2.0
MIN_DEFAULT_BUCKET_MB = 0.5  # 0.25 MB did no better at 4 shards over 100 Mbit/s


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    bind: str = "tcp://127.0.0.1:5555"
    mode: str = "sync"
    workers: int = 1
    model: str = "resnet18"
    dataset: str = "embedded"
    data_dir: Path | None = None
    download: bool = False
    train_limit: int | None = None
    test_limit: int | None = None
    batch_size: int = 128
    lr: float = 0.1
    momentum: float = 0.0
    weight_decay: float = 0.0
    seed: int = 0
    epochs: int = 1
    max_steps: int | None = None
    checkpoint_dir: Path | None = None
    checkpoint_every: int = 0
    resume: bool = False
    resume_from: Path | None = None  # a checkpoint file to go on from, not DIR/latest.pt
    keep_checkpoints: int = 0  # also keep this many as DIR/step-N.pt
    summary: Path | None = None
    eval_device: str = "cpu"
    threads: int | None = None
    stop_grace: float = 10.0
    linger: float = 0.0  # after the summary, answer late workers with STOP this long
    endpoint_file: Path | None = None
    min_workers: int = 1
    max_workers: int | None = None
    step_timeout: float = 120.0
    worker_timeout: float = 30.0
    compress: str = "none"
    staleness: int = 2
    staleness_lr: bool = True
    log_dir: Path | None = None  # per-step metrics: DIR/server.jsonl and DIR/tb/server
    metrics_port: int | None = None  # serve Prometheus metrics on this TCP port
    num_shards: int = 1  # server shards: this server (the leader) and num_shards - 1 followers
    push_credits: int = 2  # workers allowed to send a gradient at once; 0: no flow control
    # Gradient buckets the server applies one by one; 0: one bucket; None: bucket_size_mb.
    bucket_mb: float | None = None
    stream_weights: bool = True  # sync: updated buckets go back as soon as they are applied

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):  # nan passes every comparison below
            value = getattr(self, field.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(
                    f"--{field.name.replace('_', '-')} must be a finite number, got {value}"
                )
        if self.mode not in MODES:
            raise ConfigError(f"--mode must be one of {MODES}, got {self.mode!r}")
        if self.model not in MODEL_NAMES:
            raise ConfigError(f"--model must be one of {list(MODEL_NAMES)}, got {self.model!r}")
        if self.dataset not in DATASET_NAMES:
            raise ConfigError(f"--dataset must be one of {DATASET_NAMES}, got {self.dataset!r}")
        if self.dataset == "embedded" and (self.data_dir is not None or self.download):
            given = "--data-dir" if self.data_dir is not None else "--download"
            raise ConfigError(
                f"{given} is read only with --dataset fashion-mnist; add that to train on the "
                "files there, or leave out --data-dir and --download to use the embedded set"
            )
        positive = {"workers": self.workers, "batch_size": self.batch_size, "epochs": self.epochs}
        for name, value in positive.items():
            if value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
        for name in ("train_limit", "test_limit", "max_steps", "threads"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
        if self.min_workers < 1 or self.min_workers > self.workers:
            raise ConfigError(
                f"--min-workers must be between 1 and --workers ({self.workers}), "
                f"got {self.min_workers}"
            )
        if self.max_workers is not None and self.max_workers < self.workers:
            raise ConfigError(
                f"--max-workers ({self.max_workers}) must be at least --workers ({self.workers})"
            )
        if self.step_timeout <= 0 or self.worker_timeout <= 0:
            raise ConfigError("--step-timeout and --worker-timeout must be positive")
        CompressionSpec.parse(self.compress)  # raises a ConfigError that names the option
        if self.staleness < 0:
            raise ConfigError(f"--staleness must be >= 0, got {self.staleness}")
        if self.lr <= 0:
            raise ConfigError(f"--lr must be positive, got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"--momentum must be in [0, 1), got {self.momentum}")
        if self.weight_decay < 0:
            raise ConfigError(f"--weight-decay must be >= 0, got {self.weight_decay}")
        if self.metrics_port is not None and not 1 <= self.metrics_port <= 65535:
            raise ConfigError(f"--metrics-port must be in 1..65535, got {self.metrics_port}")
        if self.push_credits < 0:
            raise ConfigError(f"--push-credits must be >= 0, got {self.push_credits}")
        if self.bucket_mb is not None and self.bucket_mb < 0:
            raise ConfigError(f"--bucket-mb must be >= 0, got {self.bucket_mb}")
        if self.bucket_mb is not None and (reason := too_small_bucket(self.bucket_mb)):
            raise ConfigError(f"--bucket-mb {reason}")
        if not 1 <= self.num_shards <= MAX_SHARDS:
            raise ConfigError(f"--num-shards must be in 1..{MAX_SHARDS}, got {self.num_shards}")
        for flag, count, purpose in (
            ("--checkpoint-every", self.checkpoint_every, "write the checkpoints in"),
            ("--keep-checkpoints", self.keep_checkpoints, "keep them in"),
        ):
            if count < 0:
                raise ConfigError(f"{flag} must be >= 0, got {count}")
            if count and self.checkpoint_dir is None:
                raise ConfigError(f"{flag} {count} needs --checkpoint-dir DIR to {purpose}")
        if self.resume and self.resume_from is not None:
            raise ConfigError(
                "give --resume (go on from --checkpoint-dir's latest.pt) or --resume-from FILE "
                "(go on from FILE), not both"
            )
        if self.resume and self.checkpoint_dir is None:
            raise ConfigError("--resume needs --checkpoint-dir DIR to find DIR/latest.pt")
        if not self.bind.startswith(("tcp://", "ipc://", "inproc://")):
            raise ConfigError(
                f"--bind must be a ZeroMQ endpoint like tcp://0.0.0.0:5555, got {self.bind!r}"
            )
        check_endpoint(self.bind, "--bind", bind=True)
        self.data_source()  # validates dataset/data-dir combinations
        try:  # now, not at the first evaluation, hours of training later
            check_device(self.eval_device, f"--eval-device {self.eval_device}", "--eval-device")
        except DeviceError as exc:
            raise ConfigError(str(exc)) from None
        for path, flag in ((self.summary, "--summary"), (self.endpoint_file, "--endpoint-file")):
            if path is not None:
                check_writable_file(path, flag)
        if self.resume_from is not None and not self.resume_from.is_file():
            raise ConfigError(
                f"--resume-from {self.resume_from}: no such file; give a checkpoint file, such "
                "as DIR/latest.pt or a DIR/step-N.pt that --keep-checkpoints kept"
            )
        if self.checkpoint_dir is not None:  # now, not after the whole run has trained
            check_writable_folder(self.checkpoint_dir, "--checkpoint-dir")
            if not self.resuming:
                refuse_to_start_over(self.checkpoint_dir)

    @property
    def resuming(self) -> bool:
        """The run goes on from a checkpoint: --resume or --resume-from."""
        return self.resume or self.resume_from is not None

    @property
    def worker_limit(self) -> int:
        """Workers admitted at once: --max-workers, or by default twice --workers."""
        return self.max_workers if self.max_workers is not None else 2 * self.workers

    @property
    def heartbeat_interval(self) -> float:
        # Several heartbeats fit in one timeout, so one lost packet never kills a worker.
        return min(5.0, max(0.1, self.worker_timeout / 6))

    def data_source(self) -> DataSource:
        try:
            return DataSource(self.dataset, self.data_dir, self.download)
        except Exception as exc:
            raise ConfigError(str(exc)) from None

    def job_spec(
        self,
        train_size: int,
        num_params: int,
        num_buffers: int,
        shard_bounds: tuple[int, ...],
        bucket_bounds: tuple[int, ...],
        slice_bucket_bounds: tuple[tuple[int, ...], ...] = (),
    ) -> JobSpec:
        """The job as workers see it (shard endpoints are added once the shards join)."""
        return JobSpec(
            mode=self.mode,
            model=self.model,
            dataset=self.dataset,
            world_size=self.workers,
            batch_size=self.batch_size,
            seed=self.seed,
            train_limit=self.train_limit,
            train_size=train_size,
            steps_per_epoch=sample_assignment(train_size, self.batch_size, self.seed).steps(
                self.workers
            ),
            epochs=self.epochs,
            max_steps=self.max_steps,
            num_params=num_params,
            num_buffers=num_buffers,
            compress=self.compress,
            push_credits=self.push_credits,
            shard_bounds=shard_bounds if self.num_shards > 1 else (),
            bucket_bounds=bucket_bounds if len(bucket_bounds) > 2 else (),
            slice_bucket_bounds=slice_bucket_bounds if self.num_shards > 1 else (),
        )

    @property
    def bucket_size_mb(self) -> float:
        """--bucket-mb, or by default DEFAULT_BUCKET_MB over the shards (at least 0.5 MB)."""
        if self.bucket_mb is not None:
            return self.bucket_mb
        return max(MIN_DEFAULT_BUCKET_MB, DEFAULT_BUCKET_MB / self.num_shards)

    @property
    def bucket_numel(self) -> int:
        """The bucket size in float32 values."""
        return bucket_numel_of(self.bucket_size_mb)

    def to_dict(self) -> dict[str, Any]:
        return {
            key: str(value) if isinstance(value, Path) else value
            for key, value in dataclasses.asdict(self).items()
        }


def nearest_existing(path: Path) -> Path:
    """`path`, or its nearest ancestor that exists: where it would be made."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_writable_folder(path: Path, flag: str) -> None:
    """The folder exists and is writable, or can be made: its nearest existing ancestor is a
    writable folder."""
    folder = nearest_existing(path)
    if not folder.is_dir() or not os.access(folder, os.W_OK):
        if folder != path:
            where = f"{folder} is not a writable folder"
        else:  # a read-only folder (a read-only mount) is no less a folder
            where = "it is not writable" if folder.is_dir() else "it is not a folder"
        raise ConfigError(f"{flag} {path}: cannot write checkpoints there ({where})")


def refuse_to_start_over(directory: Path) -> None:
    """A run started without --resume would replace the checkpoints of an earlier one, within
    two checkpoints and without a word (a restart after a crash that forgot --resume)."""
    found = [name for name in (LATEST, PREVIOUS) if (directory / name).is_file()]
    if kept := kept_checkpoints(directory):
        found.append(f"{len(kept)} kept step-N.pt")
    if found:
        raise ConfigError(
            f"--checkpoint-dir {directory} already holds {' and '.join(found)} of an earlier "
            "run: add --resume to go on from it (or --resume-from FILE, from another), or use "
            "another --checkpoint-dir (or delete those files) to start over"
        )


def check_writable_file(path: Path, flag: str) -> None:
    """The file can be made: its nearest existing folder is a folder, and writable."""
    folder = nearest_existing(path.parent)
    if path.is_dir() or not folder.is_dir() or not os.access(folder, os.W_OK):
        raise ConfigError(
            f"{flag} {path}: cannot write a file there ({folder} is not a writable folder)"
        )
