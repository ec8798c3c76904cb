"""Test-set evaluation of the server's weights. The server computes it, on `--eval-device`."""

import dataclasses
import logging

import torch
from torch import nn

from common.data import ImageSet
from common.device import device_failure

log = logging.getLogger("ps.server")

EVAL_BATCH = 500


@dataclasses.dataclass(frozen=True)
class Evaluation:
    accuracy: float
    loss: float
    samples: int


def evaluate_on(
    model: nn.Module, test_set: ImageSet, device: torch.device
) -> tuple[Evaluation, torch.device]:
    """`evaluate` on `device`, or on the CPU when that device fails (a GPU the workers have
    filled, say): the evaluation, and the device to use from now on. A server must not lose
    its run, and its final checkpoint, to the device it only evaluates on."""
    try:
        return evaluate(model, test_set, device), device
    except RuntimeError as exc:
        failure = device_failure(exc, device)
        if failure is None or device.type == "cpu":
            raise
        log.warning("%s; the server evaluates on the CPU from now on", failure)
        cpu = torch.device("cpu")
        return evaluate(model, test_set, cpu), cpu


@torch.inference_mode()
def evaluate(model: nn.Module, test_set: ImageSet, device: torch.device) -> Evaluation:
    """Accuracy and mean cross-entropy over the whole test set, with BatchNorm in eval mode."""
    was_training = model.training
    model.eval()
    try:
        eval_model = model if device.type == "cpu" else _copy_to(model, device)
        loss_sum, correct = 0.0, 0
        for start in range(0, len(test_set), EVAL_BATCH):
            images = test_set.images[start : start + EVAL_BATCH].to(device)  # (B, 1, 28, 28)
            labels = test_set.labels[start : start + EVAL_BATCH].to(device)  # (B,)
            logits = eval_model(images)  # (B, 10)
            loss_sum += nn.functional.cross_entropy(logits, labels, reduction="sum").item()
            correct += int((logits.argmax(dim=1) == labels).sum().item())
    finally:
        model.train(was_training)
    n = len(test_set)
    return Evaluation(accuracy=correct / n, loss=loss_sum / n, samples=n)


def _copy_to(model: nn.Module, device: torch.device) -> nn.Module:
    import copy

    return copy.deepcopy(model).to(device)
