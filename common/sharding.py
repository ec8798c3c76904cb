"""How the flat parameter vector is cut into server shards, and how a gradient is cut to match.

Like ps-lite's key ranges, shard i owns one contiguous range of the flat vector; the ranges
are as equal as integer division allows, so every shard moves and updates the same number of
bytes. A range may split a tensor in two: shards see only floats, never layers.
"""

import itertools

import torch

from common.logs import counted

# The most shards one job may have. Each is a process with its own socket; past a few dozen
# a slice is too small for the per-message cost to pay, and the launcher would start
# hundreds of processes on one host.
MAX_SHARDS = 64

# --bucket-mb counts MiB of float32 values. A positive size under one value (4 bytes) used to
# round to 0, which means one bucket: --bucket-mb 1e-9 silently became the opposite of what
# it asked for.
BUCKET_MB_BYTES = 2**20
SMALLEST_BUCKET_MB = 3.82e-06  # 4 bytes (4 / 2**20 = 3.8147e-06), rounded up so that it holds


def bucket_numel_of(bucket_mb: float) -> int:
    """A bucket size in MB as a count of float32 values (0: one bucket)."""
    return int(bucket_mb * BUCKET_MB_BYTES) // 4


def too_small_bucket(bucket_mb: float, zero_allowed: bool = True) -> str | None:
    """Why a positive --bucket-mb cannot be used, or None when it can."""
    if bucket_mb > 0 and bucket_numel_of(bucket_mb) == 0:
        zero = ", or 0 for the whole gradient as one bucket" if zero_allowed else ""
        return (
            f"{bucket_mb:g} MB is less than one float32 value (4 bytes): give at least "
            f"{SMALLEST_BUCKET_MB:g} (4 bytes){zero}"
        )
    return None


def shard_bounds(num_params: int, num_shards: int) -> tuple[int, ...]:
    """K + 1 offsets cutting the vector into K ranges; see `shard_range` for who owns which."""
    if not 1 <= num_shards <= num_params:
        raise ValueError(
            f"cannot cut {counted(num_params, 'parameter')} into {counted(num_shards, 'shard')}"
        )
    return tuple(i * num_params // num_shards for i in range(num_shards + 1))


def shard_range(bounds: tuple[int, ...], shard: int) -> tuple[int, int]:
    """The [lo, hi) that shard `shard` owns.

    The leader (shard 0) owns the *last* range and follower i the i-th from the start. The
    flat vector follows model.parameters(), so the last range holds the last layers, whose
    gradients backward produces first: the leader's push, which carries the step's
    bookkeeping, can leave while backward still works on the first layers (see overlap in
    psworker.pusher)."""
    num_shards = len(bounds) - 1
    index = num_shards - 1 if shard == 0 else shard - 1
    return bounds[index], bounds[index + 1]


def split_gradient(
    values: torch.Tensor, indices: torch.Tensor, bounds: tuple[int, ...], sparse: bool
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (values, indices) pair per shard (in shard order), indices relative to the start
    of the shard's range.

    A dense gradient is cut into views (no copy); a top-k gradient's entries are sorted into
    the shard whose range holds their position.
    """
    if len(bounds) == 2:
        return [(values, indices)]
    pieces = []
    for shard in range(len(bounds) - 1):
        lo, hi = shard_range(bounds, shard)
        if not sparse:
            pieces.append((values[lo:hi], indices))
            continue
        inside = (indices >= lo) & (indices < hi)  # (k,)
        pieces.append((values[inside], (indices[inside] - lo).to(torch.int32)))
    return pieces


def bucket_bounds(param_sizes: list[int], lo: int, hi: int, bucket_numel: int) -> tuple[int, ...]:
    """Cut the range [lo, hi) into gradient buckets: offsets from lo, rising from 0 to hi - lo.

    Cuts fall on tensor boundaries, so a bucket is final as soon as backward has produced its
    tensors' gradients. They are placed from the end of the range, where the last layers sit
    (whose gradients come first), each bucket holding at least `bucket_numel` values where
    the range allows; whatever is left at the start is the last bucket to be sent. 0 makes
    the whole range one bucket.

    A bucket that came out at least twice `bucket_numel` (a big tensor: ResNet-18's 3x3 convs
    of 512 channels are 9.4 MB each) is then cut into equal pieces of at least `bucket_numel`,
    inside the tensor. They are all final at once, but each can be summed, applied and sent
    back on its own, so over a slow link the weights start back while gradients still come
    in. That pipelining is what small buckets are for: with cuts only between tensors (9
    buckets instead of 19 at 2 MB), ResNet-18's streamed round with 2 workers over 1 Gbit/s
    links between network namespaces took 938 ms instead of 811 ms (two runs of 10 rounds
    each), the first bucket back being a whole 9.4 MB convolution. On one machine the cuts
    cost each CPU worker a copy of the cut pieces.
    """
    size = hi - lo
    if bucket_numel <= 0:
        return (0, size)
    ends, total = [], 0
    for numel in param_sizes:
        total += numel
        if lo < total < hi:
            ends.append(total - lo)
    cuts = [size]
    for end in reversed(ends):
        if cuts[-1] - end >= bucket_numel:
            cuts.append(end)
    if cuts[-1] != 0:
        cuts.append(0)
    cuts.reverse()
    pieces_cut = [0]
    for start, end in itertools.pairwise(cuts):
        pieces = max(1, (end - start) // bucket_numel)
        pieces_cut += [start + (end - start) * i // pieces for i in range(1, pieces + 1)]
    return tuple(pieces_cut)


def shard_bucket_bounds(
    param_sizes: list[int], bounds: tuple[int, ...], bucket_numel: int
) -> list[tuple[int, ...]]:
    """`bucket_bounds` of every shard's range, shard 0 (the leader) first."""
    return [
        bucket_bounds(param_sizes, *shard_range(bounds, shard), bucket_numel)
        for shard in range(len(bounds) - 1)
    ]
