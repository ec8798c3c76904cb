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


def test_a_late_joiners_sync_total_counts_the_epochs_cut_for_the_workers_there() -> None:
    """A job of --workers 2 (16 steps an epoch on 512 images of 16), 3 epochs; a third worker
    joins for the last, which is cut into 11 steps. Its bar said "step 33/48" for a job that
    ended at 43: it counted every epoch as 16 steps."""
    import torch

    from common.job import JobSpec
    from common.wire.protocol import Weights
    from psworker.batches import planned_steps, planned_sync_steps

    job = JobSpec("sync", "lenet", "embedded", 2, 16, 0, 512, 512, 16, 3, None, 10, 0, "none")
    assert planned_steps(job) == 48

    def pulled(version: int, epoch: int, batch: int, world: int) -> Weights:
        return Weights(version, epoch, batch, 0, world, False, torch.empty(0), torch.empty(0))

    assert planned_sync_steps(job, pulled(0, 0, 0, 2)) == 48  # as the job planned
    assert planned_sync_steps(job, pulled(32, 2, 0, 3)) == 32 + 11 == 43
    assert planned_sync_steps(job, pulled(35, 2, 3, 3)) == 43
    # An abandoned epoch makes one more: at least the epoch under way is still to go.
    assert planned_sync_steps(job, pulled(40, 3, 0, 3)) == 51
    capped = JobSpec.from_dict({**job.to_dict(), "max_steps": 40})
    assert planned_sync_steps(capped, pulled(32, 2, 0, 3)) == 40
    progress = Progress("bar", 48, "worker 3")
    progress.set_total(43)
    assert progress._bar is not None and progress._bar.total == 43
    progress.close()
