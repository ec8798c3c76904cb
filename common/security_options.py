"""The security that the --curve-* options of every role describe (the options themselves are
common.options').

Each command takes both of its options or neither; anything else is one clear error that says
how to make keys (common.wire.security has the keys and the sockets).
"""

from pathlib import Path

from common.errors import ConfigError
from common.wire.security import KEYS_HINT, ClientSecurity, ServerSecurity


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
