"""Hand-driven peers for exact and hostile tests: a DEALER that speaks the protocol message by
message (RawClient), heartbeats that keep such workers alive (Heartbeats), a CURVE server's
socket (CurveServer), a stand-in follower shard's socket (hand_driven_follower), and the
PUSH and PULL of a follower's slice as a worker sends them (slice_push, slice_pull).

What this is not: starting real ps-server / ps-worker processes (tests.harness).
"""

import os
import threading
from dataclasses import dataclass

import torch
import zmq

from common.catalog import all_fingerprints
from common.job import JobSpec
from common.wire.protocol import (
    WHOLE,
    Heartbeat,
    Message,
    Pull,
    Push,
    Register,
    Weights,
    Welcome,
    decode,
    encode,
)
from common.wire.security import ClientSecurity, secure_client_socket
from psworker.connection.registration import new_process_identity


@dataclass
class CurveServer:
    """A CURVE ROUTER (the `curve_server` fixture) and where it listens."""

    router: zmq.Socket
    endpoint: str


class RawClient:
    """A hand-driven DEALER socket speaking the protocol, for exact and hostile tests."""

    def __init__(
        self, context: zmq.Context, endpoint: str, timeout_s: float = 30.0,
        security: ClientSecurity | None = None,
    ) -> None:  # fmt: skip
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        if security is not None:  # CURVE, with this client's key pair
            secure_client_socket(self.socket, security)
        self.socket.connect(endpoint)
        self.endpoint = endpoint
        self.timeout_ms = int(timeout_s * 1000)
        self.token = ""  # set by a successful register()
        self.process = new_process_identity()  # a process of its own, as each ps-worker is

    def send_frames(self, frames: list[bytes]) -> None:
        self.socket.send_multipart(frames)

    def receive(self, waiting_for: str) -> Message:
        if not self.socket.poll(self.timeout_ms):
            raise AssertionError(
                f"no reply within {self.timeout_ms} ms while waiting for {waiting_for}"
            )
        return decode(self.socket.recv_multipart())

    def request(self, message: Message) -> Message:
        self.socket.send_multipart(encode(message))
        return self.receive(f"the reply to {type(message).__name__}")

    def register(self, name: str = "raw") -> Message:
        register = Register(name, "localhost", "cpu", os.getpid(), self.process, all_fingerprints())
        reply = self.request(register)
        if isinstance(reply, Welcome):
            self.token = reply.token
        return reply

    def close(self) -> None:
        self.socket.close(linger=0)


class Heartbeats:
    """Keeps hand-driven workers alive from a thread, each on a socket of its own."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint, self.context = endpoint, zmq.Context()
        self.workers: list[tuple[int, str]] = []  # (worker id, token)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._beat, daemon=True)
        self.thread.start()

    def add(self, worker_id: int, token: str) -> None:
        self.workers.append((worker_id, token))

    def _beat(self) -> None:
        sockets: dict[int, RawClient] = {}
        while not self.stopped.wait(0.3):
            for worker_id, token in list(self.workers):
                client = sockets.setdefault(worker_id, RawClient(self.context, self.endpoint, 5))
                client.request(Heartbeat(worker_id, token))
        for client in sockets.values():
            client.close()

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(timeout=10)
        self.context.term()


def hand_driven_follower(
    context: zmq.Context, slice_bucket_bounds: tuple[tuple[int, ...], ...] = ()
) -> tuple[zmq.Socket, JobSpec]:
    """A ROUTER socket that stands in for follower shard 1 of a 10-parameter job whose leader
    owns [4, 10), and that job."""
    follower = context.socket(zmq.ROUTER)
    follower.setsockopt(zmq.LINGER, 0)
    port = follower.bind_to_random_port("tcp://127.0.0.1")
    job = JobSpec(
        "sync", "lenet", "embedded", 2, 8, 0, None, 64, 4, 1, None, 10, 0, "none",
        shard_bounds=(0, 4, 10), shard_endpoints=(f"tcp://127.0.0.1:{port}",),
        slice_bucket_bounds=slice_bucket_bounds,
    )  # fmt: skip
    return follower, job


NO_INDICES = torch.empty(0, dtype=torch.int32)
NO_VALUES = torch.empty(0)


def slice_push(
    worker_id: int, token: str, version: int, epoch: int, batch: int, grads: torch.Tensor,
    bucket: int = WHOLE, *, shard: int = 1, parts: int = 0, samples: int = 8,
    indices: torch.Tensor = NO_INDICES,
) -> Push:  # fmt: skip
    """A worker's PUSH of follower `shard`'s slice (bucket -1), or of one bucket of it: the
    step's numbers for the logs are zero, and only shard 0's whole PUSH has buffers."""
    return Push(
        worker_id, token, version, epoch, batch, samples, 0.0, 0, grads, indices, NO_VALUES,
        parts, shard, bucket,
    )  # fmt: skip


def completing_push(
    worker_id: int, token: str, version: int, epoch: int, batch: int, parts: int,
    *, shard: int = 1, samples: int = 8,
) -> Push:  # fmt: skip
    """The PUSH that completes a follower's slice sent as `parts` buckets: it is answered."""
    return slice_push(
        worker_id, token, version, epoch, batch, NO_VALUES, shard=shard, parts=parts,
        samples=samples,
    )  # fmt: skip


def slice_pull(
    worker_id: int, token: str, min_version: int, *, shard: int = 1, have_version: int = -1
) -> Pull:
    """A worker's PULL of follower `shard`'s slice, held until it has `min_version` updates;
    `have_version`: the version the worker says it holds whole from streamed buckets."""
    return Pull(worker_id, token, have_version, shard, min_version)


def streamed_bucket(version: int, bucket: int, params: torch.Tensor, shard: int = 0) -> Weights:
    """An updated bucket of `shard`'s slice, as a shard streams it to a worker unasked."""
    return Weights(version, -1, -1, -1, 0, False, params, NO_VALUES, shard=shard, bucket=bucket)


def slice_weights(
    version: int, params: torch.Tensor, *, shard: int = 1, streamed: bool = False
) -> Weights:
    """Follower `shard`'s answer to a worker's PULL: its slice, or (`streamed`) none."""
    return Weights(version, -1, -1, -1, 0, False, params, NO_VALUES, streamed, shard=shard)


def bucket_push(
    worker_id: int, token: str, version: int, epoch: int, batch: int, samples: int, bucket: int,
    grads: torch.Tensor, shard: int = 0,
) -> Push:  # fmt: skip
    """One bucket of `shard`'s slice of a gradient, as a worker sends it ahead of the PUSH
    that completes them (never answered)."""
    return Push(
        worker_id, token, version, epoch, batch, samples, 0.0, 0, grads, NO_INDICES, NO_VALUES,
        0, shard, bucket,
    )  # fmt: skip
