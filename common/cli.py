"""Helpers every command line shares: turning errors into one clear line."""

import contextlib
import functools
import logging
import math
import re
import signal
from collections.abc import Callable, Iterable, Iterator, Mapping
from types import FrameType
from typing import Any, TypeVar

import click
from click.core import ParameterSource

from common.compression import CompressionSpec
from common.device import parse_device
from common.errors import ConfigError, DeviceError, PSError
from common.sharding import too_small_bucket
from common.startup import INTERRUPTED_EXIT_CODE

F = TypeVar("F", bound=Callable[..., Any])
ENV_PREFIX = "PS"  # every option can also be set as PS_<OPTION>, e.g. PS_WORKERS=4


def chosen_options(ctx: click.Context, names: Iterable[str]) -> list[str]:
    """Those of `names` the person set, on the command line or as PS_ variables, rather than
    left at their defaults; sorted."""
    chosen = (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)
    return [name for name in sorted(names) if ctx.get_parameter_source(name) in chosen]


def without_option_variables(env: Mapping[str, str]) -> dict[str, str]:
    """`env` without the PS_ variables: for a child (a follower shard) whose options are all
    on its command line, and which must not take the parent's."""
    return {key: value for key, value in env.items() if not key.startswith(f"{ENV_PREFIX}_")}


class EnvAwareCommand(click.Command):
    """A command whose bad option values name the PS_ variable they came from, if they did:
    `PS_WORKERS=abc` was reported as "Invalid value for '--workers'", an option that someone
    who set it in a compose file or a manifest never typed."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        name_variables_after_flags(self, ctx)
        try:
            return super().parse_args(ctx, args)
        except click.BadParameter as exc:
            name_the_variable(exc, ctx)
            raise


class EnvAwareGroup(click.Group):
    """A group of EnvAwareCommands (ps-bench)."""

    command_class = EnvAwareCommand


def name_variables_after_flags(command: click.Command, ctx: click.Context) -> None:
    """Each option's PS_ variable is its flag as typed: PS_JSON for ps-status --json. Click
    names it after the value's name in the code, which differs for a few (as_json,
    json_path), so PS_JSON was silently ignored and PS_AS_JSON, documented nowhere, was
    read."""
    if ctx.auto_envvar_prefix is None:
        return
    for param in command.params:
        if not isinstance(param, click.Option) or param.envvar is not None:
            continue
        flags = [flag for flag in param.opts if flag.startswith("--")]
        if flags and (name := flags[0][2:].replace("-", "_").upper()) != str(param.name).upper():
            param.envvar = f"{ctx.auto_envvar_prefix}_{name}"
            param.allow_from_autoenv = False  # else click still reads its own name after it


def name_the_variable(exc: click.BadParameter, ctx: click.Context) -> None:
    param = exc.param
    if param is None or param.name is None or exc.param_hint is not None:
        return
    if ctx.get_parameter_source(param.name) is not ParameterSource.ENVIRONMENT:
        return
    variable = param.envvar or f"{ctx.auto_envvar_prefix}_{param.name.upper()}"
    exc.param_hint = f"{param.get_error_hint(ctx)} (set by {variable})"


def naming_variables(message: str) -> str:
    """`message`, naming the PS_ variable of each option it names that was set by one. A
    check across options ("--max-workers (1) must be at least --workers (2)") is not click's
    (see name_the_variable), and named only options that someone who set them in a compose
    file or a manifest never typed."""
    ctx = click.get_current_context(silent=True)
    if ctx is None:
        return message
    sources = []  # (where the message first names the option, what to say)
    for param in ctx.command.params:
        if param.name is None or not isinstance(param, click.Option):
            continue
        if ctx.get_parameter_source(param.name) is not ParameterSource.ENVIRONMENT:
            continue
        flags = [flag for flag in (*param.opts, *param.secondary_opts) if flag.startswith("--")]
        found = [re.search(re.escape(flag) + r"(?![\w-])", message) for flag in flags]
        places = [match.start() for match in found if match is not None]
        if places:
            variable = param.envvar or f"{ctx.auto_envvar_prefix}_{param.name.upper()}"
            sources.append((min(places), f"{flags[0]} was set by {variable}"))
    said = "; ".join(source for _, source in sorted(sources))
    return f"{message} ({said})" if said else message


class FiniteFloatRange(click.FloatRange):
    """click.FloatRange that also refuses nan and inf: nan passes every range comparison, and
    a timeout or a bucket size of nan or inf used to end in a traceback far from the option."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if isinstance(number, float) and not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return number


class BucketMegabytes(FiniteFloatRange):
    """--bucket-mb: a finite size that is 0 or at least one float32 value."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if (reason := too_small_bucket(number, zero_allowed=not self.min_open)) is not None:
            self.fail(reason, param, ctx)
        return number


class LowerCaseMetavar(click.ParamType):
    """Shown in --help as its name is written: click would show it in capitals, which
    these options then refused (`CPU` is not a device)."""

    def get_metavar(self, param: click.Parameter, ctx: click.Context | None = None) -> str:
        return self.name


class DeviceName(LowerCaseMetavar):
    """cpu or cuda[:N], checked as the option is read (exit 2, as for any option of the wrong
    form); whether the machine has that device is checked later (exit 1)."""

    name = "cpu|cuda[:N]"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        try:
            parse_device(str(value))
        except DeviceError as exc:
            self.fail(str(exc), param, ctx)
        return str(value)


class CompressionName(LowerCaseMetavar):
    """none, fp16, bf16 or topk:RATIO, checked as the option is read (exit 2)."""

    name = "none|fp16|bf16|topk:RATIO"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        try:
            CompressionSpec.parse(str(value))
        except ConfigError as exc:  # click names the option itself
            self.fail(str(exc).removeprefix(f"--compress {str(value)!r}: "), param, ctx)
        return str(value)


# The longest timeout an option takes, about 11.6 days: ZeroMQ takes timeouts in int32
# milliseconds, which a value over about 24.8 days overflowed, with a traceback.
MAX_TIMEOUT_S = 1_000_000.0


def timeout_seconds() -> FiniteFloatRange:
    """The type of every timeout option: positive, finite, at most MAX_TIMEOUT_S."""
    return FiniteFloatRange(min=0, min_open=True, max=MAX_TIMEOUT_S)


def explain_errors(func: F) -> F:
    """Show a PSError as `Error: <message>` with exit code 1, never as a traceback."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except ConfigError as exc:
            raise click.ClickException(naming_variables(str(exc))) from None
        except PSError as exc:
            raise click.ClickException(str(exc)) from None
        except KeyboardInterrupt as exc:  # it may say what it left behind, and where
            logging.getLogger("ps").warning("interrupted%s", f": {exc}" if str(exc) else "")
            raise SystemExit(INTERRUPTED_EXIT_CODE) from None
        except Terminated as exc:
            logging.getLogger("ps").warning("stopped by %s", exc.signal_name)
            raise

    return wrapper  # type: ignore[return-value]


class Terminated(SystemExit):
    """SIGTERM or SIGHUP, as SystemExit(128 + the signal): `finally` blocks run on the way out."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signal_name = signal.Signals(signum).name


TERMINATING = (signal.SIGTERM, signal.SIGHUP)


def unwinding_on_termination() -> contextlib.AbstractContextManager[None]:
    """While a command runs, make SIGTERM and SIGHUP (kill, a CI timeout, a closed terminal)
    raise SystemExit, so that `finally` blocks stop the processes it started and remove its
    temporary files. By default Python dies at once and leaves them: the children are in
    sessions of their own. A signal that was ignored stays ignored: nohup's SIGHUP."""
    return signals_handled_by(exit_on_signal, TERMINATING, keep_ignored=True)


@contextlib.contextmanager
def signals_handled_by(
    handler: Callable[[int, FrameType | None], None], signums: Iterable[int],
    keep_ignored: bool = False,
) -> Iterator[None]:  # fmt: skip
    """While the block runs, `handler` handles `signums` (but those ignored when
    `keep_ignored`).

    Once it has ended, either way, the signals get back the handlers they had before:
    nothing is left to unwind or to leave, and Python's own teardown comes next (atexit
    callbacks, torch's finalizers), where an exception a handler raises is printed as
    "Exception ignored in atexit callback" with a traceback. A follower shard that had
    stopped on its leader's STOP printed one when the leader's SIGTERM, sent a moment later,
    came during its teardown. By default SIGTERM and SIGHUP then end the process at once and
    silently, as they end any program that does not handle them (a shell sees 128 + the
    signal, as after Terminated); SIGINT's default raises KeyboardInterrupt, so a caller
    that takes it sets it to SIG_DFL afterwards (ps-worker)."""
    before = {signum: signal.getsignal(signum) for signum in signums}
    for signum, previous in before.items():
        if not (keep_ignored and previous == signal.SIG_IGN):
            signal.signal(signum, handler)
    try:
        yield
    finally:
        for signum, previous in before.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)


def exit_on_signal(signum: int, frame: FrameType | None) -> None:
    raise Terminated(signum)
