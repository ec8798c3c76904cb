"""The job description the server sends to every worker when it registers.

The server is the single source of truth for what is trained and how the data is split; a
worker only chooses its device and where its copy of the data lives.
"""

import dataclasses
import itertools
from collections.abc import Callable
from typing import Any

from common.errors import ProtocolError
from common.logs import counted
from common.sharding import shard_range

MODES = ("sync", "async", "ssp")


@dataclasses.dataclass(frozen=True)
class JobSpec:
    mode: str  # "sync" or "async"
    model: str  # a name from common.catalog.MODEL_NAMES
    dataset: str  # a name from common.catalog.DATASET_NAMES
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
    # Server sharding: K + 1 offsets cutting the parameters into K ranges (see
    # common.sharding.shard_range for which shard owns which). Shard 0 is the server the worker
    # registered with; shard i >= 1 listens at shard_endpoints[i - 1]. Empty bounds mean one
    # server owning everything.
    shard_bounds: tuple[int, ...] = ()
    shard_endpoints: tuple[str, ...] = ()
    # Flow control: above 0, ask with PUSH_READY and wait for the go (a PUSH_ACK) before a PUSH.
    push_credits: int = 0
    # Gradient buckets within the leader's slice: offsets from its start, rising from 0 to its
    # length (see common.sharding.bucket_bounds). With more than one, a worker may send its
    # gradient bucket by bucket (a PUSH per bucket) while backward runs. Empty: one bucket.
    bucket_bounds: tuple[int, ...] = ()
    # The same for each follower shard's slice (shard i at index i - 1): with more than one
    # bucket, a worker sends its slice bucket by bucket (a PUSH per bucket) and
    # the follower applies and streams back each bucket on its own. Empty: one bucket each.
    slice_bucket_bounds: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        self._check_types()
        if self.mode not in MODES:
            raise ProtocolError(f"job mode must be one of {MODES}, got {self.mode!r}")
        for name in ("world_size", "batch_size", "train_size", "steps_per_epoch", "num_params"):
            if getattr(self, name) <= 0:
                raise ProtocolError(f"job {name} must be positive, got {getattr(self, name)}")
        # msgpack turns tuples into lists; a frozen dataclass keeps tuples.
        object.__setattr__(self, "shard_bounds", tuple(self.shard_bounds))
        object.__setattr__(self, "shard_endpoints", tuple(self.shard_endpoints))
        object.__setattr__(self, "bucket_bounds", tuple(self.bucket_bounds))
        object.__setattr__(
            self, "slice_bucket_bounds", tuple(tuple(b) for b in self.slice_bucket_bounds)
        )
        bounds = self.bounds
        ordered = all(a <= b for a, b in itertools.pairwise(bounds))
        if bounds[0] != 0 or bounds[-1] != self.num_params or not ordered:
            raise ProtocolError(
                f"job shard_bounds must rise from 0 to {self.num_params}, got {list(bounds)}"
            )
        if self.slice_bucket_bounds and len(self.slice_bucket_bounds) != self.num_shards - 1:
            raise ProtocolError(
                f"job lists {counted(len(self.slice_bucket_bounds), 'follower bucket layout')}"
                f" for {counted(self.num_shards, 'shard')}; expected one per shard after the first"
            )
        for shard in range(self.num_shards):
            lo, hi = self.shard_range(shard)
            buckets = self.shard_buckets(shard)
            if (
                buckets[0] != 0
                or buckets[-1] != hi - lo
                or not all(a < b for a, b in itertools.pairwise(buckets))
            ):
                name = "bucket_bounds" if shard == 0 else f"slice_bucket_bounds[{shard - 1}]"
                raise ProtocolError(
                    f"job {name} must rise strictly from 0 to {hi - lo}, got {list(buckets)}"
                )
        # No endpoints: the leader has not heard from its shards yet (workers never see that).
        if self.shard_endpoints and len(self.shard_endpoints) != self.num_shards - 1:
            raise ProtocolError(
                f"job lists {counted(len(self.shard_endpoints), 'shard endpoint')} for "
                f"{counted(self.num_shards, 'shard')}; expected one per shard after the first"
            )

    def _check_types(self) -> None:
        """Every field has its annotated type: a WELCOME is data from the network, and a
        float batch size or a string step limit would fail deep inside training."""
        for name, (kind, fits) in FIELD_CHECKS.items():
            value = getattr(self, name)
            if not fits(value):
                raise ProtocolError(f"job {name} must be {kind}, got {value!r:.80}")

    @property
    def bounds(self) -> tuple[int, ...]:
        """Slice offsets, K + 1 of them; (0, num_params) when the server is not sharded."""
        return self.shard_bounds or (0, self.num_params)

    def shard_range(self, shard: int) -> tuple[int, int]:
        return shard_range(self.bounds, shard)

    @property
    def buckets(self) -> tuple[int, ...]:
        """Bucket offsets within the leader's slice; (0, its length) for one bucket."""
        return self.shard_buckets(0)

    def shard_buckets(self, shard: int) -> tuple[int, ...]:
        """Bucket offsets within a shard's slice; (0, its length) for one bucket."""
        lo, hi = self.shard_range(shard)
        if shard == 0:
            return self.bucket_bounds or (0, hi - lo)
        return self.slice_bucket_bounds[shard - 1] if self.slice_bucket_bounds else (0, hi - lo)

    def shard_bucket_ranges(self, shard: int) -> list[tuple[int, int]]:
        """[lo, hi) of every bucket of a shard's slice, from the slice's start, in order."""
        cuts = self.shard_buckets(shard)
        return list(itertools.pairwise(cuts))

    @property
    def num_buckets(self) -> int:
        return len(self.buckets) - 1

    def bucket_range(self, bucket: int) -> tuple[int, int]:
        """[lo, hi) of a bucket within the leader's slice."""
        return self.buckets[bucket], self.buckets[bucket + 1]

    def bucket_ranges(self) -> list[tuple[int, int]]:
        """[lo, hi) of every bucket, in order."""
        return [self.bucket_range(b) for b in range(self.num_buckets)]

    @property
    def num_shards(self) -> int:
        return len(self.bounds) - 1

    @property
    def sparse(self) -> bool:
        """Gradients travel as top-k values and indices rather than dense vectors."""
        return self.compress.startswith("topk")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "JobSpec":
        names = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(raw, dict) or set(raw) != names:
            raise ProtocolError(f"job must have fields {sorted(names)}, got {sorted(raw)}")
        try:
            return cls(**raw)
        except (TypeError, ValueError) as exc:
            raise ProtocolError(f"malformed job description: {exc}") from None


def _is_str(value: Any) -> bool:
    return isinstance(value, str)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_list_of(value: Any, fits: Callable[[Any], bool]) -> bool:
    return isinstance(value, (list, tuple)) and all(fits(item) for item in value)


def _ints(value: Any) -> bool:
    return _is_list_of(value, _is_int)


# The check for each annotation a JobSpec field has (msgpack sends tuples as lists). Derived
# from the fields, so a new field is checked too; a field of a new type fails at import.
TYPE_CHECKS: dict[Any, tuple[str, Callable[[Any], bool]]] = {
    str: ("a string", _is_str),
    int: ("an integer", _is_int),
    int | None: ("an integer or null", lambda value: value is None or _is_int(value)),
    tuple[int, ...]: ("a list of integers", _ints),
    tuple[str, ...]: ("a list of strings", lambda value: _is_list_of(value, _is_str)),
    tuple[tuple[int, ...], ...]: (
        "a list of lists of integers",
        lambda value: _is_list_of(value, _ints),
    ),
}
FIELD_CHECKS = {field.name: TYPE_CHECKS[field.type] for field in dataclasses.fields(JobSpec)}
