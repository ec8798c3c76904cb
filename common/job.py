"""The job description the server sends to every worker when it registers.

The server is the single source of truth for what is trained and how the data is split; a
worker only chooses its device and where its copy of the data lives.
"""

import dataclasses
from typing import Any

from common.errors import ProtocolError

MODES = ("sync", "async", "ssp")


@dataclasses.dataclass(frozen=True)
class JobSpec:
    mode: str  # "sync" or "async"
    model: str  # a name from common.models.MODELS
    dataset: str  # a name from common.data.DATASETS
    world_size: int  # number of data shards (= workers the job waits for)
    batch_size: int  # per worker
    seed: int  # for initial weights and the per-epoch data permutations
    train_limit: int | None  # first N training samples, or None for all
    train_size: int  # samples in the (limited) training set; workers check theirs matches
    steps_per_epoch: int  # batches in one shard per epoch
    epochs: int  # passes over the data the job is configured for
    max_steps: int | None  # cap on updates, or None
    num_params: int  # length of the flat parameter vector
    num_buffers: int  # length of the flat floating-point buffer vector
    compress: str  # gradient compression on the wire: none, fp16, bf16 or topk:RATIO

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ProtocolError(f"job mode must be one of {MODES}, got {self.mode!r}")
        for name in ("world_size", "batch_size", "train_size", "steps_per_epoch", "num_params"):
            if getattr(self, name) <= 0:
                raise ProtocolError(f"job {name} must be positive, got {getattr(self, name)}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "JobSpec":
        names = {f.name for f in dataclasses.fields(cls)}
        if set(raw) != names:
            raise ProtocolError(f"job must have fields {sorted(names)}, got {sorted(raw)}")
        try:
            return cls(**raw)
        except TypeError as exc:
            raise ProtocolError(f"malformed job description: {exc}") from None
