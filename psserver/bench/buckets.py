"""How many gradient buckets one ps-server cuts a model's gradient into, as the server will.

With one bucket, the runs that stream buckets back (comm's "streamed" row, link's `sync`)
or push them during backward (train's and link's `sync`) do exactly what their whole-gradient
twins do: nothing goes before the whole gradient is in. Their ratio (`overlap_gain`,
`streaming_gain`) is then noise, and the reports say so instead of printing it (LeNet's
0.24 MB fits in the default 0.5 to 2 MB bucket).

This is not the sharded runs' count: each shard's slice is cut on its own, and a sharded
worker pushes slice by slice during backward whatever the buckets.
"""

from typing import Any

from common.catalog import build_model
from common.sharding import bucket_bounds
from psserver.config import ServerConfig


def parameter_sizes(model: str) -> list[int]:
    """The numel of each of `model`'s parameters, in order, without building its weights."""
    import torch

    with torch.device("meta"):
        return [p.numel() for p in build_model(model).parameters()]


def gradient_buckets(model: str, bucket_mb: float | None) -> int:
    """Buckets of `model`'s gradient on one server with --bucket-mb `bucket_mb` (None: the
    server's default)."""
    sizes = parameter_sizes(model)
    numel = ServerConfig(model=model, bucket_mb=bucket_mb).bucket_numel
    return len(bucket_bounds(sizes, 0, sum(sizes), numel)) - 1


def one_bucket_note(model: str, bucket_mb: float | None) -> str | None:
    """Why overlap and streaming have nothing to do for this model on one server, with the
    --bucket-mb that would give them something; None when its gradient has buckets."""
    if gradient_buckets(model, bucket_mb) > 1:
        return None
    bucket = ServerConfig(model=model, bucket_mb=bucket_mb).bucket_size_mb
    model_mb = 4 * sum(parameter_sizes(model)) / 2**20
    smaller = float(f"{model_mb / 4:.1g}")  # about 4 buckets
    return (
        f"{model}'s gradient ({model_mb:.2f} MB) fits in one {bucket:g} MB gradient bucket: "
        "nothing is pushed during backward or streamed back before it is all in, so overlap "
        f"and streaming have nothing to gain here; --bucket-mb {smaller:g} cuts it into buckets"
    )


def without_one_bucket_gains(results: dict[str, Any], gains: tuple[str, ...]) -> dict[str, Any]:
    """`results` (of bench.model with bench.bucket_mb) with `sync_buckets` and `notes`, and
    `gains` (those that ran) set to None when the gradient is one bucket: then the runs they
    compare do the same thing, and their ratio is noise."""
    buckets = gradient_buckets(results["model"], results["bucket_mb"])
    note = one_bucket_note(results["model"], results["bucket_mb"]) if buckets == 1 else None
    measured = [gain for gain in gains if gain in results]
    if note is None or not measured:
        return {**results, "sync_buckets": buckets, "notes": []}
    return {**results, **dict.fromkeys(measured), "sync_buckets": buckets, "notes": [note]}
