"""`ps-bench agent`: runs a benchmark's workers on this host for a coordinator elsewhere.

Start one on every worker host; `ps-bench comm --agent HOST ...` (or `ps-bench train
--agent HOST ...`) on the server host then runs each phase's server there and its floor
clients, synthetic workers, ps-workers or DDP ranks on the agents' hosts, so the benchmark
measures the real network between them, as iperf does. An agent named with `--shard-agent`
runs a sharded run's follower shards instead.

The agent is a ZeroMQ ROUTER; its requests, replies and their checks are in
psserver.bench.agentwire, its jobs in psserver.bench.agentjob, and starting, watching and
ending them in psserver.bench.agentrunner. This module is its serving loop: requests in,
each answered or handed to the runner.

It runs one job at a time and stays responsive while it does. It only starts its own kinds
of process (floor clients, synthetic workers, follower shards, ps-workers, DDP ranks, the
single-process reference), never a command it is sent, and only against the address the
request came from: an agent cannot be used to send benchmark traffic to a third host. (DDP
ranks are the exception DDP makes: after their rendezvous at the asking host they connect
to each other, at the addresses the other ranks gave there.) A request it cannot take gets
a reply saying why, and the agent goes on.
"""

import errno
import logging
import socket
from pathlib import Path
from typing import Any

import zmq

from common.errors import PSError
from common.wire.endpoint_file import write_endpoint_file
from common.wire.protocol import PROTOCOL_VERSION
from common.wire.security import is_loopback_endpoint
from psserver.bench.agentrunner import JobRunner
from psserver.bench.agentwire import BadRequest, decode_request, encode
from psserver.bench.clients import usable_cores
from psserver.cli.devices import gpu_count

log = logging.getLogger("ps.bench.agent")


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
        self.host = socket.gethostname()
        self.runner = JobRunner(self.host, self._reply)
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
            self.runner.check()

    def close(self) -> None:
        if getattr(self, "runner", None) is not None:
            self.runner.end()
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
                gpus=self.gpus, wire_protocol=PROTOCOL_VERSION, busy=self.runner.job is not None,
            )  # fmt: skip
        elif op == "cancel":
            cancelled = self.runner.cancel(identity)
            self._reply(identity, request_id, ok=True, cancelled=cancelled)
        else:  # run, serve
            try:
                self.runner.start(identity, request, self._peer_address(frames[1]))
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
