"""A worker's progress and its final count when the server goes back to a checkpoint: the
steps after the checkpoint are trained again, and neither the bar nor the last line may count
them as the job's progress (a 32-step job's worker said "step 11/32" at batch 8, and "stopped
after 34 steps")."""

import logging

import pytest

from psworker.progress import Progress, StepTally


def test_steps_trained_again_after_a_restart_count_as_redone_in_sync_mode() -> None:
    tally = StepTally()
    for version in range(1, 12):  # acknowledged versions 1..11; the server dies
        tally.add(version, 16)
    for version in range(10, 33):  # it comes back at its checkpoint of step 9
        tally.add(version, 16)
    assert (tally.steps, tally.samples, tally.redone) == (34, 34 * 16, 2)
    assert tally.steps - tally.redone == 32
    assert tally.position("sync", 32) == 32


def test_async_progress_is_this_workers_own_steps_less_the_redone() -> None:
    tally = StepTally()
    for version in (1, 3, 5, 7):  # another worker's updates take the versions between
        tally.add(version, 8)
    for version in (6, 8, 10):  # back at the checkpoint of version 4
        tally.add(version, 8)
    # Only version 6 takes the job no further than it had been; 8 and 10 are past 7. (Its
    # updates 5 and 7 were lost too, but no acknowledgement says so: async counts roughly.)
    assert (tally.steps, tally.redone) == (7, 1)
    assert tally.position("async", 10) == tally.position("ssp", 10) == 6


def test_the_log_line_shows_the_jobs_position_and_goes_back_with_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    progress = Progress("log", 32, "worker 1")
    with caplog.at_level(logging.INFO, logger="ps.worker"):
        progress.update(11, 0, 10, 16, 16 * 2.0)
        progress.update(12, 0, 11, 16, 16 * 2.0)  # within the log interval: no line
    progress.close()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1, lines
    assert lines[0].startswith("worker 1: step 11/32 (epoch 0, batch 10): loss 2.0000, "), lines


def test_the_bar_moves_back_when_the_job_does() -> None:
    progress = Progress("bar", 32, "worker 1")
    assert progress._bar is not None
    progress.update(11, 0, 10, 16, 16.0)
    progress.update(10, 0, 9, 16, 16.0)  # the first step after going back to step 9
    assert progress._bar.n == 10
    progress.close()
