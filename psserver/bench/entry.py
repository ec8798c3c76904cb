"""The `ps-bench` console script ([project.scripts] in pyproject.toml), as psserver.entry's:
it imports psserver.bench.cli through common.startup, so that a Ctrl-C during that slow
import exits quietly. It imports nothing heavy."""

from common.startup import run_command


def bench() -> None:
    run_command("psserver.bench.cli")
