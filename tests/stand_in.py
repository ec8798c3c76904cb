"""A stand-in server for worker tests: a ROUTER that answers like ps-server, with one thing
changed by a scenario (see tests/test_worker_trust.py). The `stand_in` fixture in conftest
starts one; parametrize it indirectly to give the scenario."""

import threading
from typing import Any

import torch
import zmq

from common.catalog import build_model
from common.model.flat import FlatModel
from common.wire.protocol import (
    Error,
    Heartbeat,
    HeartbeatAck,
    Leave,
    Message,
    Pull,
    Push,
    PushAck,
    Register,
    Stop,
    Weights,
    Welcome,
    decode,
    encode,
)

LENET = FlatModel(build_model("lenet"))
P, F = LENET.num_params, LENET.num_buffers
JOB: dict[str, Any] = {
    "mode": "sync", "model": "lenet", "dataset": "embedded", "world_size": 1,
    "batch_size": 16, "seed": 0, "train_limit": 640, "train_size": 640, "steps_per_epoch": 40,
    "epochs": 1, "max_steps": None, "num_params": P, "num_buffers": F, "compress": "none",
    "shard_bounds": [], "shard_endpoints": [], "push_credits": 0, "bucket_bounds": [],
    "slice_bucket_bounds": [],
}  # fmt: skip


class StandIn(threading.Thread):
    """A ROUTER that answers like a server, with one thing changed by `scenario`."""

    def __init__(self, context: zmq.Context, scenario: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.scenario = scenario
        self.socket = context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://127.0.0.1:{self.socket.bind_to_random_port('tcp://127.0.0.1')}"
        self.registers = self.pushes = 0
        self.leaves: list[str] = []  # the reasons the worker gave
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            if self.socket.poll(100):
                identity, *frames = self.socket.recv_multipart()
                reply = self.answer(decode(frames))
                if reply is not None:
                    self.socket.send_multipart([identity, *encode(reply)])
        self.socket.close(linger=0)

    def answer(self, message: Message) -> Message | None:
        scenario = self.scenario
        if isinstance(message, Heartbeat):
            return HeartbeatAck(0)
        if isinstance(message, Register):
            self.registers += 1
            job = {**JOB, **scenario.get("job", {})}
            return Welcome(self.registers, "t", scenario.get("heartbeat", 1.0), job)
        if isinstance(message, Pull):
            if "pull_answer" in scenario:  # an ERROR or a STOP, whatever it says
                return scenario["pull_answer"]
            if scenario.get("forget"):
                return Error("unknown-worker", "worker 1 is not registered here")
            weights = {
                "version": 0, "epoch": 0, "batch": 0, "rank": 0, "world_size": 1,
                "push_granted": False, "params": LENET.params.detach().clone(),
                "buffers": torch.zeros(F), **scenario.get("weights", {}),
            }  # fmt: skip
            return Weights(**weights)
        if isinstance(message, Push):
            self.pushes += 1
            if scenario.get("refuse_push"):  # as ps-server answers a gradient with a NaN
                return Error("non-finite", "worker 1 pushed NaN or Inf gradients; dropped")
            return PushAck(1, 0, True)
        if isinstance(message, Leave):
            self.leaves.append(message.reason)
            return Stop("left the job")
        return None
