"""`ps-bench agent`: runs `ps-bench comm`'s clients on this host for a coordinator elsewhere.

Start one on every worker host; `ps-bench comm --agent HOST ...` on the server host then
runs each phase's server there and its floor clients or synthetic workers on the agents'
hosts, so the benchmark measures the real network between them, as iperf does.

The agent is a ZeroMQ ROUTER that answers one request at a time per message, msgpack maps
with the agent protocol's version:

    {"v": 1, "id": N, "op": "hello"}                 -> host, cores, the wire protocol, busy
    {"v": 1, "id": N, "op": "run", "role": "floor" | "synthetic", "endpoint": "tcp://IP:PORT",
     "rounds": R, "nbytes": B, "indices": [i, ...], "timeout_s": T}
                                                     -> (when the clients are done) results
    {"v": 1, "id": N, "op": "cancel"}                -> kills the job this peer started

It runs one job at a time and stays responsive while it does. It only starts its own two
kinds of client, never a command it is sent, and only against the address the request came
from: an agent cannot be used to send benchmark traffic to a third host. A request it cannot
take gets a reply saying why, and the agent goes on.
"""

import dataclasses
import ipaddress
import logging
import socket
import time
from pathlib import Path
from typing import Any

import msgpack
import zmq

from common.errors import PSError
from common.protocol import PROTOCOL_VERSION
from common.security import is_loopback_endpoint
from psserver.bench.clients import (
    CLIENT_ROLES,
    ClientJob,
    client_role,
    read_client,
    start_client,
    usable_cores,
)
from psserver.bench.procs import ProcessGroup

log = logging.getLogger("ps.bench.agent")

AGENT_PROTOCOL = 1
DEFAULT_AGENT_PORT = 5600
MAX_REQUEST_BYTES = 64 * 1024
MAX_CLIENTS = 1024  # per job on one host
MAX_ROUNDS = 1_000_000
MAX_NBYTES = 1 << 36  # 64 GiB: bigger than any model this benchmarks
MAX_TIMEOUT_S = 86_400.0


class BadRequest(Exception):
    """A request the agent refuses; the message goes back to the sender."""


def encode(message: dict[str, Any]) -> bytes:
    return msgpack.packb({"v": AGENT_PROTOCOL, **message})


def decode_request(payload: bytes) -> dict[str, Any]:
    """A request as a dict, its fields checked; BadRequest says what is wrong."""
    if len(payload) > MAX_REQUEST_BYTES:
        raise BadRequest(f"a request of {len(payload)} bytes; at most {MAX_REQUEST_BYTES}")
    try:
        request = msgpack.unpackb(payload, raw=False)
    except Exception as exc:  # whatever bytes came, the agent answers and goes on
        raise BadRequest(f"not a msgpack message ({exc})") from None
    if not isinstance(request, dict):
        raise BadRequest(f"a request is a msgpack map, not {type(request).__name__}")
    version = request.get("v")
    if version != AGENT_PROTOCOL:
        raise BadRequest(
            f"agent protocol {version!r}, this agent speaks {AGENT_PROTOCOL}: run the same "
            "release of ps-bench on every host"
        )
    if type(request.get("id")) is not int:
        raise BadRequest("a request needs an integer id")
    if request.get("op") not in ("hello", "run", "cancel"):
        raise BadRequest(f"unknown op {request.get('op')!r}; ops: hello, run, cancel")
    if request["op"] == "run":
        _check_run(request)
    return request


def _integer(request: dict[str, Any], key: str, low: int, high: int) -> int:
    value = request.get(key)
    if type(value) is not int or not low <= value <= high:
        raise BadRequest(f"{key} must be an integer from {low} to {high}, not {value!r}")
    return value


def _check_run(request: dict[str, Any]) -> None:
    if request.get("role") not in CLIENT_ROLES:
        raise BadRequest(
            f"role must be one of {', '.join(CLIENT_ROLES)}, not {request.get('role')!r}"
        )
    if not isinstance(request.get("endpoint"), str):
        raise BadRequest("endpoint must be a string like tcp://10.0.0.1:5555")
    _integer(request, "rounds", 1, MAX_ROUNDS)
    _integer(request, "nbytes", 0 if request["role"] == "synthetic" else 1, MAX_NBYTES)
    indices = request.get("indices")
    if (
        not isinstance(indices, list)
        or not 1 <= len(indices) <= MAX_CLIENTS
        or any(type(i) is not int or not 0 <= i < MAX_CLIENTS for i in indices)
        or len(set(indices)) != len(indices)
    ):
        raise BadRequest(f"indices must be 1 to {MAX_CLIENTS} distinct client numbers")
    timeout = request.get("timeout_s")
    if (
        isinstance(timeout, bool)  # an int to isinstance: True would pass for 1 second
        or not isinstance(timeout, (int, float))
        or not 1 <= timeout <= MAX_TIMEOUT_S
    ):
        raise BadRequest(f"timeout_s must be from 1 to {MAX_TIMEOUT_S:.0f} seconds")


def endpoint_address(endpoint: str) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]:
    """The IP address and port of `tcp://IP:PORT`; BadRequest for anything else."""
    transport, sep, rest = endpoint.partition("://")
    host, _, port = rest.rpartition(":")
    try:
        address = ipaddress.ip_address(host.strip("[]"))
        number = int(port)
    except ValueError:
        address, number = None, 0
    if transport != "tcp" or not sep or address is None or not 0 < number < 65536:
        raise BadRequest(f"endpoint must be tcp://IP:PORT, not {endpoint!r}")
    return address, number


def check_target(endpoint: str, peer: str | None) -> None:
    """The clients may only dial the host that asked for them (loopback, if unknown)."""
    address, _ = endpoint_address(endpoint)
    if peer is None:
        if not address.is_loopback:
            raise BadRequest("this agent takes endpoints on loopback only (its peer is unknown)")
        return
    try:
        asked_from = ipaddress.ip_address(peer)
    except ValueError:
        asked_from = None
    if address != asked_from and not (address.is_loopback and asked_from is not None
                                      and asked_from.is_loopback):  # fmt: skip
        raise BadRequest(
            f"the clients would dial {address}, but the request came from {peer}; an agent "
            "only sends traffic to the host that asks it (pass that host's address as "
            "ps-bench comm --host)"
        )


@dataclasses.dataclass
class Job:
    """Clients running for one peer's request."""

    peer_identity: bytes
    request_id: int
    job: ClientJob
    indices: list[int]
    group: ProcessGroup
    deadline: float
    started: float

    @property
    def phase(self) -> str:
        kind = "floor client" if self.job.role == "floor" else "synthetic worker"
        return f"{len(self.indices)} {kind}{'s' if len(self.indices) > 1 else ''}"


class Agent:
    def __init__(self, bind: str) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        try:
            self.socket.bind(bind)
        except zmq.ZMQError as exc:
            self.close()
            raise PSError(f"cannot listen on {bind}: {exc}") from None
        self.endpoint = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.job: Job | None = None
        self.host = socket.gethostname()

    def serve(self) -> None:
        """Answer requests until interrupted."""
        while True:
            if self.socket.poll(100):
                self._handle(self.socket.recv_multipart(copy=False))
            if self.job is not None:
                self._check_job(self.job)

    def close(self) -> None:
        if getattr(self, "job", None) is not None:
            self._end_job()
        self.socket.close(linger=0)
        self.context.term()

    def _reply(self, identity: bytes, request_id: int | None, **fields: Any) -> None:
        self.socket.send_multipart([identity, encode({"id": request_id, **fields})])

    def _handle(self, frames: list[zmq.Frame]) -> None:
        identity = frames[0].bytes
        if len(frames) != 2:
            self._reply(
                identity, None, ok=False, error=f"a request is one frame, not {len(frames) - 1}"
            )
            return
        try:
            request = decode_request(frames[1].bytes)
        except BadRequest as exc:
            log.warning("refused a request: %s", exc)
            self._reply(identity, None, ok=False, error=str(exc))
            return
        request_id, op = request["id"], request["op"]
        if op == "hello":
            self._reply(
                identity, request_id, ok=True, host=self.host, cores=usable_cores(),
                wire_protocol=PROTOCOL_VERSION, busy=self.job is not None,
            )  # fmt: skip
        elif op == "cancel":
            cancelled = self.job is not None and self.job.peer_identity == identity
            if cancelled:
                log.info("cancelled: %s", self.job.phase if self.job else "")
                self._end_job()
            self._reply(identity, request_id, ok=True, cancelled=cancelled)
        else:
            try:
                self._start_job(identity, request, self._peer_address(frames[1]))
            except BadRequest as exc:
                log.warning("refused a run: %s", exc)
                self._reply(identity, request_id, ok=False, error=str(exc))

    @staticmethod
    def _peer_address(frame: zmq.Frame) -> str | None:
        try:
            address = frame.get("Peer-Address")
        except zmq.ZMQError:  # not TCP, or a libzmq without message properties
            return None
        return address if isinstance(address, str) else None

    def _start_job(self, identity: bytes, request: dict[str, Any], peer: str | None) -> None:
        if self.job is not None:
            raise BadRequest(f"busy with {self.job.phase}; one job at a time")
        check_target(request["endpoint"], peer)
        job = ClientJob(request["role"], request["endpoint"], request["rounds"], request["nbytes"])
        try:
            group = ProcessGroup()
        except OSError as exc:
            raise BadRequest(f"could not make a scratch folder here: {exc}") from None
        now = time.monotonic()
        self.job = Job(identity, request["id"], job, request["indices"], group,
                       now + request["timeout_s"], now)  # fmt: skip
        log.info(
            "running %s against %s for %s", self.job.phase, job.endpoint, peer or "a local peer"
        )
        try:
            for index in request["indices"]:
                start_client(group, job, index)
        except OSError as exc:
            self._end_job()
            raise BadRequest(f"could not start the clients: {exc}") from None

    def _check_job(self, job: Job) -> None:
        roles = [client_role(job.job, index) for index in job.indices]
        try:
            if not job.group.finished(job.phase, roles):
                if time.monotonic() < job.deadline:
                    return
                raise PSError(
                    f"{job.phase}: still running after {job.deadline - job.started:.0f} s "
                    f"(logs in {job.group.scratch} on {self.host})"
                )
            results = [read_client(job.group, job.job, index) for index in job.indices]
        except (PSError, OSError, ValueError) as exc:
            log.warning("failed: %s", exc)
            self._reply(job.peer_identity, job.request_id, ok=False, error=f"on {self.host}: {exc}")
            self._end_job(keep_logs=True)
            return
        log.info("done: %s in %.1f s", job.phase, time.monotonic() - job.started)
        self._reply(job.peer_identity, job.request_id, ok=True, results=results)
        self._end_job()

    def _end_job(self, keep_logs: bool = False) -> None:
        job, self.job = self.job, None
        if job is None:
            return
        job.group.close(keep_logs)


def write_endpoint(path: Path | None, endpoint: str) -> None:
    if path is not None:
        path.write_text(endpoint)


def run_agent(bind: str, endpoint_file: Path | None) -> None:
    agent = Agent(bind)
    try:
        write_endpoint(endpoint_file, agent.endpoint)
        if not is_loopback_endpoint(agent.endpoint):
            log.warning(
                "%s is reachable from other hosts, unauthenticated: anyone who can reach it "
                "can make this host run benchmark clients against their own address; run "
                "agents only on a trusted network, and stop them after the benchmark",
                agent.endpoint,
            )
        log.info("listening on %s; %d cores", agent.endpoint, usable_cores())
        agent.serve()
    finally:
        agent.close()
