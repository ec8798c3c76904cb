"""Gradient compression on the wire: none, fp16, bf16, or top-k with error feedback.

- `fp16` / `bf16` halve the bytes; the server adds them into its float32 sum. A piece with a
  value beyond fp16's range (65504) goes in float32 instead, which the server also takes:
  rounded to infinity, it would be refused as non-finite.
- `topk:RATIO` sends the RATIO fraction of entries with the largest magnitude, as values and
  int32 positions. What is not sent is not lost: the worker keeps it in a residual and adds it
  to its next gradient (error feedback), so every coordinate is eventually applied. A push the
  server did not apply (a late sync gradient) is not lost either: `take_back` returns what it
  sent to the residual.

The worker owns a `GradientCompressor` (it holds the residual); the server only needs
`validate_spec` and the dense/sparse distinction in the PUSH message.
"""

import dataclasses
import logging

import torch

from common.errors import ConfigError

log = logging.getLogger("ps.worker")
KINDS = ("none", "fp16", "bf16", "topk")
HALF_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


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
        self._sent: tuple[torch.Tensor, torch.Tensor] | None = None  # the last top-k push
        self._warned_half = False

    def compress(self, grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(values on the CPU, int32 indices on the CPU; empty indices mean dense)."""
        if self.spec.kind in HALF_DTYPES:
            half = grads.to(HALF_DTYPES[self.spec.kind])
            if bool(torch.isinf(half).any()):  # one pass over half the bytes
                return self._too_big_for_half(grads), self._no_indices
            return half.cpu(), self._no_indices
        if self.residual is None:
            return grads.cpu(), self._no_indices
        corrected = self.residual.add_(grads)  # (P,) gradient plus what was not sent before
        _, indices = corrected.abs().topk(self.k, sorted=False)  # (K,)
        values = corrected[indices]  # (K,)
        corrected[indices] = 0  # the rest stays in the residual for the next step
        self._sent = (values, indices)
        return values.cpu(), indices.to(torch.int32).cpu()

    def take_back(self) -> None:
        """The last top-k push was not applied: put what it sent back into the residual, so
        error feedback still applies it (with the next gradient). Nothing for other kinds."""
        if self.residual is not None and self._sent is not None:
            values, indices = self._sent
            self.residual.index_add_(0, indices, values)
        self._sent = None

    def _too_big_for_half(self, grads: torch.Tensor) -> torch.Tensor:
        # Infinity in fp16 (the rounding of anything past 65504), or in bf16 (past about
        # 3.4e38, float32's own edge), is what the server refuses as non-finite; a NaN or
        # Inf already in the gradient is refused either way.
        if not self._warned_half:
            kind = self.spec.kind
            log.warning(
                "gradient values beyond %s's range (%g): such pieces go in float32; if "
                "this keeps happening, lower the learning rate%s",
                kind, torch.finfo(HALF_DTYPES[kind]).max,
                " or use --compress bf16" if kind == "fp16" else "",
            )  # fmt: skip
            self._warned_half = True
        return grads.cpu()


def wire_bytes(*tensors: torch.Tensor) -> int:
    """Bytes of tensor data these put on the wire (a gradient's values and indices, say):
    each goes as one raw frame of its own dtype."""
    return sum(t.numel() * t.element_size() for t in tensors)
