"""Logging setup shared by every role: one line per record, prefixed with the role."""

import logging
import sys

LEVELS = ("debug", "info", "warning", "error")


def setup_logging(level: str, role: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter(f"%(asctime)s {role} %(levelname)s %(message)s", datefmt="%H:%M:%S")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def counted(count: int, noun: str, plural: str | None = None) -> str:
    """`1 worker`, `2 workers`: log lines and errors count things in words that agree."""
    return f"{count} {noun if count == 1 else plural or noun + 's'}"
