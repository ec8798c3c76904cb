"""The --curve-* command-line options of every role, and the security they describe.

Each command takes both of its options or neither; anything else is one clear error that says
how to make keys (common.wire.security has the keys and the sockets).
"""

from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from common.errors import ConfigError
from common.wire.security import KEYS_HINT, ClientSecurity, ServerSecurity


def _secret_key_option(role: str, example: str) -> Callable[[Any], Any]:
    return click.option(
        "--curve-secret-key",
        type=click.Path(dir_okay=False, path_type=Path),
        default=None,
        help=f"This {role}'s CURVE secret key file ({example} from ps-keys); turns on "
        "encryption and authentication.",
    )


def server_security_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """Add --curve-secret-key and --curve-authorized-clients to a server command."""
    func = click.option(
        "--curve-authorized-clients",
        type=click.Path(file_okay=False, path_type=Path),
        default=None,
        help="Folder of the public key files of the workers allowed to connect "
        "(DIR/authorized_clients from ps-keys); needs --curve-secret-key.",
    )(func)
    return _secret_key_option("server", "DIR/server.key_secret")(func)


def client_security_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """Add --curve-secret-key and --curve-server-key to a client's command (ps-worker,
    ps-status)."""
    func = click.option(
        "--curve-server-key",
        type=click.Path(dir_okay=False, path_type=Path),
        default=None,
        help="The server's public key file (DIR/server.key from ps-keys); needs "
        "--curve-secret-key.",
    )(func)
    return _secret_key_option("client", "DIR/client-N.key_secret")(func)


def _needs_both(first: str, second: str) -> ConfigError:
    return ConfigError(
        f"{first} and {second} go together: pass both to use CURVE, or neither; {KEYS_HINT}"
    )


def server_security_from_options(
    curve_secret_key: Path | None, curve_authorized_clients: Path | None
) -> ServerSecurity | None:
    """The validated ServerSecurity, or None when neither option was given."""
    if curve_secret_key is None and curve_authorized_clients is None:
        return None
    if curve_secret_key is None or curve_authorized_clients is None:
        raise _needs_both("--curve-secret-key", "--curve-authorized-clients")
    return ServerSecurity(curve_secret_key, curve_authorized_clients)


def client_security_from_options(
    curve_secret_key: Path | None, curve_server_key: Path | None
) -> ClientSecurity | None:
    """The validated ClientSecurity, or None when neither option was given."""
    if curve_secret_key is None and curve_server_key is None:
        return None
    if curve_secret_key is None or curve_server_key is None:
        raise _needs_both("--curve-secret-key", "--curve-server-key")
    return ClientSecurity(curve_secret_key, curve_server_key)
