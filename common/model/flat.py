"""Flat views of a model: all parameters in one contiguous tensor, and all floating-point
buffers (BatchNorm running statistics) in another.

Moving weights and gradients as one flat tensor means one frame on the wire, one copy between
host and device, and in-place updates with no per-tensor overhead. After `FlatModel(model)`,
every parameter, its `.grad` and every floating buffer is a view into the flat storage, so
writing the flat tensor updates the model and `backward()` fills the flat gradient.

Weights come in through `load_params`, which on the CPU does not copy whole parameters at all:
they become views of the received memory itself (see there). Read the model's weights from its
parameters, not from `params`, which then only holds those a received range cut through.
"""

import bisect
from collections.abc import Sequence

import torch
from torch import nn


class FlatModel:
    """Owns the flat storage of a model's parameters, gradients and floating buffers."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        params = list(model.parameters())
        device = params[0].device
        self.params = _flatten_into_views(params, device)  # (P,) the parameters' home storage
        self._param_list = params
        self._param_starts = [0]  # where each parameter starts in the flat vector
        for p in params[:-1]:
            self._param_starts.append(self._param_starts[-1] + p.numel())
        self.grads = torch.zeros_like(self.params)  # (P,)
        for start, p in zip(self._param_starts, params, strict=True):
            # autograd accumulates into an existing .grad in place, so backward writes here.
            p.grad = self.grads[start : start + p.numel()].view_as(p)
        self._float_buffers = [b for b in model.buffers() if b.is_floating_point()]
        self.buffers = _flatten_into_views(self._float_buffers, device)  # (F,)
        self._int_buffers = [b for b in model.buffers() if not b.is_floating_point()]

    @property
    def num_params(self) -> int:
        return self.params.numel()

    @property
    def num_buffers(self) -> int:
        return self.buffers.numel()

    def load_params(self, lo: int, values: torch.Tensor) -> None:
        """Set the parameters [lo, lo + len(values)) of the flat vector to `values`.

        On the CPU, every parameter that lies wholly inside the range becomes a view of
        `values` itself: weights received from the server are used where ZeroMQ put them, which
        saves copying the model (45 MB for ResNet-18) at every pull. The worker never writes
        its parameters (the server owns the optimizer), so read-only received memory is fine,
        and the views keep it alive until the next load replaces them. A parameter the range
        only partly covers (a gradient bucket cut through a big tensor) is copied into its
        home in `params`, which the other ranges of the same version then fill in.

        Elsewhere (`values` on another device or of another dtype) this is one copy, e.g. the
        host-to-device transfer of a GPU worker.
        """
        hi = lo + values.numel()
        borrow = (
            self.params.device.type == "cpu"
            and values.device == self.params.device
            and values.dtype == self.params.dtype
            and values.is_contiguous()
        )
        if not borrow:
            self.params[lo:hi].copy_(values)
        first = bisect.bisect_right(self._param_starts, lo) - 1
        for start, param in zip(self._param_starts[first:], self._param_list[first:], strict=True):
            if start >= hi:
                break
            end = start + param.numel()
            if borrow and lo <= start and end <= hi:
                param.data = values[start - lo : end - lo].view_as(param)
                continue
            if borrow:
                a, b = max(start, lo), min(end, hi)
                self.params[a:b].copy_(values[a - lo : b - lo])
            home = self.params[start:end]
            if param.data_ptr() != home.data_ptr():  # it was a view of weights loaded before
                param.data = home.view_as(param)

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
