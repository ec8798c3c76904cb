"""`ps-bench agent`: runs a benchmark's workers on this host for a coordinator elsewhere.

Start one on every worker host; `ps-bench comm --agent HOST ...` (or `ps-bench train
--agent HOST ...`) on the server host then runs each phase's server there and its floor
clients, synthetic workers, ps-workers or DDP ranks on the agents' hosts, so the benchmark
measures the real network between them, as iperf does. An agent named with `--shard-agent`
runs a sharded run's follower shards instead.

The agent is a ZeroMQ ROUTER. Requests and replies are msgpack maps, one frame each, with
the agent protocol's version:

    {"v": 1, "id": N, "op": "hello"}          -> host, cores, GPUs, the wire protocol, busy
    {"v": 1, "id": N, "op": "run", "role": "floor" | "synthetic", "endpoint": "tcp://IP:PORT",
     "rounds": R, "nbytes": B, "indices": [i, ...], "timeout_s": T}
                                                     -> (when the clients are done) results
    {"v": 1, "id": N, "op": "run", "role": "ps-worker" | "ddp-rank" | "single",
     "endpoint": "tcp://IP:PORT" (or "" for single), "model": M, "batch_size": B,
     "steps": S, "threads": T, "world_size": N, "overlap": true, "indices": [i, ...],
     "devices": ["cpu" | "cuda:G", ...], "timeout_s": T}
                                                     -> (when they are done) results
    {"v": 1, "id": N, "op": "serve", "leader": "tcp://IP:PORT", "shards": [i, ...],
     "num_shards": K, "bind_host": "IP", "port": P, "threads": T (1 if left out),
     "shard_secret": S (optional), "timeout_s": T}   -> (when one fails) why, or (when
                                                        their leader stops them) no results
    {"v": 1, "id": N, "op": "cancel"}                -> kills the job this peer started

`serve` runs follower shards of a sharded `ps-server` (`--shard i --leader ...`), listening
on bind_host (port P + i, or any free port for P = 0), until the coordinator cancels them.
They prove shard_secret to their leader (`--shard-secret-file`, a private file here).

It runs one job at a time and stays responsive while it does. It only starts its own kinds
of process (floor clients, synthetic workers, follower shards, ps-workers, DDP ranks, the
single-process reference), never a command it is sent, and only against the address the
request came from: an agent cannot be used to send benchmark traffic to a third host. (DDP
ranks are the exception DDP makes: after their rendezvous at the asking host they connect
to each other, at the addresses the other ranks gave there.) A request it cannot take gets
a reply saying why, and the agent goes on.
"""

import dataclasses
import errno
import ipaddress
import logging
import re
import socket
import time
from pathlib import Path
from typing import Any

import msgpack
import zmq

from common.endpoint_file import write_endpoint_file
from common.errors import ProtocolError, PSError
from common.models import MODELS
from common.protocol import PROTOCOL_VERSION, unpack_header
from common.security import is_loopback_endpoint
from psserver.bench.addresses import tcp_endpoint
from psserver.bench.clients import CLIENT_ROLES, AgentWork, ClientJob, usable_cores
from psserver.bench.procs import ProcessGroup
from psserver.bench.trainjob import TRAIN_ROLES, TrainJob
from psserver.local import gpu_count
from psserver.report import WARMUP_STEPS
from psserver.shard_auth import MIN_SECRET_BYTES, write_secret_file

log = logging.getLogger("ps.bench.agent")

AGENT_PROTOCOL = 1
DEFAULT_AGENT_PORT = 5600
MAX_REQUEST_BYTES = 64 * 1024
MAX_CLIENTS = 1024  # per job on one host
MAX_ROUNDS = 1_000_000
MAX_NBYTES = 1 << 36  # 64 GiB: bigger than any model this benchmarks
MAX_TIMEOUT_S = 86_400.0
MAX_SHARDS = 1024
MAX_BATCH = 1 << 20
MAX_THREADS = 1024
MAX_SECRET_CHARS = 4096  # as a --shard-secret-file holds at most
DEVICE = re.compile(r"cpu|cuda:[0-9]{1,4}")
OPS = ("hello", "run", "serve", "cancel")


class BadRequest(Exception):
    """A request the agent refuses; the message goes back to the sender."""


def encode(message: dict[str, Any]) -> bytes:
    return msgpack.packb({"v": AGENT_PROTOCOL, **message})


def decode_request(payload: bytes) -> dict[str, Any]:
    """A request as a dict, its fields checked; BadRequest says what is wrong."""
    if len(payload) > MAX_REQUEST_BYTES:
        raise BadRequest(f"a request of {len(payload)} bytes; at most {MAX_REQUEST_BYTES}")
    try:  # bounded, as ps-server's headers are: whatever bytes came, the agent goes on
        request = unpack_header(payload, what="the request")
    except ProtocolError as exc:
        raise BadRequest(str(exc)) from None
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
    if request.get("op") not in OPS:
        raise BadRequest(f"unknown op {request.get('op')!r}; ops: {', '.join(OPS)}")
    if request["op"] == "run":
        _check_run(request)
    elif request["op"] == "serve":
        _check_serve(request)
    return request


def _integer(request: dict[str, Any], key: str, low: int, high: int) -> int:
    value = request.get(key)
    if type(value) is not int or not low <= value <= high:
        raise BadRequest(f"{key} must be an integer from {low} to {high}, not {value!r}")
    return value


def _check_run(request: dict[str, Any]) -> None:
    role = request.get("role")
    if role not in CLIENT_ROLES + TRAIN_ROLES:
        roles = ", ".join(CLIENT_ROLES + TRAIN_ROLES)
        raise BadRequest(f"role must be one of {roles}, not {role!r}")
    if not isinstance(request.get("endpoint"), str):
        raise BadRequest("endpoint must be a string like tcp://10.0.0.1:5555")
    _check_timeout(request)
    if role in TRAIN_ROLES:
        _check_training(request)
        return
    _integer(request, "rounds", 1, MAX_ROUNDS)
    _integer(request, "nbytes", 0 if role == "synthetic" else 1, MAX_NBYTES)
    _check_numbers(request, "indices", 0, MAX_CLIENTS - 1)


def _check_training(request: dict[str, Any]) -> None:
    model = request.get("model")
    if not isinstance(model, str) or model not in MODELS:
        raise BadRequest(f"model must be one of {', '.join(sorted(MODELS))}")
    _integer(request, "batch_size", 1, MAX_BATCH)
    _integer(request, "steps", WARMUP_STEPS + 1, MAX_ROUNDS)
    _integer(request, "threads", 1, MAX_THREADS)
    world_size = _integer(request, "world_size", 1, MAX_CLIENTS)
    _check_numbers(request, "indices", 0, world_size - 1)
    if type(request.get("overlap")) is not bool:
        raise BadRequest("overlap must be true or false")
    devices = request.get("devices")
    if (
        not isinstance(devices, list)
        or len(devices) != len(request["indices"])
        or not all(isinstance(d, str) and DEVICE.fullmatch(d) for d in devices)
    ):
        raise BadRequest("devices must list one device, cpu or cuda:N, for each of indices")
    if request["role"] == "single" and (request["endpoint"] or request["indices"] != [0]):
        raise BadRequest("the single process dials nothing: endpoint '' and indices [0]")


def _check_timeout(request: dict[str, Any]) -> None:
    timeout = request.get("timeout_s")
    if (
        isinstance(timeout, bool)  # an int to isinstance: True would pass for 1 second
        or not isinstance(timeout, (int, float))
        or not 1 <= timeout <= MAX_TIMEOUT_S
    ):
        raise BadRequest(f"timeout_s must be from 1 to {MAX_TIMEOUT_S:.0f} seconds")


def _check_numbers(request: dict[str, Any], key: str, low: int, high: int) -> None:
    """request[key]: a list of 1 or more distinct integers from low to high."""
    numbers = request.get(key)
    if (
        not isinstance(numbers, list)
        or not 1 <= len(numbers) <= high - low + 1
        or any(type(n) is not int or not low <= n <= high for n in numbers)
        or len(set(numbers)) != len(numbers)
    ):
        raise BadRequest(f"{key} must be a list of distinct integers from {low} to {high}")


def _check_serve(request: dict[str, Any]) -> None:
    if not isinstance(request.get("leader"), str):
        raise BadRequest("leader must be a string like tcp://10.0.0.1:5555")
    num_shards = _integer(request, "num_shards", 2, MAX_SHARDS)
    _check_numbers(request, "shards", 1, num_shards - 1)
    _integer(request, "port", 0, 65535 - num_shards)
    if "threads" in request:  # coordinators before ps-bench train --shard-agent sent none
        _integer(request, "threads", 1, MAX_THREADS)
    secret = request.get("shard_secret", "x" * MIN_SECRET_BYTES)  # coordinators before sent none
    if not isinstance(secret, str) or not MIN_SECRET_BYTES <= len(secret) <= MAX_SECRET_CHARS:
        raise BadRequest(
            f"shard_secret must be a string of {MIN_SECRET_BYTES} to {MAX_SECRET_CHARS} characters"
        )
    bind_host = request.get("bind_host")
    try:
        if not isinstance(bind_host, str):  # ip_address would take an int or bytes too
            raise ValueError(bind_host)
        ipaddress.ip_address(bind_host)
    except ValueError:
        raise BadRequest(f"bind_host must be an IP address, not {bind_host!r}") from None
    _check_timeout(request)


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
    """Processes running for one peer's request: clients or training processes, which end
    with results, or follower shards, which run until cancelled."""

    peer_identity: bytes
    request_id: int
    group: ProcessGroup
    roles: list[str]  # the processes' names in the group
    description: str  # "2 synthetic workers", "follower shard 1"
    deadline: float
    started: float
    work: AgentWork | None  # None: follower shards
    indices: list[int]  # the processes' numbers, or the shards'


def work_for(request: dict[str, Any]) -> AgentWork:
    """What a checked `run` request asks this host to run."""
    if request["role"] in TRAIN_ROLES:
        return TrainJob.from_request(request)
    return ClientJob.from_request(request)


def describe_shards(shards: list[int]) -> str:
    return f"follower shard{'s' if len(shards) > 1 else ''} {', '.join(map(str, shards))}"


def follower_args(
    request: dict[str, Any], shard: int, secret_file: Path | None = None
) -> list[str]:
    """`ps-server` as follower `shard` of the leader in `request`, bound to its bind_host;
    `secret_file` holds the request's shard secret, if it has one."""
    port = request["port"] + shard if request["port"] else "*"
    secret = ["--shard-secret-file", str(secret_file)] if secret_file is not None else []
    return [
        "--shard", str(shard), "--num-shards", str(request["num_shards"]),
        "--leader", request["leader"], "--bind", tcp_endpoint(request["bind_host"], port),
        "--threads", str(shard_threads(request)), "--log-level", "warning", *secret,
    ]  # fmt: skip


def shard_threads(request: dict[str, Any]) -> int:
    """A follower shard's torch threads: the training's (train), else one (comm)."""
    return int(request.get("threads", 1))


class Agent:
    def __init__(self, bind: str) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        try:
            self.socket.bind(bind)
        except zmq.ZMQError as exc:
            self.close()
            reason = zmq.strerror(exc.errno) if exc.errno is not None else str(exc)
            if exc.errno == errno.EADDRINUSE:
                advice = (
                    "another agent or program has that port: stop it or give this agent "
                    "another with --bind tcp://0.0.0.0:PORT"
                )
            else:  # an address of another host, say
                advice = "give --bind an address of this host, or tcp://0.0.0.0:PORT for all"
            raise PSError(f"cannot listen on {bind} ({reason}): {advice}") from None
        self.endpoint = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.job: Job | None = None
        self.host = socket.gethostname()
        self.gpus = gpu_count()  # for the coordinator to choose each process's device

    def serve(self) -> None:
        """Answer requests until interrupted."""
        while True:
            if self.socket.poll(100):
                frames = self.socket.recv_multipart(copy=False)
                try:
                    self._handle(frames)
                except Exception:  # a bug here must not end the service for everyone
                    log.exception("a request could not be handled; the agent goes on")
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
        except Exception as exc:  # a check this agent lacks must still get an answer
            log.warning("refused a request: %s", exc, exc_info=not isinstance(exc, BadRequest))
            self._reply(identity, None, ok=False, error=str(exc))
            return
        request_id, op = request["id"], request["op"]
        if op == "hello":
            self._reply(
                identity, request_id, ok=True, host=self.host, cores=usable_cores(),
                gpus=self.gpus, wire_protocol=PROTOCOL_VERSION, busy=self.job is not None,
            )  # fmt: skip
        elif op == "cancel":
            cancelled = self.job is not None and self.job.peer_identity == identity
            if cancelled:
                log.info("cancelled: %s", self.job.description if self.job else "")
                self._end_job()
            self._reply(identity, request_id, ok=True, cancelled=cancelled)
        else:  # run, serve
            try:
                self._start_job(identity, request, self._peer_address(frames[1]))
            except Exception as exc:  # BadRequest, or a bug: either way, say so and go on
                log.warning("refused a run: %s", exc, exc_info=not isinstance(exc, BadRequest))
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
            raise BadRequest(f"busy with {self.job.description}; one job at a time")
        serve = request["op"] == "serve"
        work = None if serve else work_for(request)
        target = request["leader"] if serve else work.target if work else None
        if target is not None:
            check_target(target, peer)
        indices: list[int] = request["shards"] if serve else request["indices"]
        # Training processes and follower shards get their threads (OpenMP's too); clients
        # one each.
        if serve:
            threads = shard_threads(request)
        else:
            threads = work.threads if isinstance(work, TrainJob) else 1
        try:
            group = ProcessGroup(threads)
        except OSError as exc:
            raise BadRequest(f"could not make a scratch folder here: {exc}") from None
        roles = [f"shard{i}" if work is None else work.process_name(i) for i in indices]
        description = describe_shards(indices) if work is None else work.describe(len(indices))
        now = time.monotonic()
        self.job = Job(identity, request["id"], group, roles, description,
                       now + request["timeout_s"], now, work, indices)  # fmt: skip
        against = f" against {target}" if target else ""
        log.info("running %s%s for %s", description, against, peer or "a local peer")
        try:
            if work is None:
                secret = request.get("shard_secret")
                secret_file = (  # the scratch folder is this user's alone (mkdtemp)
                    write_secret_file(group.scratch / "shard.secret", secret.encode())
                    if secret is not None
                    else None
                )
                for shard in indices:
                    group.start(
                        f"shard{shard}",
                        "psserver.cli",
                        *follower_args(request, shard, secret_file),
                        follower=True,
                    )
            else:
                work.start(group, indices)
        except Exception as exc:  # half started: end it, or nothing would ever answer it
            self._end_job()
            if isinstance(exc, OSError):
                raise BadRequest(f"could not start {description}: {exc}") from None
            raise

    def _check_job(self, job: Job) -> None:
        try:
            finished = job.group.finished(job.description, job.roles)  # raises for a failure
            if finished and job.work is None:
                # Follower shards exit cleanly only when their leader stops them, as a
                # `ps-bench train` leader does at the end of its steps: the run is over.
                log.info("done: %s, stopped by their leader", job.description)
                self._reply(job.peer_identity, job.request_id, ok=True, results=[])
                self._end_job()
                return
            if not finished:
                if time.monotonic() < job.deadline:
                    return
                raise PSError(
                    f"{job.description}: still running after {job.deadline - job.started:.0f} s "
                    f"(logs in {job.group.scratch} on {self.host})"
                )
            assert job.work is not None
            results = [job.work.read(job.group, index) for index in job.indices]
        except (PSError, OSError, ValueError) as exc:
            log.warning("failed: %s", exc)
            self._reply(job.peer_identity, job.request_id, ok=False, error=f"on {self.host}: {exc}")
            self._end_job(keep_logs=True)
            return
        log.info("done: %s in %.1f s", job.description, time.monotonic() - job.started)
        self._reply(job.peer_identity, job.request_id, ok=True, results=results)
        self._end_job()

    def _end_job(self, keep_logs: bool = False) -> None:
        job, self.job = self.job, None
        if job is None:
            return
        job.group.close(keep_logs)


def run_agent(bind: str, endpoint_file: Path | None) -> None:
    agent = Agent(bind)
    try:
        if endpoint_file is not None:
            write_endpoint_file(endpoint_file, agent.endpoint)
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
