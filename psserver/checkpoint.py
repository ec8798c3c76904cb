"""Checkpoints: `DIR/latest.pt`, a torch.save dict with model, optimizer, step and config.

Writes are atomic: the file is written under a temporary name, fsynced, then renamed over the
old one, so a crash leaves either the old or the new checkpoint, never half of one. Loading
uses `weights_only=True`: a checkpoint is data, never code.
"""

import os
from pathlib import Path
from typing import Any

import torch

from common.errors import CheckpointError

LATEST = "latest.pt"
FORMAT = "ps-checkpoint/1"


def save_checkpoint(directory: Path, state: dict[str, Any]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / LATEST
    temporary = directory / f".{LATEST}.tmp-{os.getpid()}"
    try:
        with open(temporary, "wb") as f:
            torch.save({"format": FORMAT, **state}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, final)
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # make the rename itself durable
        finally:
            os.close(dir_fd)
    except OSError as exc:
        temporary.unlink(missing_ok=True)
        raise CheckpointError(f"could not write checkpoint {final}: {exc}") from None
    return final


def load_checkpoint(directory: Path) -> dict[str, Any]:
    path = directory / LATEST
    if not path.is_file():
        raise CheckpointError(f"--resume found no checkpoint at {path}; start without --resume")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for truncated or foreign files
        raise CheckpointError(
            f"checkpoint {path} is corrupt or not a checkpoint ({type(exc).__name__}: {exc}); "
            "delete it to start over"
        ) from None
    required = {"format", "model", "optimizer", "step", "config"}
    if not isinstance(state, dict) or not required <= set(state) or state["format"] != FORMAT:
        raise CheckpointError(f"{path} is not a {FORMAT} checkpoint; delete it to start over")
    return state
