"""Gradient compression on the wire: none, fp16, bf16, or top-k with error feedback.

- `fp16` / `bf16` halve the bytes; the server adds them into its float32 sum.
- `topk:RATIO` sends the RATIO fraction of entries with the largest magnitude, as values and
  int32 positions. What is not sent is not lost: the worker keeps it in a residual and adds it
  to its next gradient (error feedback), so every coordinate is eventually applied.

The worker owns a `GradientCompressor` (it holds the residual); the server only needs
`validate_spec` and the dense/sparse distinction in the PUSH message.
"""

import dataclasses

import torch

from common.errors import ConfigError

KINDS = ("none", "fp16", "bf16", "topk")


@dataclasses.dataclass(frozen=True)
class CompressionSpec:
    kind: str
    ratio: float = 1.0  # fraction of entries kept by top-k

    @classmethod
    def parse(cls, text: str) -> "CompressionSpec":
        kind, _, ratio_text = text.partition(":")
        if kind not in KINDS:
            raise ConfigError(f"--compress {text!r}: choose none, fp16, bf16 or topk:RATIO")
        if kind != "topk":
            if ratio_text:
                raise ConfigError(f"--compress {text!r}: only topk takes a ratio")
            return cls(kind)
        try:
            ratio = float(ratio_text)
        except ValueError:
            raise ConfigError(f"--compress {text!r}: write topk:RATIO, e.g. topk:0.01") from None
        if not 0 < ratio <= 1:
            raise ConfigError(f"--compress {text!r}: the ratio must be in (0, 1]")
        return cls(kind, ratio)


class GradientCompressor:
    """Turns the flat gradient into what a PUSH carries: (values, indices)."""

    def __init__(self, spec: CompressionSpec, num_params: int, device: torch.device) -> None:
        self.spec = spec
        self.k = max(1, int(spec.ratio * num_params))
        self.residual = torch.zeros(num_params, device=device) if spec.kind == "topk" else None
        self._no_indices = torch.empty(0, dtype=torch.int32)

    def compress(self, grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(values on the CPU, int32 indices on the CPU; empty indices mean dense)."""
        if self.spec.kind == "fp16":
            return grads.to(torch.float16).cpu(), self._no_indices
        if self.spec.kind == "bf16":
            return grads.to(torch.bfloat16).cpu(), self._no_indices
        if self.residual is None:
            return grads.cpu(), self._no_indices
        corrected = self.residual.add_(grads)  # (P,) gradient plus what was not sent before
        _, indices = corrected.abs().topk(self.k, sorted=False)  # (K,)
        values = corrected[indices]  # (K,)
        corrected[indices] = 0  # the rest stays in the residual for the next step
        return values.cpu(), indices.to(torch.int32).cpu()


def wire_bytes(values: torch.Tensor, indices: torch.Tensor) -> int:
    return values.numel() * values.element_size() + indices.numel() * indices.element_size()
