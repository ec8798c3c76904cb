"""The units a worker's push is cut into, in the order overlap sends them: the leader's slice
bucket by bucket (JobSpec.bucket_bounds), or whole when it has one bucket; then each follower
shard's slice bucket by bucket (JobSpec.shard_buckets), also when it has one: a bucket that
comes back streamed is worth sending as a bucket. Each has its range of the flat
gradient, which backward must have finished before the unit can go.

What this is not: sending them (psworker.pusher), nor telling when backward has finished a
range (psworker.overlap).
"""

from typing import Literal, NamedTuple

from common.job import JobSpec
from common.sharding import shard_range


class PushUnit(NamedTuple):
    # "part": one bucket of a shard's slice (a PUSH with that bucket); "whole": the slice in
    # one PUSH (bucket -1).
    kind: Literal["part", "whole"]
    shard: int  # 0: the leader
    bucket: int  # -1: the whole slice
    lo: int  # [lo, hi) of the flat gradient
    hi: int


def push_units(job: JobSpec) -> list[PushUnit]:
    lo, hi = job.shard_range(0)
    units: list[PushUnit] = []
    if job.num_buckets > 1:
        for bucket, (start, end) in enumerate(job.bucket_ranges()):
            units.append(PushUnit("part", 0, bucket, lo + start, lo + end))
    else:
        units.append(PushUnit("whole", 0, -1, lo, hi))
    for shard in range(1, job.num_shards):
        first = shard_range(job.bounds, shard)[0]
        for bucket, (start, end) in enumerate(job.shard_bucket_ranges(shard)):
            units.append(PushUnit("part", shard, bucket, first + start, first + end))
    return units
