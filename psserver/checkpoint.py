"""Checkpoints: `DIR/latest.pt` (and the one before it, `DIR/previous.pt`).

A checkpoint is a torch.save dict with `model` (a state_dict for `common.models`),
`optimizer`, `step`, `position` (epoch and data position), `rng`, `config` and `format`.

Writes survive a SIGKILL at any moment: the new file is written under a temporary name and
fsynced; then the current `latest.pt` becomes `previous.pt` and the temporary file becomes
`latest.pt`, each by an atomic rename, and the folder is fsynced. At every instant at least
one complete checkpoint exists under one of the two names. Loading validates the file and
falls back to `previous.pt` when `latest.pt` is missing, truncated or corrupt. Loading uses
`weights_only=True`: a checkpoint is data, never code.
"""

import logging
import os
import pickle
from pathlib import Path
from typing import Any

import torch

from common.errors import CheckpointError, first_line

log = logging.getLogger("ps.server")
LATEST = "latest.pt"
PREVIOUS = "previous.pt"
DAMAGED = "latest.pt.damaged"
FORMAT = "ps-checkpoint/2"
REQUIRED = {"format", "model", "optimizer", "step", "position", "rng", "config"}


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(directory: Path, state: dict[str, Any]) -> Path:
    latest, previous = directory / LATEST, directory / PREVIOUS
    temporary = directory / f".{LATEST}.tmp-{os.getpid()}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with open(temporary, "wb") as f:
            torch.save({"format": FORMAT, **state}, f)
            f.flush()
            os.fsync(f.fileno())
        if latest.exists():
            os.replace(latest, previous)
        os.replace(temporary, latest)
        _fsync_dir(directory)  # make the renames themselves durable
    except OSError as exc:
        temporary.unlink(missing_ok=True)
        raise CheckpointError(f"could not write checkpoint {latest}: {exc}") from None
    return latest


def read_checkpoint(path: Path) -> dict[str, Any]:
    """Load and validate one checkpoint file."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for truncated or foreign files
        # torch's UnpicklingError runs to a page of advice (load with weights_only=False)
        # that must not be taken for a file from elsewhere.
        detail = (
            "not data that torch.save wrote"
            if isinstance(exc, pickle.UnpicklingError)
            else f"{type(exc).__name__}: {first_line(exc)}"
        )
        raise CheckpointError(
            f"checkpoint {path} is corrupt or not a checkpoint ({detail})"
        ) from None
    if not isinstance(state, dict) or not set(state) >= REQUIRED:
        raise CheckpointError(f"{path} is not a checkpoint of this program (missing keys)")
    if state["format"] != FORMAT:
        raise CheckpointError(f"{path} has format {state['format']!r}, expected {FORMAT!r}")
    return state


def load_checkpoint(directory: Path) -> dict[str, Any]:
    """The newest loadable checkpoint in a folder: latest.pt, else previous.pt."""
    return newest_checkpoint(directory)[1]


def newest_checkpoint(directory: Path) -> tuple[Path, dict[str, Any]]:
    """The newest loadable checkpoint in a folder, and the file it came from."""
    candidates = [directory / LATEST, directory / PREVIOUS]
    problems = []
    if not any(path.is_file() for path in candidates):
        raise CheckpointError(f"--resume found no checkpoint in {directory}; start without it")
    for path in candidates:
        if not path.is_file():
            problems.append(f"{path.name} is missing")
            continue
        try:
            state = read_checkpoint(path)
        except CheckpointError as exc:
            log.warning("%s; trying the previous checkpoint", exc)
            problems.append(str(exc))
            continue
        if path.name == PREVIOUS:
            log.warning("resuming from %s because %s", path, problems[0])
        return path, state
    raise CheckpointError(
        f"no loadable checkpoint in {directory}: {'; '.join(problems)}; delete the folder to "
        "start over"
    )


def set_aside_damaged(directory: Path) -> None:
    """Rename a latest.pt that could not be loaded to latest.pt.damaged (kept for a look), so
    that the next checkpoint does not rotate it onto previous.pt, the only good one left."""
    latest = directory / LATEST
    if not latest.exists():
        return
    try:
        os.replace(latest, directory / DAMAGED)
    except OSError as exc:
        raise CheckpointError(
            f"could not move the damaged {latest} aside ({exc}); move it away by hand and "
            "resume again"
        ) from None
    log.warning("moved the damaged %s to %s", latest, DAMAGED)
