"""The whole model at rest: evaluation on the test set, checkpoints (and which of them a
resumed run's line goes on from), and the run summary.

With server shards, the leader holds only its own slice up to date; before it evaluates or
writes a checkpoint it gathers the other slices (and their momentum), so a checkpoint is the
same whatever the number of shards, and `--resume` works with another number.

What this is not: loading the checkpoint a run resumes from, and its checks
(psserver.checkpoints.resume).
"""

import logging
import time
from pathlib import Path
from typing import Any

import torch

from common.data import ImageSet
from common.errors import PSError, TrainingDiverged
from common.logs import counted
from psserver.checkpoints.directory import divergence_advice, step_of_another_line
from psserver.checkpoints.files import (
    LATEST,
    PREVIOUS,
    first_not_finite,
    save_checkpoint,
    set_aside_damaged,
)
from psserver.checkpoints.kept_steps import kept_checkpoints
from psserver.checkpoints.resume import load_resume_checkpoint
from psserver.config import ServerConfig
from psserver.evaluation import Evaluation, evaluate_on
from psserver.policies import AsyncPolicy, UpdatePolicy
from psserver.shards.leader import ShardGroup
from psserver.status.report import (
    TrainingMeter,
    UpdateRecorder,
    build_summary,
    holds_a_summary,
    write_json,
)
from psserver.store.parameters import ParameterStore

log = logging.getLogger("ps.server")


class WholeModel:
    def __init__(
        self,
        config: ServerConfig,
        store: ParameterStore,
        policy: UpdatePolicy,
        shards: ShardGroup | None,
        test_set: ImageSet,
        meter: TrainingMeter,
        recorder: UpdateRecorder,
    ) -> None:
        self.config, self.store, self.policy, self.shards = config, store, policy, shards
        self.test_set, self.meter, self.recorder = test_set, meter, recorder
        self.last_eval: tuple[int, Evaluation] | None = None
        self.checkpointed = -1  # the step of the last checkpoint written
        self.held: dict[str, int] = {}  # checkpoint file -> its step, where this run knows it
        # The --resume-from file, (path, step), until this run's first checkpoint makes it
        # previous.pt.
        self.resumed_from: tuple[Path, int] | None = None
        self.written_at: float | None = None  # time.monotonic() of this run's last write
        self.eval_device = torch.device(config.eval_device)  # the CPU after it failed

    def evaluate(self, label: str) -> Evaluation:
        """Test accuracy and loss of the current weights (once per version)."""
        if self.last_eval is not None and self.last_eval[0] == self.store.version:
            return self.last_eval[1]
        started = time.monotonic()
        if self.shards is not None:
            self.shards.gather(self.store, with_momentum=False)
            self._count_follower_bytes()
        result, self.eval_device = evaluate_on(self.store.model, self.test_set, self.eval_device)
        self.last_eval = (self.store.version, result)
        self.meter.record_evaluation(self.policy.completed_epochs, self.store.version, result)
        self.recorder.record_evaluation(self.store.version, self.policy.completed_epochs, result)
        log.info(
            "%s (step %d): test accuracy %.4f, test loss %.4f on %s (%.1f s)",
            label,
            self.store.version,
            result.accuracy,
            result.loss,
            counted(result.samples, "image"),
            time.monotonic() - started,
        )
        return result

    def save_checkpoint(self) -> None:
        assert self.config.checkpoint_dir is not None
        momentum = None
        if self.shards is not None:
            momentum = self.shards.gather(self.store, with_momentum=True)
            self._count_follower_bytes()
        state = self.store.state_dict(momentum)
        self._refuse_non_finite(state)
        path = save_checkpoint(
            self.config.checkpoint_dir,
            {
                "model": state["model"],
                "optimizer": state["optimizer"],
                "step": self.store.version,
                "position": self.policy.position(),
                "rng": torch.get_rng_state(),
                "fingerprint": state["fingerprint"],
                "config": self.config.to_dict(),
                # The data position is a place in a permutation of this many samples.
                "train_size": self.policy.job.train_size,
                "history": self.meter.totals(self._staleness_counts()).to_checkpoint(),
            },
            keep=self.config.keep_checkpoints,
            previous_from=self.resumed_from[0] if self.resumed_from is not None else None,
        )
        self.checkpointed, self.written_at = self.store.version, time.monotonic()
        if self.resumed_from is not None:
            self.held[PREVIOUS] = self.resumed_from[1]
            self.resumed_from = None
        elif LATEST in self.held:  # save_checkpoint rotated it
            self.held[PREVIOUS] = self.held[LATEST]
        self.held[LATEST] = self.store.version
        log.info("checkpoint at step %d written to %s", self.store.version, path)

    def checkpoint_status(self, now: float) -> dict[str, Any] | None:
        """The live status's `checkpoints`: where they go, and the newest one; None without
        --checkpoint-dir."""
        directory = self.config.checkpoint_dir
        if directory is None:
            return None
        return {
            "dir": str(directory),
            "every": self.config.checkpoint_every,
            "step": self.held.get(LATEST),  # None: none yet (or none this run can vouch for)
            "age_s": None if self.written_at is None else round(now - self.written_at, 3),
            "kept": len(kept_checkpoints(directory)) if self.config.keep_checkpoints else 0,
        }

    def _refuse_non_finite(self, state: dict[str, Any]) -> None:
        """Weights that overflowed (finite gradients, a learning rate far too high) make a
        checkpoint no --resume can load, and writing it would push the last good one out."""
        name = first_not_finite(state)
        if name is not None:
            raise TrainingDiverged(
                f"training diverged: after step {self.store.version} the weights hold values "
                f"that are not finite (in {name}), so the job stops without a checkpoint of "
                f"them, which no --resume could load. {self.divergence_advice()}"
            )

    def divergence_advice(self) -> str:
        """What to do about a run whose current weights diverged, with the checkpoints left."""
        return divergence_advice(self.config, self.held, self.store.version)

    def resume(self) -> None:
        """Load the checkpoint to resume from (psserver.checkpoints.resume), and make this run's
        checkpoints follow on from it."""
        path, epoch = load_resume_checkpoint(
            self.config, self.store, self.policy, self.shards, self.meter
        )
        directory = self.config.checkpoint_dir
        if directory is not None:
            self._continue_the_line(directory, path)
        elif not self.policy.finished():
            log.warning(
                "no --checkpoint-dir: this run goes on from %s but writes no checkpoints, so "
                "a stop loses every step after %d; give --checkpoint-dir DIR to keep them",
                path, self.store.version,
            )  # fmt: skip
        log.info("resumed from %s at step %d, epoch %d", path, self.store.version, epoch)

    def _continue_the_line(self, directory: Path, path: Path) -> None:
        """Make this run's checkpoints follow on from `path`, the one it resumed from."""
        version = self.store.version
        if path.resolve() == (directory / LATEST).resolve():
            # A run that trains no further must not write it again, which would push the
            # previous checkpoint out.
            self.held, self.checkpointed = {LATEST: version}, version
        elif self.config.resume_from is None:
            # --resume fell back on previous.pt or a kept file, latest.pt being damaged: set
            # it aside, so that no write rotates it onto previous.pt. The run writes its own
            # latest.pt at the end, even if it trains nothing.
            set_aside_damaged(directory)
            if path.name == PREVIOUS:
                self.held = {PREVIOUS: version}
            else:  # the first write makes it previous.pt (see save_checkpoint)
                self.resumed_from = (path, version)
        else:
            # --resume-from FILE: the first write makes FILE previous.pt; a run that trains
            # nothing writes nothing.
            self.resumed_from, self.checkpointed = (path, version), version
            replaced = step_of_another_line(directory, path, self.config)
            if replaced is not None and not self.policy.finished():
                is_previous = path.resolve() == (directory / PREVIOUS).resolve()
                log.warning(
                    "this run's first checkpoint will replace %s (step %d) and %s; copy "
                    "latest.pt elsewhere now to keep it", directory / LATEST, replaced,
                    "keep previous.pt" if is_previous else f"make {path} previous.pt",
                )  # fmt: skip

    def _count_follower_bytes(self) -> None:
        """The followers' traffic, up to date after a gather: the summary and a checkpoint's
        history count every shard's bytes, not only the leader's slice."""
        assert self.shards is not None
        pushed, streamed = self.shards.follower_bytes()
        self.meter.follower_push_bytes, self.meter.follower_streamed_bytes = pushed, streamed

    def _staleness_counts(self) -> dict[int, int]:
        return dict(self.policy.staleness) if isinstance(self.policy, AsyncPolicy) else {}

    def summarize(
        self,
        final: Evaluation,
        workers: list[dict[str, Any]],
        retired_workers: dict[str, Any] | None = None,
        keep_existing: bool = False,
    ) -> dict[str, Any]:
        """The run summary (written to --summary), once every worker has heard STOP.

        `keep_existing`: this run trained nothing (it resumed a run that was over), so a
        summary already at --summary, that of the run itself, is worth more than this one."""
        policy = self.policy
        staleness = policy.staleness_summary() if isinstance(policy, AsyncPolicy) else None
        summary = build_summary(
            config=self.config.to_dict(),
            meter=self.meter,
            final=final,
            global_steps=self.store.version,
            epochs=policy.completed_epochs,
            abandoned_epochs=policy.abandoned_epochs,
            workers=workers,
            staleness=staleness,
            retired_workers=retired_workers,
            staleness_counts=self._staleness_counts(),
        )
        if (
            keep_existing
            and self.config.summary is not None
            and holds_a_summary(self.config.summary)
        ):
            log.info("kept %s: this run trained nothing", self.config.summary)
        elif self.config.summary is not None:
            try:
                write_json(self.config.summary, summary)
            except OSError as exc:  # checked at start-up; the disk may have filled since
                raise PSError(
                    f"could not write the summary to {self.config.summary} ({exc}); the "
                    f"job itself finished: {counted(summary['global_steps'], 'step')}, test "
                    f"accuracy {summary['test_accuracy']:.4f}"
                ) from None
            log.info("summary written to %s", self.config.summary)
        return summary
