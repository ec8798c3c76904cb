"""What a --checkpoint-dir holds, for the person deciding where to go on from: the steps of
its checkpoints (latest.pt, previous.pt, the kept step-N.pt), what to do when a run diverged,
and whether a --resume-from into it would replace another job's checkpoints."""

from pathlib import Path
from typing import Any

from common.errors import PSError
from psserver.checkpoints.files import LATEST, PREVIOUS, peek
from psserver.checkpoints.kept_steps import kept_checkpoints, same_file
from psserver.config import ServerConfig

# A checkpoint of another job when any differs: the same options that --resume must match.
SAME_JOB = ("model", "mode", "batch_size", "dataset", "train_limit", "seed")


def differing_field(saved: dict[str, Any], config: ServerConfig) -> str | None:
    """The first of SAME_JOB in which a checkpoint's config (`saved`) and this job differ:
    the checkpoint is another job's. None when it is this job's."""
    return next((key for key in SAME_JOB if saved.get(key) != getattr(config, key)), None)


def checkpoint_steps(directory: Path, known: dict[str, int]) -> dict[str, int]:
    """Every checkpoint in the folder and its step: `known` (latest.pt and previous.pt where
    this run knows their steps), the kept step-N.pt, and latest.pt or previous.pt read for
    their step where this run does not know it (one it did not write)."""
    steps = {path.name: step for step, path in kept_checkpoints(directory)}
    for name in (LATEST, PREVIOUS):
        if name in known:
            steps[name] = known[name]
        elif (directory / name).is_file() and (peeked := peek(directory / name)) is not None:
            steps[name] = peeked["step"]
    return steps


def divergence_advice(config: ServerConfig, held: dict[str, int], diverged_at: int) -> str:
    """What to do about a run whose weights at step `diverged_at` diverged: the usual cause,
    and the checkpoints from before that step to go on from."""
    cause = (
        f"The usual cause is a learning rate too high for the batch (this job: --lr "
        f"{config.lr:g}, --momentum {config.momentum:g}, batch {config.batch_size} per worker)"
    )
    directory = config.checkpoint_dir
    steps = {} if directory is None else checkpoint_steps(directory, held)
    before = sorted((step, name) for name, step in steps.items() if step < diverged_at)
    later = " and ".join(sorted(name for name, step in steps.items() if step >= diverged_at))
    gone_bad = (
        f"; {later}: step {diverged_at} or later, after the weights diverged" if later else ""
    )
    if not before:
        return f"{cause}; start again with a lower --lr{gone_bad}"
    listed = " and ".join(f"{name} (step {step})" for step, name in before)
    more = "" if config.keep_checkpoints else " (--keep-checkpoints K keeps K more, next time)"
    return (
        f"{cause}; start again with a lower --lr, or go on with a lower --lr from a checkpoint "
        f"from before the train loss grew: {directory} holds {listed}{gone_bad}; go on from "
        f"one with --resume-from {directory}/FILE{more}"
    )


def step_of_another_line(directory: Path, resumed: Path, config: ServerConfig) -> int | None:
    """For --resume-from `resumed` into `directory`: the step of the folder's latest.pt, which
    this run's first checkpoint will replace (None when there is none, or it is `resumed`
    itself, or it cannot be read). Refuses a folder that holds another job's checkpoints."""
    latest = directory / LATEST
    if not latest.is_file() or same_file(latest, resumed):
        return None
    theirs = peek(latest)
    if theirs is None:
        return None
    saved: dict[str, Any] = theirs["config"]
    if (key := differing_field(saved, config)) is not None:
        raise PSError(
            f"--checkpoint-dir {directory} holds the checkpoints of another job (its "
            f"{key}={saved.get(key)!r}, this job's {key}={getattr(config, key)!r}), which "
            "this run's checkpoints would replace; give another --checkpoint-dir"
        )
    return int(theirs["step"])
