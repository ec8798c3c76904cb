"""Overlap: send the gradient piece by piece while backward is still running.

The flat gradient is cut into units: the leader's slice and each follower shard's slice in
buckets (JobSpec.shard_buckets, see common.sharding). Backward produces gradients from
the last layer to the first, so a unit is final as soon as every parameter that overlaps it
has its gradient: a post-accumulate-grad hook per parameter counts them down and hands the
unit to `send` at zero. ZeroMQ's I/O thread then moves those bytes, and the server adds them
up or applies them, while autograd works on the earlier layers.

On the CPU the hooks run on the thread that called backward(); on CUDA on autograd's device
thread, while the calling thread waits in backward(). Either way one thread at a time touches
the sockets. Not for top-k: choosing the top entries needs the whole gradient.
"""

from collections.abc import Callable

import torch
from torch import nn


class GradientStreamer:
    def __init__(
        self, model: nn.Module, units: list[tuple[int, int]], send: Callable[[int], None]
    ) -> None:
        """`units`: [lo, hi) ranges of the flat gradient; `send(i)` once unit i is final."""
        self.send = send
        self.num_units = len(units)
        # Which units each parameter's gradient feeds (a range may cut a tensor in two).
        self._feeds: list[list[int]] = []
        self._needs = [0] * self.num_units  # parameters each unit waits for
        offset = 0
        for param in model.parameters():
            start, end = offset, offset + param.numel()
            feeds = [u for u, (lo, hi) in enumerate(units) if start < hi and lo < end]
            self._feeds.append(feeds)
            for unit in feeds:
                self._needs[unit] += 1
            offset = end
        self._waiting = list(self._needs)
        self._sent = [True] * self.num_units  # disarmed: hooks do nothing outside a step
        self._handles = [
            param.register_post_accumulate_grad_hook(self._hook(index))
            for index, param in enumerate(model.parameters())
        ]

    def _hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def on_gradient(_: torch.Tensor) -> None:
            for unit in self._feeds[index]:
                self._waiting[unit] -= 1
                if self._waiting[unit] == 0 and not self._sent[unit]:
                    self._sent[unit] = True
                    self.send(unit)

        return on_gradient

    def arm(self) -> None:
        """Before backward: every unit waits for all of its parameters again."""
        self._waiting = list(self._needs)
        self._sent = [False] * self.num_units

    def flush(self) -> list[int]:
        """After backward: send whatever no hook sent (a parameter that got no gradient,
        say), last units first; returns those units."""
        late = [unit for unit in reversed(range(self.num_units)) if not self._sent[unit]]
        for unit in late:
            self._sent[unit] = True
            self.send(unit)
        return late

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
