"""Loading a checkpoint into a run that starts with `--resume` or `--resume-from`: the checks
that it fits this run, then the weights, momentum, data position, RNG and run history put back
into the store, the shards, the policy and the meter.

What this is not: which checkpoints the run writes afterwards, nor which of them it keeps
(psserver.checkpoints.whole_model continues the line from the file loaded here), nor reading the
file itself (psserver.checkpoints.files).
"""

import logging
from pathlib import Path
from typing import NamedTuple

import torch

from common.compression import CompressionSpec
from common.errors import CheckpointError, ConfigError, PSError, first_line
from psserver.checkpoints.directory import differing_field
from psserver.checkpoints.files import newest_checkpoint, read_checkpoint
from psserver.checkpoints.history import RunHistory
from psserver.config import ServerConfig
from psserver.policies import AsyncPolicy, UpdatePolicy
from psserver.shards.leader import ShardGroup
from psserver.status.report import TrainingMeter
from psserver.store.parameters import ParameterStore

log = logging.getLogger("ps.server")
# May change on resume (a lower lr to fine-tune, say), but not unnoticed: an option left out
# of the resuming command line takes its default, not the checkpoint's run's value.
RESUME_MAY_CHANGE = ("lr", "momentum", "weight_decay", "compress", "staleness", "staleness_lr")


class ResumePoint(NamedTuple):
    path: Path  # the checkpoint file loaded
    epoch: int  # the epoch it resumes in


def load_resume_checkpoint(
    config: ServerConfig,
    store: ParameterStore,
    policy: UpdatePolicy,
    shards: ShardGroup | None,
    meter: TrainingMeter,
) -> ResumePoint:
    """Load --resume-from FILE, or DIR/latest.pt (previous.pt where that is damaged), into
    the store, the policy and the shards, and its run's history into the meter."""
    if config.resume_from is not None:
        path, state = config.resume_from, read_checkpoint(config.resume_from)
    else:
        assert config.checkpoint_dir is not None
        path, state = newest_checkpoint(config.checkpoint_dir)
    saved = state["config"]
    if (key := differing_field(saved, config)) is not None:
        raise PSError(
            f"cannot resume: the checkpoint was made with {key}={saved.get(key)!r}, this "
            f"run has {key}={getattr(config, key)!r}; use the same options"
        )
    check_train_size(state.get("train_size"), policy.job.train_size)
    for key in RESUME_MAY_CHANGE:
        if key in saved and saved[key] != getattr(config, key):
            log.warning(
                "resuming with %s=%r; the checkpoint's run had %s=%r (pass the same option "
                "to keep it)", key, getattr(config, key), key, saved[key],
            )  # fmt: skip
    try:
        momentum = store.load_state_dict(
            {"model": state["model"], "optimizer": state["optimizer"], "version": state["step"]}
        )
        if shards is not None:
            shards.resume_momentum(momentum)
        policy.restore(state["position"])
        torch.set_rng_state(state["rng"])
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise CheckpointError(
            f"the checkpoint {path} does not fit this model or this release "
            f"({type(exc).__name__}: {first_line(exc)}); start without --resume or use "
            "another --checkpoint-dir"
        ) from None
    warn_of_lost_residuals(str(saved.get("compress", config.compress)))
    # The summary counts the whole run: the sessions before this one, up to the checkpoint.
    meter.earlier = RunHistory.from_checkpoint(state.get("history"), state["step"])
    if isinstance(policy, AsyncPolicy):
        policy.staleness.update(meter.earlier.staleness)
    return ResumePoint(path, state["position"]["epoch"])


def warn_of_lost_residuals(compress: str) -> None:
    """Top-k's error feedback keeps, on each worker, the part of every gradient it has not
    sent yet. That residual lives in the worker's compressor, not in the server's checkpoint,
    so the workers of a resumed run start with none: what it held when the run stopped is
    never applied, and the run does not end where an uninterrupted one would. (topk:1 sends
    everything and keeps no residual.)"""
    try:
        spec = CompressionSpec.parse(compress)
    except ConfigError:  # not this run's option: the checkpoint's, which its run accepted
        return
    if spec.kind == "topk" and spec.ratio < 1:
        log.warning(
            "resuming a --compress %s run: the workers' top-k residuals (the gradient each had "
            "not sent yet) are not part of the checkpoint, so the resumed workers start them "
            "empty. The weights, momentum, data position and RNG are restored, but this run "
            "will not end with the same weights, to the bit, as one that was never stopped",
            compress,
        )


def check_train_size(saved: object, here: int) -> None:
    """A data position means nothing in another set: the same --dataset and --train-limit
    can still name a folder of another size (another copy, another release)."""
    if saved is None:  # a checkpoint from a release that did not record it
        log.warning("the checkpoint does not record its training-set size; assuming %d", here)
    elif saved != here:
        raise PSError(
            f"cannot resume: the checkpoint's run trained on {saved} images, this run's "
            f"training set has {here}; use the same data (--data-dir, --train-limit) or "
            "start without --resume"
        )
