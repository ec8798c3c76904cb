"""Async mode applies every gradient as it arrives: with lr 1 and no momentum, k pushed
gradients change the weights by exactly their sum, and staleness is measured per push."""

import json

import torch
import zmq

from common.wire.protocol import Pull, Push, PushAck, Stop, Weights, Welcome, encode
from tests.harness import Cluster
from tests.raw_peers import RawClient


def pull(client: RawClient, worker_id: int) -> Weights:
    reply = client.request(Pull(worker_id, client.token))
    assert isinstance(reply, Weights), reply
    return reply


def push(client: RawClient, worker_id: int, weights: Weights, grads: torch.Tensor) -> PushAck:
    reply = client.request(
        Push(
            worker_id,
            client.token,
            weights.version,
            weights.epoch,
            weights.batch,
            1,
            0.0,
            0,
            grads,
            torch.empty(0, dtype=torch.int32),
            torch.empty(0),
        )
    )
    assert isinstance(reply, PushAck), reply
    return reply


def test_pushed_gradients_change_weights_by_exactly_their_sum(
    cluster: Cluster, zmq_context: zmq.Context
) -> None:
    summary_path = cluster.workdir / "summary.json"
    server, endpoint = cluster.start_server(
        "--mode",
        "async",
        "--no-staleness-lr",
        "--model",
        "lenet",
        "--workers",
        "2",
        "--lr",
        "1",
        "--momentum",
        "0",
        "--max-steps",
        "8",
        "--train-limit",
        "640",
        "--batch-size",
        "8",
        "--test-limit",
        "50",
        "--summary",
        str(summary_path),
    )
    a, b = RawClient(zmq_context, endpoint), RawClient(zmq_context, endpoint)
    welcome_a, welcome_b = a.register("a"), b.register("b")
    assert isinstance(welcome_a, Welcome) and isinstance(welcome_b, Welcome)
    ida, idb = welcome_a.worker_id, welcome_b.worker_id

    # Training starts once both have asked for work; b's first weights go unused.
    a.socket.send_multipart(encode(Pull(ida, a.token)))
    b.socket.send_multipart(encode(Pull(idb, b.token)))
    w0 = a.receive("a's first weights")
    assert isinstance(b.receive("b's first weights"), Weights)
    assert isinstance(w0, Weights) and w0.version == 0

    # First push the weights themselves: w - w is exactly 0 in floating point.
    start = w0.params.clone()
    assert push(a, ida, w0, start).version == 1
    assert torch.count_nonzero(pull(a, ida).params) == 0

    # Then small integers, whose sums are exact in float32. Two workers pull the same version
    # and push one after the other, so the second push is one version stale.
    generator = torch.Generator().manual_seed(0)
    pushed = []
    staleness = []
    for _ in range(3):
        wa, wb = pull(a, ida), pull(b, idb)
        assert wa.version == wb.version
        for client, worker_id, weights in ((a, ida, wa), (b, idb, wb)):
            grads = torch.randint(-8, 9, start.shape, generator=generator).float()
            ack = push(client, worker_id, weights, grads)
            pushed.append(grads)
            staleness.append(ack.staleness)
    assert staleness == [0, 1, 0, 1, 0, 1]

    final = pull(a, ida)
    assert final.version == 7
    assert torch.equal(final.params, -torch.stack(pushed).sum(dim=0))

    # The eighth update ends the run (--max-steps 8); both clients are then told to stop.
    push(a, ida, final, torch.zeros_like(start))
    assert isinstance(a.request(Pull(ida, a.token)), Stop)
    assert isinstance(b.request(Pull(idb, b.token)), Stop)
    cluster.wait(server, timeout=60)
    summary = json.loads(summary_path.read_text())
    assert summary["global_steps"] == 8
    assert summary["staleness"]["histogram"] == {"0": 5, "1": 3}
    assert summary["staleness"]["max"] == 1
