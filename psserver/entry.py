"""The console scripts of the server side ([project.scripts] in pyproject.toml).

Each imports its command's module through common.startup, so that a Ctrl-C during that slow
import (torch) exits quietly. What it is not: the commands themselves (psserver.cli.server,
psserver.cli.local, ...), which `python -m` runs directly, nor ps-bench's
(psserver.bench.entry). It imports nothing heavy.
"""

from common.startup import run_command


def server() -> None:
    run_command("psserver.cli.server")


def local() -> None:
    run_command("psserver.cli.local")


def keys() -> None:
    run_command("psserver.cli.keys")


def status() -> None:
    run_command("psserver.cli.status")


def plot() -> None:
    run_command("psserver.cli.plot")
