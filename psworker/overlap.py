"""Overlap: send each server shard its slice of the gradient while backward is still running.

Backward produces gradients from the last layer to the first. Each shard owns one range of the
flat vector (common.sharding), so a shard's slice is final as soon as every parameter that
overlaps its range has its gradient: a post-accumulate-grad hook per parameter counts them
down and hands the slice to `send` at zero. ZeroMQ's I/O thread then moves those bytes, and
the shard applies them, while autograd works on the earlier layers. The leader owns the last
range, so its push (with the step's loss and sample count) leaves first.

On the CPU the hooks run on the thread that called backward(); on CUDA on autograd's device
thread, while the calling thread waits in backward(). Either way one thread at a time touches
the sockets. Not for top-k: choosing the top entries needs the whole gradient.
"""

from collections.abc import Callable

import torch
from torch import nn

from common.sharding import shard_range


class GradientStreamer:
    def __init__(self, model: nn.Module, bounds: tuple[int, ...], send: Callable[[int], None]):
        self.send = send
        self.num_shards = len(bounds) - 1
        ranges = [shard_range(bounds, shard) for shard in range(self.num_shards)]
        # Which shards each parameter's gradient feeds (a range may cut a tensor in two).
        self._feeds: list[list[int]] = []
        self._needs = [0] * self.num_shards  # parameters each shard waits for
        offset = 0
        for param in model.parameters():
            start, end = offset, offset + param.numel()
            feeds = [s for s, (lo, hi) in enumerate(ranges) if start < hi and lo < end]
            self._feeds.append(feeds)
            for shard in feeds:
                self._needs[shard] += 1
            offset = end
        self._waiting = list(self._needs)
        self._sent = [True] * self.num_shards  # disarmed: hooks do nothing outside a step
        self._handles = [
            param.register_post_accumulate_grad_hook(self._hook(index))
            for index, param in enumerate(model.parameters())
        ]

    def _hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def on_gradient(_: torch.Tensor) -> None:
            for shard in self._feeds[index]:
                self._waiting[shard] -= 1
                if self._waiting[shard] == 0 and not self._sent[shard]:
                    self._sent[shard] = True
                    self.send(shard)

        return on_gradient

    def arm(self) -> None:
        """Before backward: every shard waits for all of its parameters again."""
        self._waiting = list(self._needs)
        self._sent = [False] * self.num_shards

    def flush(self) -> list[int]:
        """After backward: send whatever no hook sent (a parameter that got no gradient,
        say); returns those shards."""
        late = [shard for shard in range(self.num_shards) if not self._sent[shard]]
        for shard in late:
            self._sent[shard] = True
            self.send(shard)
        return late

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
