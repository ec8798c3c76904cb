"""The run totals a checkpoint carries across --resume (psserver.checkpoints.history)."""

import io
import logging

import pytest
import torch

from psserver.checkpoints.history import RunHistory
from psserver.evaluation import Evaluation
from psserver.status.report import TrainingMeter


def a_resumed_meter() -> TrainingMeter:
    earlier = RunHistory(
        sessions=1,
        samples=416,
        pushes=13,
        push_bytes=1300,
        streamed_bytes=70,
        streamed_pulls=12,
        wall_seconds=4.5,
        evaluations=({"epoch": 1, "step": 10, "test_accuracy": 0.5, "test_loss": 1.0},),
        staleness={0: 10, 1: 3},
        resumed_at_step=13,
    )
    meter = TrainingMeter(earlier=earlier)
    meter.record_push(32, 1.0, 10, nbytes=100)
    meter.record_evaluation(1, 10, _evaluation())  # the same weights evaluated again
    meter.record_evaluation(2, 20, _evaluation())
    return meter


def _evaluation() -> Evaluation:
    return Evaluation(accuracy=0.75, loss=0.5, samples=100)


def test_totals_add_this_session_to_the_earlier_ones() -> None:
    totals = a_resumed_meter().totals({0: 11, 1: 3})
    assert (totals.sessions, totals.samples, totals.pushes) == (2, 448, 14)
    assert (totals.push_bytes, totals.streamed_bytes, totals.streamed_pulls) == (1400, 70, 12)
    assert [e["step"] for e in totals.evaluations] == [10, 20]  # step 10 counted once
    assert totals.staleness == {0: 11, 1: 3}
    assert totals.resumed_at_step == 13


def test_the_history_survives_a_checkpoint_file() -> None:
    totals = a_resumed_meter().totals({0: 11, 1: 3})
    buffer = io.BytesIO()
    torch.save({"history": totals.to_checkpoint()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)["history"]  # as the server loads it
    restored = RunHistory.from_checkpoint(saved, step=20)
    assert restored == RunHistory(**{**vars(totals), "resumed_at_step": 20})


@pytest.mark.parametrize(
    "saved",
    [
        None,  # a checkpoint from before the key
        "garbage",
        {"sessions": 1},  # keys missing
        {**RunHistory(sessions=1).to_checkpoint(), "samples": -5},
        {**RunHistory(sessions=1).to_checkpoint(), "wall_seconds": float("nan")},
        {**RunHistory(sessions=1).to_checkpoint(), "evaluations": [3]},
        {**RunHistory(sessions=1).to_checkpoint(), "staleness": {"x": 1}},
    ],
)
def test_a_missing_or_unreadable_history_counts_from_the_resume_and_says_so(
    saved: object, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="ps.server"):
        restored = RunHistory.from_checkpoint(saved, step=7)
    assert restored == RunHistory(sessions=1, resumed_at_step=7)
    assert "counts samples, bytes and evaluations from step 7 on" in caplog.text
