"""Helpers every command line shares: turning errors into one clear line."""

import functools
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import click

from common.errors import PSError

F = TypeVar("F", bound=Callable[..., Any])
ENV_PREFIX = "PS"  # every option can also be set as PS_<OPTION>, e.g. PS_WORKERS=4


def explain_errors(func: F) -> F:
    """Show a PSError as `Error: <message>` with exit code 1, never as a traceback."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except PSError as exc:
            raise click.ClickException(str(exc)) from None
        except KeyboardInterrupt:
            logging.getLogger("ps").warning("interrupted")
            raise SystemExit(130) from None

    return wrapper  # type: ignore[return-value]
