"""Choosing a device (a worker's, or the server's for evaluation), with a clear error when the
machine does not have it."""

import logging

import torch

from common.errors import DeviceError, first_line

log = logging.getLogger("ps.worker")
# What the GPU's own libraries write when they fail: cuDNN and cuBLAS raise plain
# RuntimeErrors that need not name CUDA ("cuDNN error: CUDNN_STATUS_EXECUTION_FAILED").
NO_ENGINE = "unable to find an engine"  # cuDNN: no kernel for a layer, or none whose workspace fits
GPU_LIBRARY_WORDS = ("CUDA", "cuDNN", "CUDNN_", "CUBLAS_", NO_ENGINE)
# ... and what cuDNN writes when short of memory, where torch's OutOfMemoryError may not come.
GPU_SHORT_OF_MEMORY_WORDS = ("CUDNN_STATUS_ALLOC_FAILED",)


def resolve_device(gpu: int | None, device: str | None) -> torch.device:
    """`--gpu i` means cuda:i; `--device` is the explicit form; neither picks cuda:0 or cpu."""
    if gpu is not None and device is not None:
        raise DeviceError("give either --gpu or --device, not both")
    if gpu is not None:
        return check_device(f"cuda:{gpu}", f"--gpu {gpu}")
    if device is not None:
        return check_device(device, f"--device {device}")
    if not torch.cuda.is_available():
        log.info("no --gpu or --device given, and no CUDA device here; using the CPU")
        return torch.device("cpu")
    # Probed as an asked-for GPU is: a full or reserved one fails here, not after registering.
    chosen = check_device("cuda:0", "the default device (cuda:0; choose with --gpu or --device)")
    log.info("no --gpu or --device given; using %s", chosen)
    return chosen


def parse_device(spec: str) -> torch.device:
    """The device `spec` names, if it is cpu or cuda[:N]; whether this machine has it is
    `check_device`'s question."""
    try:
        resolved = torch.device(spec)
    except RuntimeError:
        raise DeviceError(f"{spec!r} is not a device; use cpu or cuda:N") from None
    if resolved.type not in ("cpu", "cuda"):
        raise DeviceError(f"only cpu and cuda:N are supported, got {spec!r}")
    return resolved


def check_device(spec: str, flag: str, cpu_option: str = "--device") -> torch.device:
    """The device `spec` names (cpu or cuda:N), if this machine has it; `flag` is the option
    the person wrote, and `cpu_option` the one that asks for the CPU instead, for the error."""
    try:
        resolved = parse_device(spec)
    except DeviceError as exc:
        raise DeviceError(f"{flag}: {exc}") from None
    if resolved.type == "cpu":
        return resolved
    if not torch.cuda.is_available():
        raise DeviceError(
            f"{flag} needs CUDA, but no CUDA device is available on this machine; use "
            f"{cpu_option} cpu"
        )
    index = resolved.index if resolved.index is not None else 0
    count = torch.cuda.device_count()
    if index >= count:
        raise DeviceError(
            f"{flag}: this machine shows {count} CUDA device(s), numbered 0..{count - 1} "
            "(CUDA_VISIBLE_DEVICES, where set, picks which ones and numbers them from 0)"
        )
    chosen = torch.device("cuda", index)
    try:  # the first use creates the CUDA context: a GPU that cannot be used fails here
        torch.empty(1, device=chosen)
    except RuntimeError as exc:
        raise DeviceError(
            f"{flag}: CUDA device {index} cannot be used ({first_line(exc)}); it may "
            "be full, or reserved by another process (exclusive compute mode): see "
            "nvidia-smi, or pick another GPU"
        ) from None
    return chosen


def device_failure(exc: RuntimeError, device: torch.device) -> DeviceError | None:
    """A device's own failure met while training (out of memory, a CUDA error) as an error a
    person can act on; None for anything else, which is a bug and keeps its traceback."""
    text = str(exc)
    on_gpu = device.type == "cuda"
    # On the CPU, torch's allocator raises a plain RuntimeError when malloc fails.
    if (
        isinstance(exc, torch.OutOfMemoryError)
        or "can't allocate memory" in text
        or (on_gpu and any(words in text for words in GPU_SHORT_OF_MEMORY_WORDS))
    ):
        return DeviceError(
            f"{device} ran out of memory ({first_line(exc)}); the job's batch may be too "
            "big for it: ask for a smaller --batch-size on ps-server, or free the device "
            "(nvidia-smi shows what else holds a GPU)"
        )
    # Recent torch raises torch.AcceleratorError; older releases a RuntimeError naming CUDA.
    if on_gpu and (
        isinstance(exc, getattr(torch, "AcceleratorError", ()))
        or any(words in text for words in GPU_LIBRARY_WORDS)
    ):
        maybe_memory = (
            " (cuDNN says this when short of memory too: a smaller --batch-size on ps-server "
            "may help)"
            if NO_ENGINE in text
            else ""
        )
        return DeviceError(
            f"{device} failed: {first_line(exc)}{maybe_memory}; check the GPU (nvidia-smi), or "
            "use another --gpu"
        )
    return None
