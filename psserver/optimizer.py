"""SGD with momentum and weight decay over one flat tensor, a range at a time.

The arithmetic is torch.optim.SGD's (no dampening, no Nesterov), operation for operation, so
results match it bit for bit. It is written out here for two reasons:

- A range can be stepped on its own. With gradient buckets (see psserver.policies) the
  server updates the last layers while workers still run backward on the first ones.
- Weight decay is added into the gradient buffer in place. torch.optim.SGD allocates a fresh
  gradient-sized tensor for it at every step, 45 MB for ResNet-18, and page faults on it.

It is not a general optimizer: one flat parameter, one group, plain SGD.
"""

import dataclasses
from typing import Any

import torch


@dataclasses.dataclass(frozen=True)
class SGDSettings:
    lr: float
    momentum: float
    weight_decay: float

    def to_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


class FlatSGD:
    def __init__(self, params: torch.Tensor, grads: torch.Tensor, settings: SGDSettings):
        self.params, self.grads, self.settings = params, grads, settings  # (S,) each
        # Allocated at the first step. Zeros make that first step exact: 0 * m + g == g, which
        # is what torch.optim.SGD's clone of the first gradient holds.
        self.momentum_buffer: torch.Tensor | None = None

    def step(self, lo: int, hi: int, lr_scale: float = 1.0) -> None:
        """params[lo:hi] -= lr * (momentum-smoothed grads[lo:hi] + weight decay).

        Overwrites grads[lo:hi] when there is weight decay: they are the server's scratch."""
        s = self.settings
        param, grad = self.params[lo:hi], self.grads[lo:hi]  # (hi - lo,) views
        if s.weight_decay != 0:
            grad.add_(param, alpha=s.weight_decay)
        if s.momentum != 0:
            if self.momentum_buffer is None:
                self.momentum_buffer = torch.zeros_like(self.params)
            buf = self.momentum_buffer[lo:hi]
            buf.mul_(s.momentum).add_(grad, alpha=1)
            grad = buf
        param.add_(grad, alpha=-(s.lr * lr_scale))

    def state_dict(self) -> dict[str, Any]:
        """In torch.optim.SGD's layout, so that checkpoints stay readable by plain PyTorch."""
        buffer = self.momentum_buffer
        state = {} if buffer is None else {0: {"momentum_buffer": buffer}}
        group = {**self.settings.to_dict(), "dampening": 0, "nesterov": False, "params": [0]}
        return {"state": state, "param_groups": [group]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        buffer = state.get("state", {}).get(0, {}).get("momentum_buffer")
        self.set_momentum(buffer)

    def set_momentum(self, buffer: torch.Tensor | None) -> None:
        if buffer is None or not buffer.numel():
            self.momentum_buffer = None
            return
        if buffer.numel() != self.params.numel():
            raise ValueError(
                f"momentum has {buffer.numel()} values, the parameters {self.params.numel()}"
            )
        self.momentum_buffer = buffer.detach().to(torch.float32).clone()
