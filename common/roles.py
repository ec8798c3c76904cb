"""The product's roles as one command starts another: which module runs each, and the one
function that turns a spec into a child's command-line arguments (`command_args`).

ps-local starts a server and its workers, a leader its follower shards, ps-bench its runs and
the tests their clusters, all through `command_args`: each value is written as the role's
option (common.options) reads it back, so a flag, a switch's `--no-` side or a path is
spelled in one place. Also the worker's spec, `WorkerSpec`, which ps-worker builds from its
command line and ps-local and ps-bench build for the workers they start.

What this is not: starting the process (common.processes.start_child), nor the server's spec
(psserver.config.ServerConfig, psserver.shards.joining.FollowerConfig).
"""

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from common.cli import MAX_TIMEOUT_S
from common.errors import ConfigError
from common.logs import LEVELS
from common.options import PROGRESS_MODES, SERVER_OPTIONS, WORKER_OPTIONS, Option
from common.wire.endpoints import check_endpoint


@dataclasses.dataclass(frozen=True)
class Role:
    """A command one process starts another as: `python -m module [subcommand] OPTIONS`."""

    module: str
    options: tuple[Option, ...]
    subcommand: tuple[str, ...] = ()  # e.g. ("client",) for a group's command

    def option(self, name: str) -> Option:
        """The option whose value is called `name` (a spec's field)."""
        for option in self.options:
            if option.dest == name:
                return option
        raise ValueError(f"{' '.join((self.module, *self.subcommand))} has no option {name!r}")


SERVER = Role("psserver.cli.server", SERVER_OPTIONS)
WORKER = Role("psworker.cli", WORKER_OPTIONS)

# A spec: a frozen dataclass whose fields are the role's options (WorkerSpec, FollowerConfig),
# or a mapping of some of them (the options a person gave ps-local, handed on to its server
# as given; those ps-bench chooses for a run).
Spec = object


def command_args(role: Role, *specs: Spec) -> list[str]:
    """The arguments after `python -m role.module` that start `role` with `specs`: each field
    (or key) whose value is not None, as its option reads it back. The child's other options
    keep their defaults. A name in two specs is a mistake, and so is one the role lacks."""
    args = list(role.subcommand)
    seen: set[str] = set()
    for spec in specs:
        for name, value in _values(spec):
            if name in seen:
                raise ValueError(f"{name!r} is given twice for {role.module}")
            seen.add(name)
            args += role.option(name).args(value)
    return args


def _values(spec: Spec) -> Iterable[tuple[str, Any]]:
    if isinstance(spec, Mapping):
        return spec.items()
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        return ((field.name, getattr(spec, field.name)) for field in dataclasses.fields(spec))
    raise TypeError(f"a spec is a dataclass or a mapping, got {type(spec).__name__}")


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """What a ps-worker is told: its options, validated once. Defaults are the options'."""

    server: str = "tcp://127.0.0.1:5555"
    gpu: int | None = None
    device: str | None = None  # cpu or cuda:N; neither this nor gpu: cuda:0 if present
    data_dir: Path | None = None  # this host's FashionMNIST/raw, for --dataset fashion-mnist
    download: bool = False
    name: str | None = None  # the label in the server's logs
    timeout: float = 60.0  # seconds of server silence before a retry
    retries: int = 5
    join_timeout: float = 60.0  # seconds a first registration waits for a silent server
    step_delay: float = 0.0  # seconds before each push: a straggler, for fault injection
    threads: int | None = None
    progress: str = "auto"
    log_dir: Path | None = None
    overlap: bool = True  # push each bucket (and shard slice) as soon as backward has it
    curve_secret_key: Path | None = None
    curve_server_key: Path | None = None
    log_level: str = "info"

    def __post_init__(self) -> None:
        check_endpoint(self.server, "--server")
        if self.gpu is not None and self.device is not None:
            raise ConfigError("give either --gpu or --device, not both")
        for name in ("gpu", "retries"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ConfigError(f"--{name} must be 0 or more, got {value}")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"--threads must be at least 1, got {self.threads}")
        for flag, seconds in (("--timeout", self.timeout), ("--join-timeout", self.join_timeout)):
            if not 0 < seconds <= MAX_TIMEOUT_S:
                raise ConfigError(
                    f"{flag} must be more than 0 and at most {MAX_TIMEOUT_S:g} seconds, got "
                    f"{seconds}"
                )
        if not (math.isfinite(self.step_delay) and self.step_delay >= 0):
            raise ConfigError(f"--step-delay must be 0 or more seconds, got {self.step_delay}")
        choices: Sequence[tuple[str, str, Sequence[str]]] = (
            ("--progress", self.progress, PROGRESS_MODES),
            ("--log-level", self.log_level, LEVELS),
        )
        for flag, value, allowed in choices:
            if value not in allowed:
                raise ConfigError(f"{flag} must be one of {', '.join(allowed)}, got {value!r}")
