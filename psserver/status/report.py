"""Training statistics the server keeps, the step log, and the run summary (JSON)."""

import dataclasses
import json
import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from common.metrics import MetricsWriter, RateWindow
from psserver.checkpoints.history import RunHistory
from psserver.evaluation import Evaluation

log = logging.getLogger("ps.server")
LOG_INTERVAL_S = 2.0
# Pushes per worker that the steady rate leaves out: the first pulls the whole model, and
# the first steps pay for allocation and kernel selection. ps-bench times its DDP and
# single-process baselines after as many steps.
WARMUP_STEPS = 2


@dataclasses.dataclass
class TrainingMeter:
    """Loss, accuracy and throughput over the training pushes, for the log and the summary.

    Its counts are this session's; `earlier` holds those of the sessions before a --resume,
    and `totals` adds the two."""

    started: float | None = None  # when the last worker registered and training began
    finished: float | None = None
    samples: int = 0
    pushes: int = 0
    push_bytes: int = 0  # tensor bytes received in applied pushes (compression shows here)
    streamed_bytes: int = 0  # updated buckets sent ahead of the pull (psserver.serving.streaming)
    streamed_pulls: int = 0  # pulls answered without parameters: the worker had them already
    # The same two counts for the follower shards (psserver.shards.leader), as they last reported.
    follower_push_bytes: int = 0
    follower_streamed_bytes: int = 0
    window_loss: float = 0.0
    window_correct: int = 0
    window_samples: int = 0
    window_started: float = dataclasses.field(default_factory=time.monotonic)
    evaluations: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    warmup_pushes: int = 0  # pushes before the steady rate's clock starts
    warm_started: float | None = None  # when the last warm-up push came
    warm_samples: int = 0  # samples up to and including it
    earlier: RunHistory = dataclasses.field(default_factory=RunHistory)

    def start(self) -> None:
        self.started = time.monotonic()
        self.window_started = self.started

    def record_push(self, samples: int, loss_sum: float, correct: int, nbytes: int = 0) -> None:
        self.samples += samples
        self.pushes += 1
        if self.pushes == self.warmup_pushes:
            self.warm_started, self.warm_samples = time.monotonic(), self.samples
        self.push_bytes += nbytes
        self.window_loss += loss_sum
        self.window_correct += correct
        self.window_samples += samples

    def retract_push(self, samples: int, loss_sum: float, correct: int, nbytes: int) -> None:
        """Take back a push that was booked but never applied (its step was abandoned)."""
        self.samples -= samples
        self.pushes -= 1
        self.push_bytes -= nbytes
        if self.window_samples >= samples:  # not logged yet (else the log line has it)
            self.window_loss -= loss_sum
            self.window_correct -= correct
            self.window_samples -= samples

    def maybe_log(self, version: int, epoch: int, force: bool = False) -> None:
        now = time.monotonic()
        elapsed = now - self.window_started
        if self.window_samples == 0 or (elapsed < LOG_INTERVAL_S and not force):
            return
        log.info(
            "step %d epoch %d: train loss %.4f, train acc %.3f, %.1f img/s",
            version,
            epoch,
            self.window_loss / self.window_samples,
            self.window_correct / self.window_samples,
            self.window_samples / max(elapsed, 1e-9),
        )
        self.window_loss, self.window_correct, self.window_samples = 0.0, 0, 0
        self.window_started = now

    def record_evaluation(self, epoch: int, version: int, result: Evaluation) -> None:
        self.evaluations.append(
            {
                "epoch": epoch,
                "step": version,
                "test_accuracy": result.accuracy,
                "test_loss": result.loss,
            }
        )

    @property
    def wall_seconds(self) -> float:
        if self.started is None:
            return 0.0
        return self._end() - self.started

    @property
    def images_per_second(self) -> float:
        wall = self.wall_seconds
        return self.samples / wall if wall > 0 else 0.0

    @property
    def steady_images_per_second(self) -> float | None:
        """Images/s after the warm-up pushes; None until a push has come after them."""
        if self.warm_started is None or self.samples == self.warm_samples:
            return None
        wall = self._end() - self.warm_started
        return (self.samples - self.warm_samples) / wall if wall > 0 else None

    def _end(self) -> float:
        """When training finished, or now while it goes on."""
        return self.finished or time.monotonic()

    def totals(self, staleness: Mapping[int, int]) -> RunHistory:
        """The whole run's counts up to now, this session's included. `staleness` is the
        policy's histogram, which a resume already restored to the run's."""
        earlier = self.earlier
        evaluated = {e["step"] for e in earlier.evaluations}
        # A resumed run that was already over evaluates the same weights again: once is enough.
        fresh = tuple(e for e in self.evaluations if e["step"] not in evaluated)
        return RunHistory(
            sessions=earlier.sessions + 1,
            samples=earlier.samples + self.samples,
            pushes=earlier.pushes + self.pushes,
            push_bytes=earlier.push_bytes + self.push_bytes + self.follower_push_bytes,
            streamed_bytes=(
                earlier.streamed_bytes + self.streamed_bytes + self.follower_streamed_bytes
            ),
            streamed_pulls=earlier.streamed_pulls + self.streamed_pulls,
            wall_seconds=earlier.wall_seconds + self.wall_seconds,
            evaluations=earlier.evaluations + fresh,
            staleness=dict(staleness),
            resumed_at_step=earlier.resumed_at_step,
        )


class UpdateRecorder:
    """The server's `--log-dir` metrics: one `update` record per applied update, one `eval`
    record per evaluation, and a `resume` record at the step a resumed run goes on from
    (see common.metrics). A no-op without a log dir."""

    def __init__(self, log_dir: Path | None, mode: str, model: str) -> None:
        self.writer = MetricsWriter(log_dir, "server", job={"mode": mode, "model": model})
        self.rate = RateWindow()
        self._last_update = time.monotonic()
        self._loss, self._correct, self._samples = 0.0, 0, 0  # pushes since the last update

    def start(self, step: int, epoch: int, resumed: bool) -> None:
        """Training starts at version `step`; `resumed`: from a checkpoint, whose later steps
        the file may hold from before (ps-plot leaves those out: they are trained again)."""
        if resumed:
            self.writer.write("resume", step, epoch)
        self.rate.restart()
        self._last_update = time.monotonic()

    def record_push(self, samples: int, loss_sum: float, correct: int) -> None:
        self._loss += loss_sum
        self._correct += correct
        self._samples += samples

    def discard_pending(self) -> None:
        """Forget the pushes since the last update: their step was abandoned."""
        self._loss, self._correct, self._samples = 0.0, 0, 0

    def record_update(self, step: int, epoch: int, staleness: int, workers: list[int]) -> None:
        """`step` is the version after the update; the pushes recorded since the last one
        are its gradients (one in async mode, one per worker in sync mode)."""
        if self.writer.enabled:
            now, samples = time.monotonic(), max(self._samples, 1)
            self.writer.write(
                "update",
                step,
                epoch,
                train_loss=self._loss / samples,
                train_accuracy=self._correct / samples,
                samples=self._samples,
                images_per_s=self.rate.add(self._samples),
                step_time_s=now - self._last_update,  # evaluations and checkpoints included
                staleness=staleness,
                workers=workers,
            )
            self._last_update = now
        self._loss, self._correct, self._samples = 0.0, 0, 0

    def record_evaluation(self, step: int, epoch: int, result: Evaluation) -> None:
        self.writer.write(
            "eval",
            step,
            epoch,
            test_accuracy=result.accuracy,
            test_loss=result.loss,
            test_samples=result.samples,
        )
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def build_summary(
    *,
    config: dict[str, Any],
    meter: TrainingMeter,
    final: Evaluation,
    global_steps: int,
    epochs: int,
    workers: list[dict[str, Any]],
    abandoned_epochs: int = 0,
    staleness: dict[str, Any] | None,
    retired_workers: dict[str, Any] | None = None,
    staleness_counts: Mapping[int, int] | None = None,
) -> dict[str, Any]:
    """The run summary. After a --resume its counts, rates and evaluations are the whole
    run's (see psserver.checkpoints.history); `this_session` has the resumed session's own."""
    run = meter.totals(staleness_counts or {})
    summary: dict[str, Any] = {
        "mode": config["mode"],
        "workers": config["workers"],  # --workers: how many the job waits for to start
        # How many took part: a worker that joins later trains too ("workers": 2 for a job
        # three trained read as if the third had not). This session's, as per_worker is.
        # Retired records (folded after thousands of registrations) count one each: their
        # processes are not kept, which is the point of folding them.
        "workers_trained": count_workers_trained(workers)
        + (int(retired_workers["trained"]) if retired_workers else 0),
        "model": config["model"],
        "dataset": config["dataset"],
        "batch_size_per_worker": config["batch_size"],
        "global_steps": global_steps,
        "epochs": epochs,  # ended, abandoned_epochs among them
        "abandoned_epochs": abandoned_epochs,
        "test_accuracy": final.accuracy,
        "test_loss": final.loss,
        "test_samples": final.samples,
        "train_samples_processed": run.samples,
        "wall_seconds": run.wall_seconds,
        "images_per_second": run.samples / run.wall_seconds if run.wall_seconds > 0 else 0.0,
        # This session's rate after every worker's first WARMUP_STEPS pushes (null in a
        # shorter session).
        "steady_images_per_second": meter.steady_images_per_second,
        "warmup_pushes": meter.warmup_pushes,
        "compress": config["compress"],
        "push_bytes": run.push_bytes,
        "push_bytes_per_push": run.push_bytes / run.pushes if run.pushes else 0.0,
        "streamed_bytes": run.streamed_bytes,
        "streamed_pulls": run.streamed_pulls,
        "evaluations": list(run.evaluations),
        "sessions": run.sessions,
        "per_worker": workers,  # this session's workers
        "evaluated_by": f"ps-server on {config['eval_device']}",
        "config": config,
    }
    if run.resumed_at_step is not None:
        summary["this_session"] = {
            "resumed_at_step": run.resumed_at_step,
            "train_samples_processed": meter.samples,
            "wall_seconds": meter.wall_seconds,
            "images_per_second": meter.images_per_second,
        }
    if staleness is not None:
        summary["staleness"] = staleness
    if retired_workers is not None:  # finished workers not listed in per_worker, in total
        summary["retired_workers"] = retired_workers
    return summary


def count_workers_trained(workers: list[dict[str, Any]]) -> int:
    """How many of `workers` (per_worker's rows) pushed a gradient the server took, a worker
    that registered more than once counted once."""
    # A worker the server forgot (declared dead while paused or cut off) registers again and
    # gets a new record: a second row. It sends the same REGISTER.process, the random identity
    # its process drew at start (psworker.connection.registration), as
    # psserver.coordinator.admission knows one that asks again. Host, pid, name and device would not
    # do: containers on the host's network, each with its worker as pid 1 on a GPU it sees as
    # cuda:0, are alike in all four. A worker restarted as a new process draws a new identity and
    # counts again.
    processes = {w["process"] for w in workers if w["pushes"]}
    return len(processes)


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    temporary.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(temporary, path)


def holds_a_summary(path: Path) -> bool:
    """Whether `path` holds a run summary (a JSON object), not an empty or broken file that
    a finished run's summary must not be kept in place of."""
    try:
        return isinstance(json.loads(path.read_text()), dict)
    except (OSError, ValueError):
        return False
