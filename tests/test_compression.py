"""Gradient compression: fp16/bf16 halve the bytes, top-k sends a fraction with error
feedback that loses nothing, the server applies sparse pushes exactly, and training with
compression still learns."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import zmq

from common.compression import CompressionSpec, GradientCompressor, HostStaging, wire_bytes
from common.errors import ConfigError
from common.wire.protocol import Pull, Push, PushAck, Weights
from tests.harness import Cluster
from tests.raw_peers import RawClient


def test_parse_specs() -> None:
    assert CompressionSpec.parse("none").kind == "none"
    assert CompressionSpec.parse("topk:0.25") == CompressionSpec("topk", 0.25)
    for bad in ("zip", "topk", "topk:0", "topk:1.5", "fp16:0.5", "topk:x"):
        with pytest.raises(ConfigError, match="--compress"):
            CompressionSpec.parse(bad)


@pytest.mark.parametrize(("kind", "dtype"), [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_half_precision_halves_the_bytes(kind: str, dtype: torch.dtype) -> None:
    grads = torch.randn(1000)
    values, indices = GradientCompressor(CompressionSpec(kind), 1000, torch.device("cpu")).compress(
        grads
    )
    assert values.dtype == dtype and indices.numel() == 0
    assert wire_bytes(values, indices) == 2000
    torch.testing.assert_close(values.float(), grads, rtol=1e-2, atol=1e-2)


def test_topk_with_error_feedback_loses_nothing() -> None:
    n, steps = 1000, 30
    compressor = GradientCompressor(CompressionSpec("topk", 0.05), n, torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    sent, total = torch.zeros(n), torch.zeros(n)
    for _ in range(steps):
        grads = torch.randn(n, generator=generator)
        total += grads
        values, indices = compressor.compress(grads)
        assert values.numel() == indices.numel() == 50 and indices.dtype == torch.int32
        assert wire_bytes(values, indices) == 50 * 8  # vs 4000 bytes dense
        sent.index_add_(0, indices.long(), values)
    assert compressor.residual is not None
    # What was sent plus what is still owed is exactly what was computed.
    torch.testing.assert_close(sent + compressor.residual, total, rtol=1e-5, atol=1e-5)
    # The largest entries go first: what is owed is small next to what was sent.
    assert compressor.residual.abs().max() < sent.abs().max()


def test_topk_takes_back_what_a_dropped_push_sent() -> None:
    """Every third push is dropped by the server (late): what it sent goes back into the
    residual, so sent-and-applied plus the residual is still what was computed: equal to
    float rounding (rtol and atol 1e-5), as the two sides add the same values in another
    order."""
    n = 1000
    compressor = GradientCompressor(CompressionSpec("topk", 0.05), n, torch.device("cpu"))
    generator = torch.Generator().manual_seed(1)
    applied, total = torch.zeros(n), torch.zeros(n)
    for step in range(30):
        grads = torch.randn(n, generator=generator)
        total += grads
        values, indices = compressor.compress(grads)
        if step % 3 == 2:
            compressor.take_back()
        else:
            applied.index_add_(0, indices.long(), values)
    compressor.take_back()  # after an applied push: nothing to take back, nothing changes
    assert compressor.residual is not None
    torch.testing.assert_close(applied + compressor.residual, total, rtol=1e-5, atol=1e-5)


def test_fp16_sends_values_beyond_its_range_in_float32() -> None:
    """Rounded to fp16, 1e5 is infinity, which the server refuses as non-finite (the worker
    used to stop there): such a piece goes in float32; others stay fp16."""
    compressor = GradientCompressor(CompressionSpec("fp16"), 4, torch.device("cpu"))
    big = torch.tensor([1.0, -1e5, 3.0, 0.5])
    values, _ = compressor.compress(big)
    assert values.dtype == torch.float32 and torch.equal(values, big)
    small, _ = compressor.compress(torch.tensor([1.0, -6e4, 3.0, 0.5]))
    assert small.dtype == torch.float16 and bool(torch.isfinite(small).all())
    assert compressor.compress(torch.empty(0))[0].dtype == torch.float16


def test_bf16_sends_values_beyond_its_range_in_float32() -> None:
    """bf16 rounds float32 values within 0.2 % of float32's largest to infinity, which the
    server refused as non-finite, and the worker stopped."""
    compressor = GradientCompressor(CompressionSpec("bf16"), 3, torch.device("cpu"))
    big = torch.tensor([1.0, 3.3962e38, -3.3962e38])
    values, _ = compressor.compress(big)
    assert values.dtype == torch.float32 and torch.equal(values, big)
    assert compressor.compress(torch.tensor([1.0, 3e38, 2.0]))[0].dtype == torch.bfloat16


def lies_in(piece: torch.Tensor, buffer: torch.Tensor, offset: int) -> bool:
    return piece.data_ptr() == buffer.data_ptr() + offset * buffer.element_size()


@pytest.mark.parametrize("kind", ["none", "fp16"])
def test_staged_pieces_each_have_their_place_and_the_next_step_reuses_it(kind: str) -> None:
    """What a GPU worker does with pinned memory (here unpinned, on the CPU): every piece of
    the flat gradient is copied to the range it covers in one host buffer per dtype."""
    flat = torch.randn(1000)
    staging = HostStaging(1000, pinned=False)
    compressor = GradientCompressor(
        CompressionSpec.parse(kind), 1000, torch.device("cpu"), staging=staging
    )
    dtype = torch.float32 if kind == "none" else torch.float16
    pieces = [(0, 300), (300, 1000), (990, 1000)]
    sent = [compressor.compress(flat[lo:hi])[0] for lo, hi in pieces]
    buffer = staging._buffers[dtype]
    for (lo, hi), values in zip(pieces, sent, strict=True):
        assert values.dtype == dtype and torch.equal(values, flat[lo:hi].to(dtype))
        assert lies_in(values, buffer, lo), "each piece in its own place"
    flat.mul_(-2)  # the next step's gradient: the same places, the new values
    again = compressor.compress(flat[300:1000])[0]
    assert lies_in(again, buffer, 300) and torch.equal(again, flat[300:1000].to(dtype))
    assert list(staging._buffers) == [dtype], "one buffer per dtype, allocated once"


def test_staging_sends_a_piece_too_big_for_fp16_from_the_float32_buffer() -> None:
    flat = torch.ones(100)
    flat[60] = 1e6
    staging = HostStaging(100, pinned=False)
    compressor = GradientCompressor(
        CompressionSpec.parse("fp16"), 100, torch.device("cpu"), staging=staging
    )
    fits, too_big = compressor.compress(flat[:50])[0], compressor.compress(flat[50:])[0]
    assert fits.dtype == torch.float16 and lies_in(fits, staging._buffers[torch.float16], 0)
    assert too_big.dtype == torch.float32 and torch.equal(too_big, flat[50:])
    assert lies_in(too_big, staging._buffers[torch.float32], 50)


def test_staging_copies_what_is_not_a_piece_of_the_flat_vector() -> None:
    staging = HostStaging(10, pinned=False)
    longer = torch.arange(20.0)
    assert torch.equal(staging.to_host(longer, 0), longer) and not staging._buffers


def test_a_cpu_worker_sends_float32_pieces_from_the_gradient_itself() -> None:
    """No staging on the CPU: the piece is the gradient's own memory (zero copy)."""
    flat = torch.randn(100)
    compressor = GradientCompressor(CompressionSpec.parse("none"), 100, torch.device("cpu"))
    assert compressor.compress(flat[40:])[0].data_ptr() == flat[40:].data_ptr()


def test_server_applies_a_sparse_push_exactly(cluster: Cluster, zmq_context: zmq.Context) -> None:
    server, endpoint = cluster.start_server(
        "--mode",
        "async",
        "--model",
        "lenet",
        "--workers",
        "1",
        "--lr",
        "1",
        "--max-steps",
        "2",
        "--train-limit",
        "64",
        "--batch-size",
        "8",
        "--test-limit",
        "10",
        "--compress",
        "topk:0.001",
    )
    client = RawClient(zmq_context, endpoint)
    client.register()
    weights = client.request(Pull(1, client.token))
    assert isinstance(weights, Weights)
    before = weights.params.clone()
    indices = torch.tensor([0, 5, 129067], dtype=torch.int32)
    values = torch.tensor([1.0, -2.0, 0.5])
    ack = client.request(
        Push(
            1,
            client.token,
            0,
            weights.epoch,
            weights.batch,
            8,
            0.0,
            0,
            values,
            indices,
            torch.empty(0),
        )
    )
    assert isinstance(ack, PushAck) and ack.applied
    after = client.request(Pull(1, client.token))
    assert isinstance(after, Weights)
    expected = before.clone()
    expected.index_add_(0, indices.long(), -values)
    assert torch.equal(after.params, expected)
    bad = client.request(
        Push(
            1,
            client.token,
            1,
            after.epoch,
            after.batch,
            8,
            0.0,
            0,
            values,
            torch.tensor([0, 1, 10**6], dtype=torch.int32),
            torch.empty(0),
        )
    )
    assert getattr(bad, "code", None) == "wrong-shape"
    client.close()
    server.process.kill()


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("compress", ["fp16", "topk:0.05"])
def test_training_with_compression_learns_and_moves_fewer_bytes(
    tmp_path: Path, compress: str
) -> None:
    summary_path = tmp_path / "summary.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "psserver.cli.local",
            "--model",
            "lenet",
            "--workers",
            "2",
            "--epochs",
            "2",
            "--batch-size",
            "64",
            "--lr",
            "0.1",
            "--momentum",
            "0.9",
            "--threads",
            "1",
            "--compress",
            compress,
            "--summary",
            str(summary_path),
        ],
        capture_output=True,
        text=True,
        timeout=280,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    summary = json.loads(summary_path.read_text())
    dense = 4 * 129068
    ratio = summary["push_bytes_per_push"] / dense
    expected = 0.5 if compress == "fp16" else 0.05 * 2  # top-k: values and int32 indices
    assert ratio == pytest.approx(expected, rel=0.01)
    assert summary["test_accuracy"] > 0.5, summary


@pytest.mark.parametrize("compress", ["topk:0.1", "none"])
def test_a_resumed_topk_run_says_its_workers_residuals_start_empty(
    cluster: Cluster, compress: str
) -> None:
    """Top-k's residual lives in each worker, not in the checkpoint: a resumed top-k run does
    not end with an uninterrupted run's weights, though README promised "to the bit". The
    server now says so when it resumes one; a dense run, which does end there, hears nothing."""
    job = [
        "--model", "lenet", "--workers", "1", "--batch-size", "32", "--train-limit", "320",
        "--test-limit", "50", "--compress", compress, "--checkpoint-dir",
        str(cluster.workdir / "ckpt"),
    ]  # fmt: skip
    logs = []
    for extra in (["--max-steps", "2"], ["--max-steps", "4", "--resume"]):
        server, endpoint = cluster.start_server(*job, *extra, name=f"server-{len(logs)}")
        cluster.start_worker(endpoint, name=f"worker-{len(logs)}")
        cluster.wait_all(timeout=120)
        logs.append(server.stderr())
    warning = "top-k residuals (the gradient each had not sent yet) are not part of the checkpoint"
    assert warning not in logs[0]
    assert (warning in logs[1]) == (compress != "none"), logs[1]
    if compress != "none":
        assert "will not end with the same weights, to the bit" in logs[1]
