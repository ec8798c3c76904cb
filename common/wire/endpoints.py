"""The check every endpoint option gets before ZeroMQ sees it: a tcp:// endpoint's port.

ZeroMQ takes a TCP port modulo 65536, and stops reading at the first non-digit: `ps-server
--bind tcp://127.0.0.1:99999` listened on port 34463, `:-1` on 65535 and `:5x` on 5, each
without a word, and a worker dialling `:99999` waited for a server that could never be there.
So every --bind, --server and --leader goes through `check_endpoint` at start.

What this is not: a full endpoint parser. Other transports (ipc://, inproc://) pass as they
are, where an option takes them; the host is left to ZeroMQ and the resolver.
"""

from common.errors import ConfigError

MAX_PORT = 65535
TCP = "tcp://"


def port_problem(endpoint: str, bind: bool) -> str | None:
    """What is wrong with a tcp:// endpoint's port, in words, or None (also for another
    transport). `bind`: it is listened on, so `*` (a free port) is allowed."""
    if not endpoint.startswith(TCP):
        return None
    _, colon, port = endpoint.removeprefix(TCP).rpartition(":")
    if bind and port == "*":
        return None
    if colon and port.isascii() and port.isdigit() and 1 <= int(port) <= MAX_PORT:
        return None
    free = ", or * for a free one" if bind else ""
    if not colon:
        return f"it names no port; give tcp://HOST:PORT, PORT from 1 to {MAX_PORT}{free}"
    return f"the port must be 1 to {MAX_PORT}{free}"


def check_endpoint(endpoint: str, option: str, bind: bool = False) -> None:
    """A ConfigError that names `option` when the endpoint's port cannot be meant."""
    problem = port_problem(endpoint, bind)
    if problem is not None:
        raise ConfigError(f"{option} {endpoint}: {problem}")
