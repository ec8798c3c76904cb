"""The coordinator's link to one `ps-bench agent`: where an agent is (`--agent HOST[:PORT]`),
and its requests out and replies in, matched by id, with a hello now and then to tell an
agent that went silent from one that is busy; and how requests are spread over agents
(`round_robin`).

What this is not: which clients or shards an agent runs, nor waiting on them all
(psserver.bench.remote); the messages themselves are psserver.bench.agentwire's.
"""

import socket
import time
from typing import Any

import msgpack
import zmq

from common.errors import PSError
from psserver.bench.addresses import host_and_port, tcp_endpoint
from psserver.bench.agentwire import AGENT_PROTOCOL, DEFAULT_AGENT_PORT, encode

HELLO_TIMEOUT_S = 10.0
# Long enough for a cancel to leave when the coordinator closes after a failure.
CLOSE_LINGER_MS = 1000
# While an agent runs clients it is asked hello this often, and is taken for gone when it has
# not answered for AGENT_SILENCE_S: an agent stopped mid-run used to leave the coordinator
# waiting, silent, for the whole --timeout (30 minutes by default).
PING_INTERVAL_S = 2.0
AGENT_SILENCE_S = 15.0
# How long after the agents' own deadline the coordinator gives up on their replies.
REPLY_GRACE_S = 30.0


def round_robin(items: list[int], agents: int) -> dict[int, list[int]]:
    """items[j] goes to agent j mod `agents`; agents left with nothing are left out."""
    spread = {agent: items[agent::agents] for agent in range(agents)}
    return {agent: mine for agent, mine in spread.items() if mine}


def parse_agent(text: str) -> tuple[str, int]:
    """HOST, HOST:PORT or tcp://HOST:PORT as (HOST, PORT); ValueError says what is wrong."""
    form = "expected HOST, HOST:PORT or tcp://HOST:PORT"
    address = text.removeprefix("tcp://")
    if "://" in address:
        raise ValueError(f"{form}; an agent listens on TCP only")
    host, sep, port = address.rpartition(":")
    if not sep or "]" in port:  # no port (an IPv6 address in brackets has colons inside)
        host, port = address, str(DEFAULT_AGENT_PORT)
    if not host:
        raise ValueError(f"{form}: the host is missing")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"the port must be a number from 1 to 65535, not {port!r}")
    return host.strip("[]"), int(port)


def agent_endpoint(text: str) -> str:
    """HOST, HOST:PORT or tcp://HOST:PORT, as a ZeroMQ endpoint to dial."""
    try:
        host, port = parse_agent(text)
    except ValueError as exc:
        raise PSError(f"--agent {text!r}: {exc}") from None
    return tcp_endpoint(host, port)


class AgentLink:
    """One agent: requests out, replies matched to them by id."""

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]], endpoint: str) -> None:
        self.endpoint = endpoint
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, CLOSE_LINGER_MS)
        self.socket.connect(endpoint)
        self.next_id = 1
        self.inbox: dict[int | None, dict[str, Any]] = {}  # replies not yet asked for
        self.heard = time.monotonic()  # when the agent last answered anything
        self.ping: int | None = None  # the hello that checks it is still there ...
        self.ping_sent = 0.0  # ... sent then

    def send(self, op: str, **fields: Any) -> int:
        request_id, self.next_id = self.next_id, self.next_id + 1
        self.socket.send(encode({"id": request_id, "op": op, **fields}))
        return request_id

    def reply(self, request_id: int) -> dict[str, Any] | None:
        """The reply to `request_id` if it is in. Replies to other requests wait in the
        inbox for theirs; one to no request (the agent could not read it) is an error."""
        while self.socket.poll(0):
            received = self._decode(self.socket.recv())
            self.inbox[received.get("id")] = received
            self.heard = time.monotonic()
        key = request_id if request_id in self.inbox else None
        reply = self.inbox.pop(key) if key in self.inbox else None
        if reply is not None and not reply.get("ok"):
            raise PSError(f"agent {self.endpoint}: {reply.get('error', 'refused')}")
        return reply

    def check_alive(self, phase: str) -> None:
        """Ask hello when nothing was heard for PING_INTERVAL_S; a PSError once a hello has
        waited AGENT_SILENCE_S for its answer (the agent stopped, its host is down, or the
        network between is cut). Silence is counted from the hello, not from the last reply:
        a link not watched for a while (between phases) is not silent, only unasked."""
        now = time.monotonic()
        if self.ping is not None:
            if self.reply(self.ping) is not None:
                self.ping = None
            elif now - self.ping_sent > AGENT_SILENCE_S:
                raise PSError(
                    f"{phase}: the agent at {self.endpoint} has not answered for "
                    f"{now - self.ping_sent:.0f} s: it stopped, or its host cannot be reached; "
                    "check it (its log says why), then run the benchmark again"
                )
        if self.ping is None and now - self.heard > PING_INTERVAL_S:
            self.ping, self.ping_sent = self.send("hello"), now

    def _decode(self, payload: bytes) -> dict[str, Any]:
        try:
            reply = msgpack.unpackb(payload, raw=False)
        except (ValueError, msgpack.UnpackException):
            reply = None
        if not isinstance(reply, dict) or reply.get("v") != AGENT_PROTOCOL:
            raise PSError(
                f"{self.endpoint} does not answer as a ps-bench agent of this release "
                f"(agent protocol {AGENT_PROTOCOL}); run the same release on every host"
            )
        return reply

    def hello(self) -> dict[str, Any]:
        request_id = self.send("hello")
        deadline = time.monotonic() + HELLO_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.socket.poll(100):
                reply = self.reply(request_id)
                if reply is not None:
                    return reply
        raise PSError(
            f"no ps-bench agent answered at {self.endpoint} within {HELLO_TIMEOUT_S:.0f} s: "
            "start one there with `ps-bench agent`, and check that this host can reach it"
        )


def agent_ip(endpoint: str) -> str:
    """The IP address an agent's endpoint names: where a follower shard there listens."""
    host, _ = host_and_port(endpoint)
    try:
        return str(socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0])
    except OSError as exc:
        raise PSError(f"cannot resolve the agent's host {host!r}: {exc}") from None
