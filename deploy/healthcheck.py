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
    if host in WILDCARDS:
        return WILDCARDS[host], int(port)
    return interface_address(host) or host, int(port)


def interface_address(name: str) -> str | None:
    """The IPv4 address of a network interface, as ZeroMQ binds `tcp://eth0:5555`; None when
    `name` is no interface here (then it is a host name or an address)."""
    try:
        interfaces = {interface for _, interface in socket.if_nameindex()}
    except OSError:  # no interface list on this system
        return None
    if name not in interfaces:
        return None
    import fcntl  # Linux and the BSDs: a container's health check runs on Linux
    import struct

    siocgifaddr = 0x8915  # Linux's ioctl for an interface's IPv4 address
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            answer = fcntl.ioctl(probe.fileno(), siocgifaddr, struct.pack("256s", name.encode()))
        except OSError:  # no IPv4 address on it
            return None
    return socket.inet_ntoa(answer[20:24])  # struct ifreq: the name, then a sockaddr_in


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
