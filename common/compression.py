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
`validate_spec` and the dense/sparse distinction in the PUSH message. On a GPU the pieces come
to the host through `HostStaging`.
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


class HostStaging:
    """Host memory, allocated once, that a GPU worker's gradient pieces are copied into on
    their way to the wire.

    Pinned memory takes the device-to-host copy as a direct DMA, several times faster than
    the fresh pageable tensor `.cpu()` would allocate (and fault in) at every step. Each piece
    goes to its own place, the range of the flat vector it covers, so the pieces of one step
    never share memory. A step reuses the last one's: the worker reads every reply to a step
    before the next backward (GradientPusher.finish), so no send still reads it, as with a
    CPU worker's float32 pieces, which go straight from the flat gradient.
    """

    def __init__(self, num_params: int, pinned: bool) -> None:
        self.num_params, self.pinned = num_params, pinned
        self._buffers: dict[torch.dtype, torch.Tensor] = {}  # (P,) per dtype sent

    def to_host(self, values: torch.Tensor, offset: int) -> torch.Tensor:
        """A host copy of `values`, the piece of the flat vector that starts at `offset`."""
        if not 0 <= offset <= self.num_params - values.numel():  # not a piece of it: a copy
            return values.cpu()
        buffer = self._buffers.get(values.dtype)
        if buffer is None:
            buffer = torch.empty(self.num_params, dtype=values.dtype, pin_memory=self.pinned)
            self._buffers[values.dtype] = buffer
        host = buffer[offset : offset + values.numel()]
        host.copy_(values)  # synchronous: the bytes are there when this returns
        return host


class GradientCompressor:
    """Turns the flat gradient into what a PUSH carries: (values, indices)."""

    def __init__(
        self,
        spec: CompressionSpec,
        num_params: int,
        device: torch.device,
        staging: HostStaging | None = None,
    ) -> None:
        """`staging`: where dense pieces come to the host; by default pinned memory for a
        GPU, and none for the CPU, whose float32 pieces go as they are."""
        self.spec = spec
        if staging is None and device.type == "cuda":
            staging = HostStaging(num_params, pinned=True)
        self._staging = staging
        self.k = max(1, int(spec.ratio * num_params))
        self.residual = torch.zeros(num_params, device=device) if spec.kind == "topk" else None
        self._no_indices = torch.empty(0, dtype=torch.int32)
        self._sent: tuple[torch.Tensor, torch.Tensor] | None = None  # the last top-k push
        self._warned_half = False

    def compress(self, grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(values on the CPU, int32 indices on the CPU; empty indices mean dense).

        `grads`: the flat gradient or a piece of it (a view, which says where it lies)."""
        if self.spec.kind in HALF_DTYPES:
            half = grads.to(HALF_DTYPES[self.spec.kind])
            if bool(torch.isinf(half).any()):  # one pass over half the bytes
                return self._to_host(self._too_big_for_half(grads)), self._no_indices
            return self._to_host(half, int(grads.storage_offset())), self._no_indices
        if self.residual is None:
            return self._to_host(grads), self._no_indices
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
        return grads

    def _to_host(self, values: torch.Tensor, offset: int | None = None) -> torch.Tensor:
        if self._staging is None:
            return values.cpu()
        start = int(values.storage_offset()) if offset is None else offset
        return self._staging.to_host(values, start)


def wire_bytes(*tensors: torch.Tensor) -> int:
    """Bytes of tensor data these put on the wire (a gradient's values and indices, say):
    each goes as one raw frame of its own dtype."""
    return sum(t.numel() * t.element_size() for t in tensors)
