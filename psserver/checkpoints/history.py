"""The run's totals from the sessions before a `--resume`, carried in the checkpoint.

A resumed server starts a fresh TrainingMeter, so without these its summary would count only
the samples, bytes, evaluations and staleness of its own session while `global_steps` and
`epochs` count the whole run. The checkpoint's optional `history` key holds the totals up to
that checkpoint; work done after it and lost in a crash is done again, and counted once.

Checkpoints written before this key existed resume as before, counting from the resume on.
"""

import dataclasses
import logging
from typing import Any

log = logging.getLogger("ps.server")


@dataclasses.dataclass(frozen=True)
class RunHistory:
    """What the earlier sessions of a run did, up to the checkpoint this one resumed from."""

    sessions: int = 0
    samples: int = 0
    pushes: int = 0
    push_bytes: int = 0
    streamed_bytes: int = 0
    streamed_pulls: int = 0
    wall_seconds: float = 0.0
    evaluations: tuple[dict[str, Any], ...] = ()
    staleness: dict[int, int] = dataclasses.field(default_factory=dict)  # async: histogram
    resumed_at_step: int | None = None  # the step this session began at; None if it did not

    def to_checkpoint(self) -> dict[str, Any]:
        """Plain types only: checkpoints are loaded with weights_only=True."""
        return {
            "sessions": self.sessions,
            "samples": self.samples,
            "pushes": self.pushes,
            "push_bytes": self.push_bytes,
            "streamed_bytes": self.streamed_bytes,
            "streamed_pulls": self.streamed_pulls,
            "wall_seconds": self.wall_seconds,
            "evaluations": [dict(e) for e in self.evaluations],
            "staleness": {str(k): v for k, v in sorted(self.staleness.items())},
        }

    @classmethod
    def from_checkpoint(cls, saved: object, step: int) -> "RunHistory":
        """The history a checkpoint at `step` holds. A missing or unreadable one (an older
        checkpoint, or a damaged key) is not worth refusing the resume for: the summary then
        counts from this session on, and says so in the log."""
        try:
            return cls._parse(saved, step)
        except (KeyError, TypeError, ValueError, AttributeError):
            log.warning(
                "the checkpoint holds no readable run totals (an older release wrote it?): the "
                "summary counts samples, bytes and evaluations from step %d on",
                step,
            )
            return cls(sessions=1, resumed_at_step=step)

    @classmethod
    def _parse(cls, saved: object, step: int) -> "RunHistory":
        if not isinstance(saved, dict):
            raise TypeError("history is not a dict")
        counts = {
            name: _count(saved[name])
            for name in ("sessions", "samples", "pushes", "push_bytes", "streamed_bytes")
        }
        evaluations = saved["evaluations"]
        if not isinstance(evaluations, list) or not all(isinstance(e, dict) for e in evaluations):
            raise TypeError("evaluations is not a list of dicts")
        wall = saved["wall_seconds"]
        if isinstance(wall, bool) or not isinstance(wall, (int, float)) or not wall >= 0:
            raise ValueError("wall_seconds is not a non-negative number")
        return cls(
            **counts,
            streamed_pulls=_count(saved["streamed_pulls"]),
            wall_seconds=float(wall),
            evaluations=tuple(evaluations),
            staleness={int(k): _count(v) for k, v in saved["staleness"].items()},
            resumed_at_step=step,
        )


def _count(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{value!r} is not a count")
    return value
