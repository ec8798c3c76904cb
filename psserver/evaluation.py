"""Test-set evaluation of the server's weights. The server computes it, on `--eval-device`."""

import dataclasses

import torch
from torch import nn

from common.data import ImageSet

EVAL_BATCH = 500


@dataclasses.dataclass(frozen=True)
class Evaluation:
    accuracy: float
    loss: float
    samples: int


@torch.inference_mode()
def evaluate(model: nn.Module, test_set: ImageSet, device: torch.device) -> Evaluation:
    """Accuracy and mean cross-entropy over the whole test set, with BatchNorm in eval mode."""
    was_training = model.training
    model.eval()
    eval_model = model if device.type == "cpu" else _copy_to(model, device)
    loss_sum, correct = 0.0, 0
    for start in range(0, len(test_set), EVAL_BATCH):
        images = test_set.images[start : start + EVAL_BATCH].to(device)  # (B, 1, 28, 28)
        labels = test_set.labels[start : start + EVAL_BATCH].to(device)  # (B,)
        logits = eval_model(images)  # (B, 10)
        loss_sum += nn.functional.cross_entropy(logits, labels, reduction="sum").item()
        correct += int((logits.argmax(dim=1) == labels).sum().item())
    model.train(was_training)
    n = len(test_set)
    return Evaluation(accuracy=correct / n, loss=loss_sum / n, samples=n)


def _copy_to(model: nn.Module, device: torch.device) -> nn.Module:
    import copy

    return copy.deepcopy(model).to(device)
