"""Checks a PUSH must pass before it touches the parameter store.

Decoding (common.protocol) already guarantees the message is well formed; these checks are
about the job: the shapes and dtypes of this model, the batch this worker was assigned, the
sample count, and finite values. Each failure is a RequestRejected with a code and a reason.
"""

import math

import torch

from common.errors import RequestRejected
from common.job import JobSpec
from common.protocol import Push

GRADIENT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def push_bytes(push: Push) -> int:
    """Bytes of tensor data a push put on the wire."""
    return sum(t.numel() * t.element_size() for t in (push.grads, push.grad_indices, push.buffers))


def validate_push(
    job: JobSpec, worker_id: int, assignment: tuple[int, int] | None, push: Push
) -> None:
    # With shards, the leader takes only its own slice of the gradient.
    lo, hi = job.shard_range(0)
    p, f = hi - lo, job.num_buffers
    if push.buffers.numel() != f or push.buffers.dtype != torch.float32:
        raise RequestRejected(
            "wrong-shape",
            f"buffers must be {f} float32 values for {job.model}, got "
            f"{push.buffers.numel()} {push.buffers.dtype}",
        )
    if push.grads.dtype not in GRADIENT_DTYPES:
        raise RequestRejected(
            "wrong-shape", f"grads must be float32, float16 or bfloat16, got {push.grads.dtype}"
        )
    k = push.grad_indices.numel()
    if not job.sparse and (k or push.grads.numel() != p):
        raise RequestRejected(
            "wrong-shape",
            f"grads must be {p} dense values for {job.model}, got {push.grads.numel()} values "
            f"and {k} indices",
        )
    if job.sparse:
        if push.grad_indices.dtype != torch.int32 or push.grads.numel() != k or k > p:
            raise RequestRejected(
                "wrong-shape",
                f"a top-k gradient needs K <= {p} values and K int32 indices, got "
                f"{push.grads.numel()} values and {k} {push.grad_indices.dtype} indices",
            )
        low, high = (int(push.grad_indices.min()), int(push.grad_indices.max())) if k else (0, 0)
        if low < 0 or high >= p:
            raise RequestRejected(
                "wrong-shape", f"top-k indices must lie in [0, {p}), got [{low}, {high}]"
            )
    if assignment != (push.epoch, push.batch):
        raise RequestRejected(
            "unexpected-batch",
            f"worker {worker_id} pushed epoch {push.epoch} batch {push.batch}, but "
            f"was assigned {assignment}; pull before pushing",
        )
    if push.samples < 1 or push.samples > job.batch_size:
        raise RequestRejected(
            "bad-samples", f"samples must be 1..{job.batch_size}, got {push.samples}"
        )
    # One cheap pass first: a sum is finite unless some value is not (or it overflows,
    # in which case the exact check below decides).
    total = float(push.grads.sum())
    if not math.isfinite(total) and not bool(torch.isfinite(push.grads).all()):
        raise RequestRejected(
            "non-finite", f"worker {worker_id} pushed NaN or Inf gradients; dropped"
        )
