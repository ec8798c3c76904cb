"""The floor for a sync round: a bare ZeroMQ exchange of the same bytes, nothing else.

One ROUTER server and N DEALER clients. Each round every client sends one frame of B bytes;
when the server has all N it answers each with one frame of B bytes. Buffers are allocated
once and sent zero-copy, as a parameter server would at best. No decoding, no arithmetic.
Both sides also count the CPU time they spend in the timed rounds (all but the first
WARMUP_ROUNDS), ZeroMQ's I/O thread included. At the end each client sends an empty goodbye
once it has its last reply, and the server waits for them all before it closes: over a slow
link the last replies are still on their way when the server's rounds are done.

    python -m psserver.bench.floor server --bind tcp://127.0.0.1:* --clients N --nbytes B ...
    python -m psserver.bench.floor client --server ENDPOINT --nbytes B --rounds R --out F
"""

import json
import sys
import time
from pathlib import Path

import click
import numpy as np
import zmq

from common.memory import reuse_large_buffers
from common.options import Option, options
from common.roles import Role
from common.startup import freeze_imported_objects

WARMUP_ROUNDS = 2  # untimed, as in psserver.bench.synthetic
GOODBYE_TIMEOUT_S = 60.0  # how long the server waits for its clients' goodbyes at the end
ROUND_TIMEOUT_S = 60.0  # how long either side waits for the other within a round


@click.group()
def command() -> None:
    """Bare ZeroMQ floor for ps-bench comm."""
    reuse_large_buffers()


NBYTES = Option("--nbytes", type=int, required=True)
ROUNDS = Option("--rounds", type=int, required=True)
OUT = Option("--out", type=click.Path(path_type=Path), required=True)
SERVER = Role(
    "psserver.bench.floor",
    (
        Option("--bind", default="tcp://127.0.0.1:*"),
        Option("--clients", type=int, required=True),
        NBYTES,
        ROUNDS,
        Option("--endpoint-file", type=click.Path(path_type=Path), required=True),
        OUT,
    ),
    ("server",),
)
CLIENT = Role(
    "psserver.bench.floor",
    (Option("--server", name="endpoint", required=True), NBYTES, ROUNDS, OUT),
    ("client",),
)


@command.command()
@options(SERVER.options)
def server(
    bind: str, clients: int, nbytes: int, rounds: int, endpoint_file: Path, out: Path
) -> None:
    context = zmq.Context()
    socket = context.socket(zmq.ROUTER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.bind(bind)
    endpoint_file.write_text(socket.getsockopt_string(zmq.LAST_ENDPOINT))
    reply = np.ones(nbytes, dtype=np.uint8)  # allocated once, sent zero-copy every round
    cpu_started = time.process_time()
    for round_index in range(rounds):
        if round_index == WARMUP_ROUNDS:
            cpu_started = time.process_time()
        identities: list[bytes] = []
        while len(identities) < clients:
            if not socket.poll(int(1000 * ROUND_TIMEOUT_S)):  # its clients are gone
                sys.exit(f"floor server: no message from a client in {ROUND_TIMEOUT_S:g} s")
            frames = socket.recv_multipart(copy=False)
            identities.append(frames[0].bytes)
        for identity in identities:
            socket.send_multipart([identity, reply.data], copy=False)
    cpu_seconds = time.process_time() - cpu_started
    out.write_text(json.dumps({"cpu_seconds": cpu_seconds}))
    # The last replies may still be on their way over a slow link: closing now would drop
    # them. Each client says goodbye once it has its last one.
    goodbyes = 0
    deadline = time.monotonic() + GOODBYE_TIMEOUT_S
    while goodbyes < clients and socket.poll(max(0, int(1000 * (deadline - time.monotonic())))):
        socket.recv_multipart()
        goodbyes += 1
    socket.close(linger=0)
    context.term()


@command.command()
@options(CLIENT.options)
def client(endpoint: str, nbytes: int, rounds: int, out: Path) -> None:
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(endpoint)
    payload = np.ones(nbytes, dtype=np.uint8)
    times: list[float] = []
    cpu_started = time.process_time()
    for round_index in range(rounds):
        if round_index == WARMUP_ROUNDS:
            cpu_started = time.process_time()
        started = time.perf_counter()
        socket.send(payload.data, copy=False)
        if not socket.poll(int(1000 * ROUND_TIMEOUT_S)):
            sys.exit(f"floor client: no reply in {ROUND_TIMEOUT_S:g} s")
        socket.recv(copy=False)
        times.append(time.perf_counter() - started)
    cpu_seconds = time.process_time() - cpu_started
    out.write_text(json.dumps({"round_seconds": times, "cpu_seconds": cpu_seconds}))
    socket.send(b"")  # goodbye: the server may close
    socket.close(linger=int(1000 * GOODBYE_TIMEOUT_S))
    context.term()


def main() -> None:
    freeze_imported_objects()
    command()


if __name__ == "__main__":
    main()
