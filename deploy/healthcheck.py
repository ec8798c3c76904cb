"""The container health check: does the ps-server in this container accept TCP connections?

It reads the server's endpoint from PS_BIND (the environment form of `ps-server --bind`) and
opens one TCP connection to it, on the loopback address when the server binds every interface.
The server binds only after it has loaded the data and built the model, so an open port means
it is ready for workers.

What it is not: a protocol ping. It sends nothing, so a server with CURVE logs no rejected
client, and it cannot tell a busy server from a hung one. A container without PS_BIND (a
worker, which listens on nothing, or a server given --bind on its command line) has nothing to
check and is reported healthy. Standard library only: the image needs no curl or netcat.

Exit status, as Docker's HEALTHCHECK expects: 0 healthy, 1 unhealthy.
"""

import os
import socket
import sys

TIMEOUT_S = 3.0
WILDCARDS = {"*": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}


def tcp_address(endpoint: str) -> tuple[str, int] | None:
    """(host, port) to connect to for a ZeroMQ bind endpoint; None when there is none to try."""
    if not endpoint.startswith("tcp://"):
        return None  # ipc:// or inproc://: nothing listens on TCP
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    host = host.strip("[]")  # tcp://[::]:5555
    if not port.isdigit():
        return None  # tcp://HOST:* picks a random port, known only to --endpoint-file
    return WILDCARDS.get(host, host), int(port)


def main() -> int:
    endpoint = os.environ.get("PS_BIND", "")
    if not endpoint:
        print("healthy: no PS_BIND, so no server port to check")
        return 0
    address = tcp_address(endpoint)
    if address is None:
        print(f"healthy: PS_BIND={endpoint} has no fixed TCP port to check")
        return 0
    try:
        socket.create_connection(address, timeout=TIMEOUT_S).close()
    except OSError as exc:
        print(f"unhealthy: ps-server at {address[0]}:{address[1]} does not accept: {exc}")
        return 1
    print(f"healthy: ps-server at {address[0]}:{address[1]} accepts connections")
    return 0


if __name__ == "__main__":
    sys.exit(main())
