"""Checkpoints: `DIR/latest.pt` (and the one before it, `DIR/previous.pt`), and with
`--keep-checkpoints K` the K most recently written as `DIR/step-N.pt` too.

A checkpoint is a torch.save dict with `model` (a state_dict for `common.model.builtin`),
`optimizer`, `step`, `position` (epoch and data position), `rng`, `config` and `format`.

Writes survive a SIGKILL at any moment: the new file is written under a temporary name and
fsynced; then a hard link to the current `latest.pt` replaces `previous.pt` and the temporary
file replaces `latest.pt`, each by an atomic rename, and the folder is fsynced. At every
instant `latest.pt` is a complete checkpoint (where the file system has no hard links, the
current one is renamed instead, and for a moment only `previous.pt` exists). A kept
`step-N.pt` is a hard link to the new `latest.pt` (a copy where there are none), so it costs
no disk until `latest.pt` moves on; older ones past K are removed. The first write of a run
resumed from another file (`--resume-from`) makes that file `previous.pt`, so that the two
are the newest of one line of training, not one of each of two.

Every checkpoint carries a `checksum` of its tensors: torch's zip reader does not check its
records' CRCs, so a flipped byte on disk would otherwise load as silently different weights.
Loading checks the keys, the checksum and that the weights and momentum are finite, and falls
back to `previous.pt` when `latest.pt` is missing, truncated or fails a check. Loading uses
`weights_only=True`: a checkpoint is data, never code.
"""

import contextlib
import hashlib
import logging
import os
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from common.errors import CheckpointError, first_line
from common.finite import all_finite
from psserver.checkpoints.kept_steps import (
    kept_checkpoints,
    kept_name,
    link_or_copy,
    remove_past,
    same_file,
)
from psserver.checkpoints.write_failure import why_not_written

log = logging.getLogger("ps.server")
LATEST = "latest.pt"
PREVIOUS = "previous.pt"
DAMAGED = "latest.pt.damaged"
FORMAT = "ps-checkpoint/2"
REQUIRED = {"format", "model", "optimizer", "step", "position", "rng", "config"}
ZIP_MAGIC = b"PK\x03\x04"  # how every file torch.save writes begins


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def leaves(value: Any, name: str = "") -> Iterator[tuple[str, Any]]:
    """Every tensor and plain value in a nested state, with its path, in an order that does
    not depend on how the dicts were built."""
    if isinstance(value, dict):
        for key in sorted(value, key=repr):
            yield from leaves(value[key], f"{name}/{key!r}")
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from leaves(item, f"{name}/{index}")
    else:
        yield name, value


def tensor_bytes(state: dict[str, Any]) -> int:
    return sum(value.nbytes for _, value in leaves(state) if isinstance(value, torch.Tensor))


def checksum(state: dict[str, Any]) -> str:
    """A digest of every value, tensors by name, dtype, shape and bytes (about 0.1 s for
    ResNet-18)."""
    digest = hashlib.blake2b(digest_size=16)
    for name, value in leaves({k: v for k, v in state.items() if k != "checksum"}):
        if isinstance(value, torch.Tensor):
            flat = value.detach().cpu().contiguous().reshape(-1)
            digest.update(f"{name}:{flat.dtype}:{tuple(value.shape)};".encode())
            digest.update(flat.view(torch.uint8).numpy().data)  # no copy
        else:
            digest.update(f"{name}={value!r};".encode())
    return digest.hexdigest()


def save_checkpoint(
    directory: Path, state: dict[str, Any], keep: int = 0, previous_from: Path | None = None
) -> Path:
    """Write `state` as DIR/latest.pt (the old one becomes previous.pt) and, when `keep` > 0,
    as DIR/step-N.pt too, removing kept files past the `keep` most recently written.

    `previous_from`: the checkpoint this state was trained from, when it is not latest.pt (the
    first write after a --resume-from): it becomes previous.pt, and the old latest.pt, of the
    run gone back from, is replaced."""
    latest, previous = directory / LATEST, directory / PREVIOUS
    if previous_from is not None and not previous_from.is_file():  # removed since the resume
        previous_from = None
    temporary = directory / f".{LATEST}.tmp-{os.getpid()}"
    state = {"format": FORMAT, **state}
    state["checksum"] = checksum(state)
    writing = latest
    try:
        directory.mkdir(parents=True, exist_ok=True)
        _remove_stale_temporaries(directory, temporary)
        with open(temporary, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        if previous_from is None and latest.exists():
            _rotate(latest, previous)
        os.replace(temporary, latest)
        if previous_from is not None:  # after: a crash between leaves the new latest.pt
            writing = previous
            link_or_copy(previous_from, previous)
        if keep > 0:
            writing = directory / kept_name(int(state["step"]))
            link_or_copy(latest, writing)
            remove_past(directory, keep, writing)
        _fsync_dir(directory)  # make the renames themselves durable
    # torch.save raises RuntimeError, not OSError, when the disk fills up under it.
    except (OSError, RuntimeError) as exc:
        with contextlib.suppress(OSError):  # the folder itself may be what went away
            temporary.unlink(missing_ok=True)
        raise CheckpointError(
            f"could not write checkpoint {writing}: "
            f"{why_not_written(directory, tensor_bytes(state), exc, directory / LATEST)}"
        ) from None
    except BaseException:  # Ctrl-C or SIGTERM mid-write: the process ends, the file must not stay
        with contextlib.suppress(OSError):
            temporary.unlink(missing_ok=True)
        raise
    return latest


def _rotate(latest: Path, previous: Path) -> None:
    """Make the current latest.pt previous.pt too, while latest.pt stays where it is."""
    if same_file(previous, latest):
        return
    linked = latest.with_name(f".{PREVIOUS}.tmp-{os.getpid()}")
    try:
        linked.unlink(missing_ok=True)
        os.link(latest, linked)
    except OSError:  # no hard links here: a moment with previous.pt only
        os.replace(latest, previous)
        return
    os.replace(linked, previous)


def _remove_stale_temporaries(directory: Path, ours: Path) -> None:
    """Half-written files of a process that died mid-write (a full disk, a SIGKILL): they
    would keep the disk full after a --resume."""
    for stale in directory.glob(".*.pt.tmp-*"):
        if stale != ours:
            with contextlib.suppress(OSError):
                stale.unlink()


def read_checkpoint(path: Path) -> dict[str, Any]:
    """Load and validate one checkpoint file."""
    if (foreign := _not_a_zip(path)) is not None:  # torch's errors for these vary
        raise CheckpointError(f"checkpoint {path} is corrupt or not a checkpoint ({foreign})")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for truncated or foreign files
        # torch's UnpicklingError runs to a page of advice (load with weights_only=False)
        # that must not be taken for a file from elsewhere.
        if isinstance(exc, pickle.UnpicklingError):
            detail = "not data that torch.save wrote"
        elif "PytorchStreamReader" in str(exc):  # torch's zip reader: miniz's words
            detail = "cut short or damaged: its zip archive cannot be read"
        else:
            detail = f"{type(exc).__name__}: {first_line(exc)}"
        raise CheckpointError(
            f"checkpoint {path} is corrupt or not a checkpoint ({detail})"
        ) from None
    if not isinstance(state, dict) or not set(state) >= REQUIRED:
        raise CheckpointError(f"{path} is not a checkpoint of this program (missing keys)")
    if state["format"] != FORMAT:
        raise CheckpointError(f"{path} has format {state['format']!r}, expected {FORMAT!r}")
    _check_contents(path, state)
    return state


def _not_a_zip(path: Path) -> str | None:
    """Why the file cannot be the zip archive torch.save writes, or None when it starts like
    one (a truncated one too: torch says what is missing)."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError:
        return None  # torch.load says why
    if not head:
        return "the file is empty"
    return None if head == ZIP_MAGIC else "not a file that torch.save wrote"


def peek(path: Path) -> dict[str, Any] | None:
    """A checkpoint's step and config, without reading its tensors (they are mapped, not
    read) or checking it; None where it cannot be read."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        step, config = state["step"], state["config"]
    except Exception:  # damaged or foreign: the caller goes on without knowing
        return None
    if type(step) is not int or not isinstance(config, dict):
        return None
    return {"step": step, "config": config}


def _check_contents(path: Path, state: dict[str, Any]) -> None:
    """What unpickling cannot tell: damaged bytes, weights that are not numbers, and fields
    of the wrong kind (an edited file)."""
    for key, kind in (("config", dict), ("position", dict), ("model", dict)):
        if not isinstance(state[key], kind):
            raise CheckpointError(f"checkpoint {path} is corrupt ({key} is not a {kind.__name__})")
    if type(state["step"]) is not int or state["step"] < 0:
        raise CheckpointError(f"checkpoint {path} is corrupt (step {state['step']!r})")
    # Checkpoints from before the checksum have none; they are read as they are.
    if "checksum" in state and state["checksum"] != checksum(state):
        raise CheckpointError(
            f"checkpoint {path} is corrupt (its contents do not match its checksum: the file "
            "was damaged on disk or in a copy)"
        )
    name = first_not_finite(state)
    if name is not None:
        raise CheckpointError(
            f"checkpoint {path} holds values that are not finite (in {name}); the run it "
            "saved had diverged or the file was edited"
        )


def first_not_finite(state: dict[str, Any]) -> str | None:
    """Where the first NaN or infinity in a state's weights or optimizer is; None if none
    is. Checked before a checkpoint is written, and when one is read."""
    for name, value in leaves({"model": state["model"], "optimizer": state["optimizer"]}):
        tensor = isinstance(value, torch.Tensor) and value.is_floating_point()
        if tensor and not all_finite(value):
            return name
    return None


def load_checkpoint(directory: Path) -> dict[str, Any]:
    """The newest loadable checkpoint in a folder (see newest_checkpoint)."""
    return newest_checkpoint(directory)[1]


def newest_checkpoint(directory: Path) -> tuple[Path, dict[str, Any]]:
    """The newest loadable checkpoint in a folder, and the file it came from: latest.pt,
    else previous.pt, else the kept step-N.pt, the most recently written first (skipping
    those that are the same file as one refused already)."""
    named = [directory / LATEST, directory / PREVIOUS]
    kept = [path for _, path in reversed(kept_checkpoints(directory))]
    if not any(path.is_file() for path in named + kept):
        raise CheckpointError(f"--resume found no checkpoint in {directory}; start without it")
    problems: list[str] = []
    refused: list[Path] = []
    for path in named + kept:
        if not path.is_file():
            problems.append(f"{path.name} is missing")
            continue
        if any(same_file(path, other) for other in refused):
            continue
        try:
            state = read_checkpoint(path)
        except CheckpointError as exc:
            log.warning(
                "%s; trying %s",
                exc,
                "the previous checkpoint" if path.name == LATEST else "an older one",
            )
            problems.append(str(exc))
            refused.append(path)
            continue
        if path.name != LATEST:
            log.warning("resuming from %s because %s", path, "; ".join(problems))
        return path, state
    raise CheckpointError(
        f"no loadable checkpoint in {directory}: {'; '.join(problems)}; to start over, move "
        "the folder aside (the damaged files may still be worth a look) or give another "
        "--checkpoint-dir"
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
