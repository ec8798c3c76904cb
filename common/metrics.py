"""Per-step metrics on disk: JSON Lines for scripts and `ps-plot`, TensorBoard events for people.

`MetricsWriter` appends one JSON object per event to `LOGDIR/<role>[-<id>].jsonl`. Every
object has `time` (unix seconds), `role`, `event`, `step` and `epoch`, plus `worker` when the
writer has an id; the rest are the event's values. A writer given the job's `mode` and
`model` writes them first, as a `job` record at the step of its first record, once per
process; a resumed server writes a `resume` record at the step it goes on from (the steps
after it that the file already holds are trained again). When the `tensorboard` package is
importable, the numeric values also go to `LOGDIR/tb/<role>[-<id>]/` as scalars tagged with
their key, against `step`, so the same key from several roles lands in one chart. Without a
log dir the writer does nothing, so a training loop calls it unconditionally.

What it is not: a logger, an aggregator or a metrics server. It reads, merges and sends
nothing, and it is not thread-safe (each role writes from its one training thread). Each line
is written out as it is made (a few a second, a small write each), so a killed process loses
none; TensorBoard's thread writes its events every 10 s and on close. A line flushed only once
a second had passed since the last one stayed in the buffer for as long as the role then
waited (a held pull), and a kill lost it. An existing file is appended to: a resumed server
continues its file, and a log dir reused for a second run holds both runs.

Metrics are never worth a job: when a write fails (a full disk, a folder gone), the writer
says so once, in one log line, and writes nothing more; training goes on.
"""

import collections
import contextlib
import itertools
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

from common.errors import ConfigError

log = logging.getLogger("ps.metrics")
Value = int | float | str | bool | list[int] | None


def prepare_log_dir(log_dir: Path) -> None:
    """Make the --log-dir folder, or say why it cannot be: a worker checks before it joins,
    so that it never registers only to leave at once."""
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"cannot write metrics to {log_dir}: {exc}; give --log-dir a writable folder"
        ) from None
    if not os.access(log_dir, os.W_OK):
        raise ConfigError(f"cannot write metrics to {log_dir}; give --log-dir a writable folder")


class MetricsWriter:
    def __init__(
        self,
        log_dir: Path | None,
        role: str,
        worker_id: int | None = None,
        clock: Callable[[], float] = time.time,
        job: dict[str, Value] | None = None,
    ) -> None:
        """`job`: what the run trains (mode, model), for the `job` record (module doc)."""
        self.role, self.worker_id, self.clock = role, worker_id, clock
        self._job = job  # not written yet
        self.name = role if worker_id is None else f"{role}-{worker_id}"
        self.path = None if log_dir is None else log_dir / f"{self.name}.jsonl"
        self._file: IO[str] | None = None
        self._tensorboard: TensorBoardEvents | None = None
        if log_dir is None:
            return
        prepare_log_dir(log_dir)
        try:
            # Kept open for the whole run, closed in close(); line-buffered: see the module doc.
            self._file = open(  # noqa: SIM115
                log_dir / f"{self.name}.jsonl", "a", buffering=1, encoding="utf-8"
            )
        except OSError as exc:
            raise ConfigError(
                f"cannot write metrics to {log_dir}: {exc}; give --log-dir a writable folder"
            ) from None
        self._tensorboard = open_tensorboard(log_dir / "tb" / self.name)

    @property
    def enabled(self) -> bool:
        return self._file is not None

    def write(self, event: str, step: int, epoch: int, **values: Value) -> None:
        """Append one record; `values` must be JSON-serialisable (numbers, bools, str, lists)."""
        if self._file is None:
            return
        if self._job is not None:
            job, self._job = self._job, None
            self.write("job", step, epoch, **job)
            if self._file is None:  # that write failed, and the writer gave up
                return
        now = self.clock()
        record: dict[str, Value] = {
            "time": now,
            "role": self.role,
            "event": event,
            "step": step,
            "epoch": epoch,
        }
        if self.worker_id is not None:
            record["worker"] = self.worker_id
        record.update(values)
        numbers = {
            k: float(v)
            for k, v in values.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        try:
            self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
            if self._tensorboard is not None and numbers:
                self._tensorboard.add(numbers, step, now)
        except OSError as exc:  # TensorBoard's thread hands its own errors on as they were
            self._give_up(exc)

    def flush(self) -> None:
        """Write out everything so far, TensorBoard events included (this waits for them)."""
        try:
            if self._file is not None:
                self._file.flush()
            if self._tensorboard is not None:
                self._tensorboard.flush()
        except OSError as exc:
            self._give_up(exc)

    def close(self) -> None:
        try:
            if self._file is not None:
                self._file.close()
            if self._tensorboard is not None:
                self._tensorboard.close()
        except OSError as exc:  # close() flushes what is left
            self._give_up(exc)
        self._file, self._tensorboard = None, None

    def _give_up(self, exc: OSError) -> None:
        """One warning, then nothing more: what is on disk stays, the rest is dropped."""
        log.warning(
            "could not write metrics to %s (%s); this %s writes no more metrics, and training "
            "goes on (free space there, or give --log-dir another folder next time)",
            self.path,
            exc.strerror or exc,
            self.role,
        )
        file, tensorboard = self._file, self._tensorboard
        self._file, self._tensorboard = None, None
        with contextlib.suppress(OSError):
            if file is not None:
                file.close()  # flushes, fails again, and closes the descriptor all the same
        with contextlib.suppress(Exception):  # its thread failed: close() raises that again
            if tensorboard is not None:
                tensorboard.close()


class TensorBoardEvents:
    """One TensorBoard event per record, holding a scalar per numeric value.

    One event rather than one per value: tensorboard's writer checksums every event in pure
    Python on its own thread, about 150 us of CPU (and GIL) an event, so one per value would
    cost a fast async server a millisecond an update.
    """

    def __init__(self, path: Path) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary
        from torch.utils.tensorboard.writer import FileWriter

        quiet_failed_writer_threads()
        self._summary = Summary
        # A deep queue, so that a burst does not wait for the thread; flush_secs bounds what
        # a crash loses.
        self._writer = FileWriter(str(path), max_queue=1000, flush_secs=10)

    def add(self, values: dict[str, float], step: int, walltime: float) -> None:
        scalars = [self._summary.Value(tag=k, simple_value=v) for k, v in values.items()]
        self._writer.add_summary(self._summary(value=scalars), step, walltime)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def quiet_failed_writer_threads() -> None:
    """tensorboard's writer thread keeps the error that ended it (a full disk) for the next
    add or flush, which MetricsWriter turns into one warning, and also raises it out of the
    thread, where Python prints it as a traceback; that second copy is left out."""
    previous = threading.excepthook
    if getattr(previous, "quiets_tensorboard", False):
        return

    def hook(args: threading.ExceptHookArgs) -> None:
        if type(args.thread).__name__ == "_AsyncWriterThread" and issubclass(
            args.exc_type, OSError
        ):
            return
        previous(args)

    hook.quiets_tensorboard = True  # type: ignore[attr-defined]
    threading.excepthook = hook


def open_tensorboard(path: Path) -> TensorBoardEvents | None:
    """TensorBoard events in `path`, or None (with one log line) without `tensorboard`."""
    try:
        return TensorBoardEvents(path)
    except ImportError:
        log.info("no TensorBoard events in %s: `pip install tensorboard` to get them", path)
        return None
    except OSError as exc:  # its folder cannot be made: a full disk
        log.warning("no TensorBoard events in %s (%s)", path, exc.strerror or exc)
        return None


class RateWindow:
    """Items per second over the last `size` events, e.g. images/s from batch sizes.

    The first event is measured from construction or `restart()`, so waits before it count.
    """

    def __init__(self, size: int = 20) -> None:
        self._marks: collections.deque[tuple[float, int]] = collections.deque(maxlen=size + 1)
        self.restart()

    def restart(self) -> None:
        self._marks.clear()
        self._marks.append((time.monotonic(), 0))

    def add(self, count: int) -> float:
        now = time.monotonic()
        self._marks.append((now, count))
        total = sum(c for _, c in itertools.islice(self._marks, 1, None))
        return total / max(now - self._marks[0][0], 1e-9)
