"""Worker progress: a tqdm bar on a terminal, or periodic log lines when output is piped."""

import dataclasses
import logging
import sys
import time

from tqdm import tqdm

log = logging.getLogger("ps.worker")
LOG_INTERVAL_S = 5.0


class Progress:
    def __init__(self, mode: str, total_steps: int, label: str) -> None:
        if mode == "auto":
            mode = "bar" if sys.stderr.isatty() else "log"
        self.mode, self.total, self.label = mode, total_steps, label
        self._bar = (
            tqdm(total=total_steps, desc=label, unit="step", dynamic_ncols=True)
            if mode == "bar"
            else None
        )
        self._started = self._window_started = time.monotonic()
        self._window_samples, self._window_loss, self._steps = 0, 0.0, 0
        self._first_line = True

    def set_total(self, total_steps: int) -> None:
        """The job's steps, counted again (a sync epoch cut for more or fewer workers)."""
        if total_steps == self.total:
            return
        self.total = total_steps
        if self._bar is not None:
            self._bar.total = total_steps
            self._bar.refresh()

    def update(self, position: int, epoch: int, batch: int, samples: int, loss_sum: float) -> None:
        """One more step trained; `position` is how many of the bar's steps are done now."""
        self._steps = position
        self._window_samples += samples
        self._window_loss += loss_sum
        now = time.monotonic()
        elapsed = now - self._window_started
        if self._bar is not None:
            self._bar.update(position - self._bar.n)  # back, too, after a server restart
            if elapsed >= 0.5:
                self._bar.set_postfix(
                    epoch=epoch,
                    loss=f"{self._window_loss / self._window_samples:.3f}",
                    img_s=f"{self._window_samples / elapsed:.1f}",
                )
                self._reset_window(now)
        elif self.mode == "log" and (elapsed >= LOG_INTERVAL_S or self._first_line):
            self._first_line = False
            log.info(
                "%s: step %d/%d (epoch %d, batch %d): loss %.4f, %.1f img/s",
                self.label,
                self._steps,
                self.total,
                epoch,
                batch,
                self._window_loss / self._window_samples,
                self._window_samples / max(elapsed, 1e-9),
            )
            self._reset_window(now)

    def _reset_window(self, now: float) -> None:
        self._window_started, self._window_samples, self._window_loss = now, 0, 0.0

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


@dataclasses.dataclass
class StepTally:
    """The steps this worker trained, and how many of them the job had had before: a server
    that restarts from its checkpoint goes back to that checkpoint's version, and the steps
    after it are trained again. Those count as redone, in both modes: in sync mode, exactly
    the steps trained again; in async mode, this worker's updates that take the job's version
    no further than it had already been."""

    steps: int = 0
    samples: int = 0
    redone: int = 0
    highest_version: int = 0  # the highest version an acknowledgement named

    def add(self, version: int, samples: int) -> None:
        """One step trained, acknowledged with the server's version after it."""
        self.steps, self.samples = self.steps + 1, self.samples + samples
        if version <= self.highest_version:
            self.redone += 1
        self.highest_version = max(self.highest_version, version)

    def position(self, mode: str, version: int) -> int:
        """How far the job has come, for the progress bar: in sync mode the server's version
        (every step has every worker's gradient, and a worker that joins late starts where the
        job is); in async mode, this worker's own steps, which its share of the total counts."""
        return version if mode == "sync" else self.steps - self.redone
