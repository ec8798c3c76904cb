"""Choosing a device (a worker's, or the server's for evaluation), with a clear error when the
machine does not have it."""

import logging

import torch

from common.errors import DeviceError

log = logging.getLogger("ps.worker")


def resolve_device(gpu: int | None, device: str | None) -> torch.device:
    """`--gpu i` means cuda:i; `--device` is the explicit form; neither picks cuda:0 or cpu."""
    if gpu is not None and device is not None:
        raise DeviceError("give either --gpu or --device, not both")
    if gpu is not None:
        return check_device(f"cuda:{gpu}", f"--gpu {gpu}")
    if device is not None:
        return check_device(device, f"--device {device}")
    chosen = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    log.info("no --gpu or --device given; using %s", chosen)
    return chosen


def check_device(spec: str, flag: str) -> torch.device:
    """The device `spec` names (cpu or cuda:N), if this machine has it; `flag` is the option
    the person wrote, for the error."""
    try:
        resolved = torch.device(spec)
    except RuntimeError:
        raise DeviceError(f"{flag}: {spec!r} is not a device; use cpu or cuda:N") from None
    if resolved.type == "cpu":
        return resolved
    if resolved.type != "cuda":
        raise DeviceError(f"{flag}: only cpu and cuda:N are supported, got {spec!r}")
    if not torch.cuda.is_available():
        raise DeviceError(
            f"{flag} needs CUDA, but no CUDA device is available on this machine; use --device cpu"
        )
    index = resolved.index if resolved.index is not None else 0
    count = torch.cuda.device_count()
    if index >= count:
        raise DeviceError(
            f"{flag}: this machine has {count} CUDA device(s), numbered 0..{count - 1}"
        )
    return torch.device("cuda", index)
