"""TCP endpoints and routes, as the benchmark's hosts and agents use them.

One place for spelling `tcp://HOST:PORT` (an IPv6 address in brackets), for reading it back,
and for asking which local address and interface lie on the route to one: the coordinator,
the agents and the training jobs they start all need the same answers.
"""

import fcntl
import ipaddress
import socket
import struct

SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


def tcp_endpoint(host: str, port: int | str) -> str:
    """tcp://HOST:PORT, with an IPv6 address in brackets; PORT may be ZeroMQ's '*'."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def host_and_port(endpoint: str) -> tuple[str, str]:
    """tcp://HOST:PORT as (HOST, without an IPv6 address's brackets, and PORT)."""
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    return host.strip("[]"), port


def source_address_towards(endpoint: str) -> str:
    """This host's address on its route to `endpoint`; OSError if there is none.

    Connecting a UDP socket picks the route and the source address, and sends nothing."""
    host, port = host_and_port(endpoint)
    family, kind, proto, _, address = socket.getaddrinfo(host, int(port), type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, kind, proto) as probe:
        probe.connect(address)
        return str(probe.getsockname()[0])


def interface_towards(endpoint: str) -> str | None:
    """The name of this host's network interface on its route to `endpoint` (an IPv4
    address), or None where that cannot be found (IPv6, a host name, or not Linux)."""
    host, _ = host_and_port(endpoint)
    try:
        if ipaddress.ip_address(host).version != 4:
            return None
        source = socket.inet_aton(source_address_towards(endpoint))
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            for _, name in socket.if_nameindex():
                request = struct.pack("256s", name.encode()[:15])
                try:
                    answer = fcntl.ioctl(probe.fileno(), SIOCGIFADDR, request)
                except OSError:  # no IPv4 address on this one
                    continue
                if answer[20:24] == source:
                    return name
    except (ValueError, OSError):
        return None
    return None
