"""Flat views of a model: all parameters in one contiguous tensor, and all floating-point
buffers (BatchNorm running statistics) in another.

Moving weights and gradients as one flat tensor means one frame on the wire, one copy between
host and device, and in-place updates with no per-tensor overhead. After `FlatModel(model)`,
every parameter, its `.grad` and every floating buffer is a view into the flat storage, so
writing the flat tensor updates the model and `backward()` fills the flat gradient.
"""

from collections.abc import Sequence

import torch
from torch import nn


class FlatModel:
    """Owns the flat storage of a model's parameters, gradients and floating buffers."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        params = list(model.parameters())
        device = params[0].device
        self.params = _flatten_into_views(params, device)  # (P,)
        self.grads = torch.zeros_like(self.params)  # (P,)
        offset = 0
        for p in params:
            # autograd accumulates into an existing .grad in place, so backward writes here.
            p.grad = self.grads[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        self._float_buffers = [b for b in model.buffers() if b.is_floating_point()]
        self.buffers = _flatten_into_views(self._float_buffers, device)  # (F,)
        self._int_buffers = [b for b in model.buffers() if not b.is_floating_point()]

    @property
    def num_params(self) -> int:
        return self.params.numel()

    @property
    def num_buffers(self) -> int:
        return self.buffers.numel()

    def zero_grad(self) -> None:
        self.grads.zero_()

    def set_batches_tracked(self, count: int) -> None:
        """BatchNorm's integer counters follow the number of applied steps."""
        for buffer in self._int_buffers:
            buffer.fill_(count)


def _flatten_into_views(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    total = sum(t.numel() for t in tensors)
    flat = torch.empty(total, dtype=torch.float32, device=device)
    offset = 0
    for t in tensors:
        n = t.numel()
        flat[offset : offset + n].copy_(t.detach().reshape(-1))
        t.data = flat[offset : offset + n].view_as(t)
        offset += n
    return flat
