"""A GPU that cannot be used, or that fails while training, gets a line that says what to do
and, for a worker, a LEAVE, so that no sync step waits for it. This machine has no GPU: the
CUDA calls are stood in for, and a worker's step raises what torch raises on a full GPU."""

import pytest
import torch

from common.catalog import build_model
from common.data import DataSource, ImageSet, load_split
from common.device import check_device, device_failure, resolve_device
from common.errors import DeviceError
from psserver import evaluation
from psserver.cli import devices
from psworker.connection import Connection
from psworker.trainer import Worker
from tests.stand_in import StandIn

pytestmark = pytest.mark.timeout(120)
CUDA = torch.device("cuda", 0)
OUT_OF_MEMORY = "CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 15.77 GiB total)"


@pytest.fixture
def two_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch sees two CUDA devices, neither of which can hold a tensor."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    real_empty = torch.empty

    def empty(*size: int, device: torch.device | str | None = None) -> torch.Tensor:
        if device is not None and torch.device(device).type == "cuda":
            raise RuntimeError("CUDA error: all CUDA-capable devices are busy or unavailable")
        return real_empty(*size, device=device)

    monkeypatch.setattr(torch, "empty", empty)


def test_a_gpu_that_cannot_hold_a_tensor_is_refused_at_start(two_gpus: None) -> None:
    with pytest.raises(DeviceError) as caught:
        check_device("cuda:1", "--gpu 1")
    message = str(caught.value)
    assert message.startswith("--gpu 1: CUDA device 1 cannot be used (CUDA error: all"), message
    assert "nvidia-smi" in message


def test_the_default_gpu_is_probed_as_an_asked_for_one_is(two_gpus: None) -> None:
    """With neither --gpu nor --device, cuda:0 was taken unprobed: a full or reserved GPU
    failed only after the worker had registered, with vaguer advice."""
    with pytest.raises(DeviceError) as caught:
        resolve_device(None, None)
    message = str(caught.value)
    assert message.startswith("the default device (cuda:0; choose with --gpu or --device): CUDA"), (
        message
    )


def test_with_no_cuda_the_default_is_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device(None, None) == torch.device("cpu")


def test_a_gpu_number_past_the_visible_ones_names_cuda_visible_devices(two_gpus: None) -> None:
    with pytest.raises(DeviceError, match=r"2 CUDA device\(s\), numbered 0..1 \(CUDA_VISIBLE"):
        check_device("cuda:4", "--gpu 4")


@pytest.mark.parametrize(
    ("error", "device", "expected"),
    [
        (torch.OutOfMemoryError(OUT_OF_MEMORY), CUDA, "cuda:0 ran out of memory (CUDA out"),
        (RuntimeError("CUDA error: an illegal memory access"), CUDA, "cuda:0 failed: CUDA"),
        (
            RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 9E9"),
            torch.device("cpu"),
            "cpu ran out of memory (DefaultCPUAllocator",
        ),
        (
            RuntimeError("cuDNN error: CUDNN_STATUS_EXECUTION_FAILED"),
            CUDA,
            "cuda:0 failed: cuDNN error",
        ),
        (
            RuntimeError("CUBLAS_STATUS_NOT_INITIALIZED when calling `cublasCreate(handle)`"),
            CUDA,
            "cuda:0 failed: CUBLAS_STATUS",
        ),
        (
            RuntimeError("GET was unable to find an engine to execute this computation"),
            CUDA,
            "cuda:0 failed: GET was unable to find an engine to execute this computation (cuDNN "
            "says this when short of memory too",
        ),
        (
            RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"),
            CUDA,
            "cuda:0 ran out of memory (cuDNN error",
        ),
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied"), CUDA, None),
        (RuntimeError("CUDA error, but this worker is on the CPU"), torch.device("cpu"), None),
    ],
    ids=[
        "out of memory",
        "a CUDA error",
        "a cuDNN error",
        "a cuBLAS error",
        "cuDNN without an engine",
        "cuDNN short of memory",
        "the CPU out of memory",
        "a bug on the GPU",
        "a bug on the CPU",
    ],
)
def test_only_the_devices_own_failures_become_a_line_for_the_person(
    error: RuntimeError, device: torch.device, expected: str | None
) -> None:
    failure = device_failure(error, device)
    if expected is None:
        assert failure is None  # a bug keeps its traceback
    else:
        assert failure is not None and str(failure).startswith(expected), failure


def test_a_worker_whose_gpu_runs_out_of_memory_leaves_the_job(
    stand_in: StandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(*args: object) -> None:
        raise torch.OutOfMemoryError(OUT_OF_MEMORY)

    monkeypatch.setattr(Worker, "_forward", full)
    connection = Connection.open(stand_in.endpoint, timeout_s=30, retries=0)
    worker = Worker(connection, torch.device("cpu"), DataSource("embedded"), "t", "log")
    try:
        with pytest.raises(DeviceError, match=r"ran out of memory .* a smaller --batch-size"):
            worker.run()
    finally:
        connection.close()
    assert len(stand_in.leaves) == 1 and "ran out of memory" in stand_in.leaves[0]
    assert stand_in.pushes == 0


def test_the_server_evaluates_on_the_cpu_when_its_eval_gpu_fails(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A failure of --eval-device cuda (hours into a run, the GPU filled by workers) must not
    stop the server: that evaluation and the ones after it run on the CPU."""
    model = build_model("lenet")
    test_set = load_split(DataSource("embedded"), train=False, limit=64)
    expected = evaluation.evaluate(model, test_set, torch.device("cpu"))
    devices: list[torch.device] = []
    real_evaluate = evaluation.evaluate

    def evaluate(model: torch.nn.Module, test_set: ImageSet, device: torch.device) -> object:
        devices.append(device)
        if device.type == "cuda":
            raise torch.OutOfMemoryError(OUT_OF_MEMORY)
        return real_evaluate(model, test_set, device)

    monkeypatch.setattr(evaluation, "evaluate", evaluate)
    result, device = evaluation.evaluate_on(model, test_set, CUDA)
    assert (result, device, devices) == (expected, torch.device("cpu"), [CUDA, device])
    assert "cuda:0 ran out of memory" in caplog.text and "on the CPU from now on" in caplog.text


def test_a_bug_in_evaluation_is_not_hidden_by_the_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    def evaluate(model: torch.nn.Module, test_set: ImageSet, device: torch.device) -> object:
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    monkeypatch.setattr(evaluation, "evaluate", evaluate)
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        evaluation.evaluate_on(
            build_model("lenet"), load_split(DataSource("embedded"), False, 8), CUDA
        )


def test_a_failed_evaluation_leaves_the_model_in_training_mode() -> None:
    model = build_model("lenet")

    def full(images: torch.Tensor) -> torch.Tensor:
        raise torch.OutOfMemoryError(OUT_OF_MEMORY)

    model.forward = full  # type: ignore[method-assign]
    with pytest.raises(torch.OutOfMemoryError):
        evaluation.evaluate(
            model, load_split(DataSource("embedded"), False, 8), torch.device("cpu")
        )
    assert model.training


def test_ps_local_says_why_the_gpus_idle_when_there_are_too_few(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(devices, "gpu_count", lambda: 2)
    assert devices.worker_devices(3, "auto") == ["cpu"] * 3
    assert "2 GPUs for 3 workers: every worker runs on the CPU" in capsys.readouterr().err
    assert devices.worker_devices(2, "auto") == ["cuda:0", "cuda:1"]
    assert capsys.readouterr().err == ""
