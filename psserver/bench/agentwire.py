"""The `ps-bench agent` protocol: its messages, their encoding, and the checks a request
must pass before the agent acts on it.

Requests and replies are msgpack maps, one frame each, with the agent protocol's version:

    {"v": 1, "id": N, "op": "hello"}          -> host, cores, GPUs, the wire protocol, busy
    {"v": 1, "id": N, "op": "run", "role": "floor" | "synthetic", "endpoint": "tcp://IP:PORT",
     "rounds": R, "nbytes": B, "indices": [i, ...], "timeout_s": T}
                                                     -> (when the clients are done) results
    {"v": 1, "id": N, "op": "run", "role": "ps-worker" | "ddp-rank" | "apart-rank" | "single",
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

What this is not: the agent's socket or its processes (psserver.bench.agent, .agentjob), nor
the coordinator's side (psserver.bench.agentlink). Both sides import this module, the
coordinator for `encode` and the constants.
"""

import ipaddress
import re
from typing import Any

import msgpack

from common.errors import ProtocolError
from common.model.builtin import MODELS
from common.wire.protocol import unpack_header
from psserver.bench.clients import CLIENT_ROLES
from psserver.bench.trainjob import TRAIN_ROLES
from psserver.shards.auth import MAX_SECRET_FILE_BYTES, MIN_SECRET_BYTES
from psserver.status.report import WARMUP_STEPS

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
MAX_SECRET_CHARS = MAX_SECRET_FILE_BYTES  # as a --shard-secret-file holds at most
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
