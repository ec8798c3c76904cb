"""How the flat parameter vector is cut into server shards, and how a gradient is cut to match.

Like ps-lite's key ranges, shard i owns one contiguous range of the flat vector; the ranges
are as equal as integer division allows, so every shard moves and updates the same number of
bytes. A range may split a tensor in two: shards see only floats, never layers.
"""

import itertools

import torch


def shard_bounds(num_params: int, num_shards: int) -> tuple[int, ...]:
    """K + 1 offsets: shard i owns [bounds[i], bounds[i + 1])."""
    if not 1 <= num_shards <= num_params:
        raise ValueError(f"cannot cut {num_params} parameters into {num_shards} shards")
    return tuple(i * num_params // num_shards for i in range(num_shards + 1))


def split_gradient(
    values: torch.Tensor, indices: torch.Tensor, bounds: tuple[int, ...], sparse: bool
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (values, indices) pair per shard, indices relative to the shard's first element.

    A dense gradient is cut into views (no copy); a top-k gradient's entries are sorted into
    the shard whose range holds their position.
    """
    if len(bounds) == 2:
        return [(values, indices)]
    if not sparse:
        return [(values[lo:hi], indices) for lo, hi in itertools.pairwise(bounds)]
    pieces = []
    for lo, hi in itertools.pairwise(bounds):
        inside = (indices >= lo) & (indices < hi)  # (k,)
        pieces.append((values[inside], (indices[inside] - lo).to(torch.int32)))
    return pieces
