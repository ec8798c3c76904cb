"""One bucket of a follower shard's slice updated from the gradients the leader named: their
weighted sum, renormalised to the samples that came, then the optimizer's step of that range.

It adds up with exactly the arithmetic the leader used on its own slice
(psserver.store.parameters.add_weighted), so every shard computes bit for bit what one server would
(with two workers in any order; with more, the sum's order is arrival order on one server
too). Buckets are independent: the optimizer is elementwise.

What this is not: which gradients a bucket takes, or when (psserver.serving.parts decides that from
the leader's STEP_PLAN and COMMIT messages).
"""

import torch

from common.compression import wire_bytes
from psserver.store.parameters import SliceStore, add_weighted

Piece = tuple[torch.Tensor, torch.Tensor]  # (values, indices) of one bucket


def update_bucket(
    store: SliceStore,
    lo: int,
    hi: int,
    gradients: list[tuple[int, Piece]],  # (samples, piece), in the order to add them
    expected: int,
    lr_scale: float,
) -> int:
    """Step [lo, hi) of the slice with `gradients`; `expected` 0: async, one gradient (or none,
    its worker having died) applied as it is. Returns the gradient bytes applied, as they came
    on the wire."""
    applied_bytes = 0
    grads = store.grads[lo:hi]
    store.wait_for_sends(lo, hi)  # the live slice may still be on its way to a worker
    if expected == 0:  # async: one gradient, applied as it is
        if gradients:  # as SliceStore.apply_gradient, for this range
            values, indices = gradients[0][1]
            applied_bytes += wire_bytes(values, indices)
            if store.sparse:
                add_weighted(grads, values, indices, 1.0, True, True)
            else:
                grads.copy_(values)
        else:  # its worker died before sending it; the leader stepped its own slice
            grads.zero_()  # so this slice steps too (momentum, weight decay), as in sync
        store.apply_range(lo, hi, lr_scale)
        return applied_bytes
    total = 0
    for position, (samples, (values, indices)) in enumerate(gradients):
        applied_bytes += wire_bytes(values, indices)
        weight = samples / expected
        add_weighted(grads, values, indices, weight, position == 0, store.sparse)
        total += samples
    if not gradients:
        grads.zero_()
    elif total != expected:  # renormalise to the samples that came, as the leader
        grads.mul_(expected / total)
    store.apply_range(lo, hi, lr_scale)
    return applied_bytes
