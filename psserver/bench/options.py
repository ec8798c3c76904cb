"""Pieces every `ps-bench` command shares: the --json and --plot options, --bucket-mb, the
options that place workers on other hosts' agents, --phases' checks, and running phases in
turns with progress on stderr."""

import functools
import socket
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import click

from common.cli import BucketMegabytes, name_the_variable
from common.errors import ConfigError
from common.wire.endpoints import port_problem
from psserver.bench.agentlink import parse_agent
from psserver.bench.agentwire import DEFAULT_AGENT_PORT
from psserver.config import check_writable_file

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")


class OutputFile(click.Path):
    """A file to write: `--json ''` became the current folder, and `--json /tmp` was
    refused as "/ is not a writable folder"; both now say what is wrong."""

    def __init__(self) -> None:
        super().__init__(dir_okay=False, path_type=Path)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and not value.strip():
            self.fail("is empty: name the file to write, e.g. results.json", param, ctx)
        if Path(value).is_dir():
            example = Path(value) / "results.json"
            self.fail(f"{value} is a folder: name a file in it, e.g. {example}", param, ctx)
        return super().convert(value, param, ctx)


# The option each output option must not share its file with.
OTHER_OUTPUT = {"json_path": ("plot", "--plot"), "plot": ("json_path", "--json")}


def _writable(ctx: click.Context, param: click.Parameter, value: Path | None) -> Path | None:
    """Checked before the runs: a path that cannot be written used to fail after all of them,
    with a traceback, and the results were lost. --json and --plot on one file: the plot
    overwrote the results."""
    if value is None:
        return None
    try:
        check_writable_file(value, param.opts[0])  # --json or --plot
    except ConfigError as exc:
        raise click.BadParameter(str(exc)) from None
    other, flag = OTHER_OUTPUT[str(param.name)]
    given = ctx.params.get(other)  # set already if its option was read first
    if given is not None and given.resolve() == value.resolve():
        raise click.BadParameter(
            f"{value} is {flag}'s file too: the plot would overwrite the results; give "
            "them different files, e.g. --json results.json --plot results.png"
        )
    return value


def _plot_path(ctx: click.Context, param: click.Parameter, value: Path | None) -> Path | None:
    """Writable, and in a format matplotlib writes: `plot.out` failed after all the runs, with
    a traceback, and `plot` became plot.png unasked."""
    if value is None:
        return None
    _writable(ctx, param, value)
    from matplotlib.backend_bases import FigureCanvasBase  # slow to import: only when asked

    formats = sorted(FigureCanvasBase.get_supported_filetypes())
    if value.suffix.lstrip(".").lower() not in formats:
        raise click.BadParameter(
            f"{value} does not end in a picture format; name a .png file (or one of "
            f".{', .'.join(formats)})"
        )
    return value


def output_options(plotted: str) -> Callable[[F], F]:
    """--json PATH and --plot PNG, which every benchmark takes."""

    def decorate(func: F) -> F:
        func = click.option(
            "--plot",
            type=OutputFile(),
            default=None,
            callback=_plot_path,
            help=f"Write a PNG bar chart of {plotted} here.",
        )(func)
        return click.option(
            "--json",
            "json_path",
            type=OutputFile(),
            default=None,
            callback=_writable,
            help="Write the results here.",
        )(func)

    return decorate


# The server's --bucket-mb in the runs that send buckets: like DDP's bucket_cap_mb.
bucket_mb_option = click.option(
    "--bucket-mb",
    type=BucketMegabytes(min=0, min_open=True),
    default=None,
    show_default="the server's: 2 over its shards, at least 0.5",
    help="The server's gradient buckets in the bucketed runs (a 'whole' run uses one); at "
    "least one float32 value (4 bytes, 3.82e-06 MB).",
)


def _agents(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> tuple[str, ...]:
    """Each HOST[:PORT] well formed and its host known, before anything runs: a port out of
    range or a host name that does not resolve used to cost the 10 s hello timeout, and then
    was reported as an agent that did not answer."""
    for text in values:
        try:
            host, port = parse_agent(text)
        except ValueError as exc:
            raise click.BadParameter(f"{text!r}: {exc}") from None
        try:
            socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError) as exc:
            reason = exc.strerror if isinstance(exc, socket.gaierror) else str(exc)
            raise click.BadParameter(
                f"{text!r}: cannot resolve the host {host!r} ({reason}); check the name, or "
                "give the agent's IP address"
            ) from None
    return values


def agent_bind(ctx: click.Context, param: click.Parameter, value: str) -> str:
    """`ps-bench agent --bind`: tcp://ADDRESS:PORT, checked before the socket is made
    (`--bind garbage` was refused with advice about a busy port)."""
    host, sep, _ = value.removeprefix("tcp://").rpartition(":")
    port_ok = port_problem(value, bind=True) is None
    if not value.startswith("tcp://") or not sep or not host or not port_ok:
        raise click.BadParameter(
            f"expected tcp://ADDRESS:PORT (PORT from 1 to 65535, or * for any free one), "
            f"e.g. tcp://0.0.0.0:{DEFAULT_AGENT_PORT}; got {value!r}"
        )
    return value


shard_agent_option = click.option(
    "--shard-agent",
    "shard_agents",
    multiple=True,
    metavar="HOST[:PORT]",
    callback=_agents,
    help="With --num-shards K: run the sharded runs' follower shards on this host, through "
    "its agent, instead of beside the leader here; repeat for more hosts: shard i runs on "
    "shard agent (i - 1) mod their number. Needs --agent, and agents of its own.",
)


def agent_options(workers: str) -> Callable[[F], F]:
    """--agent HOST (repeatable), --host ADDRESS and --port PORT: `workers` (say "the
    workers") run on the agents' hosts, the servers here."""

    def decorate(func: F) -> F:
        func = click.option(
            "--port",
            type=click.IntRange(1, 65535),
            default=None,
            help="The port every run's server (or DDP rendezvous) listens on, one run after the "
            "other (a sharded server's followers on the next ones), for a firewall that opens "
            "only these.  [default: any free port]",
        )(func)
        func = click.option(
            "--host",
            default=None,
            metavar="ADDRESS",
            help="With --agent: this host's address as the agents reach it; the servers "
            "listen on it.  [default: the address of the route to the first agent]",
        )(func)
        return click.option(
            "--agent",
            "agents",
            multiple=True,
            metavar="HOST[:PORT]",
            callback=_agents,
            help=f"Run {workers} on this host, through the `ps-bench agent` running there "
            f"(port {DEFAULT_AGENT_PORT} unless given); repeat for more hosts: worker i runs "
            "on agent i mod the number of agents. The servers run here.",
        )(func)

    return decorate


def announced(
    index: int, total: int, description: str, run: Callable[[], T], outcome: Callable[[T], str]
) -> T:
    """One run of a benchmark, with a progress line on stderr: what runs, then its outcome
    and how long it took (or that it failed)."""
    click.echo(f"[{index}/{total}] {description} ...", err=True, nl=False)
    started = time.perf_counter()
    try:
        result = run()
    except KeyboardInterrupt:
        click.echo(" interrupted", err=True)
        raise
    except BaseException:
        click.echo(" failed", err=True)
        raise
    click.echo(f" {outcome(result)} ({time.perf_counter() - started:.0f} s)", err=True)
    return result


def _rate(images_per_second: float) -> str:
    return f"{images_per_second:.1f} img/s"


def in_turns(phases: Sequence[str], repeat: int) -> list[str]:
    """Every phase `repeat` times, taking turns, each turn starting one phase later than the
    one before: no phase always runs first (on a machine still settling), or always right
    after the same other one."""
    order = list(phases)
    return [order[(turn + i) % len(order)] for turn in range(repeat) for i in range(len(order))]


def run_in_turns(
    phases: Sequence[str],
    repeat: int,
    describe_phase: Callable[[str], str],
    run: Callable[[str], float],
) -> dict[str, list[float]]:
    """Every phase `repeat` times, taking turns (`in_turns`); each run's images/s, by phase."""
    runs: dict[str, list[float]] = {phase: [] for phase in phases}
    total = len(phases) * repeat
    for i, phase in enumerate(in_turns(phases, repeat), start=1):
        rate = announced(i, total, describe_phase(phase), functools.partial(run, phase), _rate)
        runs[phase].append(rate)
    return runs


def parse_phases(text: str, order: Sequence[str]) -> tuple[str, ...]:
    """`--phases sync,ddp` -> ("sync", "ddp"), in `order`; names not in it come last, for
    `check_phases` to refuse."""
    names = {name.strip() for name in text.split(",") if name.strip()}
    known = [phase for phase in order if phase in names]
    return (*known, *sorted(names - set(known)))


class PhasesError(ConfigError):
    """--phases names phases that cannot run; `reason` says why, to follow the option's name."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"--phases {reason}")
        self.reason = reason


def check_phases(phases: Sequence[str], available: Sequence[str]) -> None:
    """A PhasesError unless `phases` are some of `available`, DDP among them."""
    unknown = [phase for phase in phases if phase not in available]
    if unknown or not phases:
        raise PhasesError(
            f"must be a comma-separated list of {', '.join(available)}; "
            f"got {','.join(phases) or 'nothing'}"
        )
    if "ddp" not in phases:
        raise PhasesError("must include ddp: every rate is reported against it")


def option_error(ctx: click.Context, name: str, message: str) -> click.BadParameter:
    """A usage error (exit 2) about option `name`, found after the options were read: it
    names the PS_ variable the value came from, if it did, as click does for the options it
    checks itself."""
    param = next(p for p in ctx.command.params if p.name == name)
    error = click.BadParameter(message, ctx=ctx, param=param)
    name_the_variable(error, ctx)
    return error
