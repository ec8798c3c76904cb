"""What `ps-bench train` measures: its phases and their labels, and its settings
(`TrainBench`, validated once).

What this is not: running a phase (psserver.bench.train, .trainps, .baselines), nor the
record of the runs (psserver.bench.trainreport).
"""

import dataclasses

from common.assignment import steps_per_epoch
from common.catalog import MODEL_NAMES, load_training_set
from common.data import DataSource
from common.errors import ConfigError
from common.logs import counted
from psserver.bench.options import PhasesError, check_phases
from psserver.cli.devices import worker_devices
from psserver.status.report import WARMUP_STEPS

TIMEOUT_HINT = "raise --timeout or lower --steps"

PHASES = ("sync", "sync_no_overlap", "async", "single_process", "ddp", "compute_bound")
SHARDED_PHASES = ("sync_sharded", "sync_sharded_no_overlap")
LABELS = {
    "sync": "ps sync",
    "sync_no_overlap": "ps sync, no overlap",
    "async": "ps async",
    "single_process": "single process",
    "ddp": "pytorch ddp",
    "compute_bound": "compute bound (ranks apart)",
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
        if self.model not in MODEL_NAMES:
            raise ConfigError(f"--model must be one of {list(MODEL_NAMES)}, got {self.model!r}")
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
        train_size = len(load_training_set(DataSource()))
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
            f"--steps {self.steps} crosses an epoch's end ({counted(per_epoch, 'step')} of "
            f"{self.workers} x {self.batch_size}): the server's evaluation there falls inside "
            f"the parameter server's timed steps; {advice} avoids it"
        )

    def devices(self) -> list[str]:
        """One device per worker / DDP rank: one GPU each if there are enough, else the CPU."""
        return worker_devices(self.workers, self.device)
