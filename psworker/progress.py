"""Worker progress: a tqdm bar on a terminal, or periodic log lines when output is piped."""

import logging
import sys
import time

from tqdm import tqdm

log = logging.getLogger("ps.worker")
PROGRESS_MODES = ("auto", "bar", "log", "none")
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

    def update(self, epoch: int, batch: int, samples: int, loss_sum: float) -> None:
        self._steps += 1
        self._window_samples += samples
        self._window_loss += loss_sum
        now = time.monotonic()
        elapsed = now - self._window_started
        if self._bar is not None:
            self._bar.update(1)
            if elapsed >= 0.5:
                self._bar.set_postfix(
                    epoch=epoch,
                    loss=f"{self._window_loss / self._window_samples:.3f}",
                    img_s=f"{self._window_samples / elapsed:.1f}",
                )
                self._reset_window(now)
        elif self.mode == "log" and (elapsed >= LOG_INTERVAL_S or self._steps == 1):
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
