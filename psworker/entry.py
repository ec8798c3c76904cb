"""The console script of the worker (`ps-worker` in [project.scripts] of pyproject.toml).

It imports psworker.cli through common.startup, so that a Ctrl-C during that slow import
(torch) exits quietly. What it is not: the command itself (psworker.cli), which
`python -m psworker.cli` runs directly. It imports nothing heavy.
"""

from common.startup import run_command


def worker() -> None:
    run_command("psworker.cli")
