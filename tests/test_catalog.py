"""The model and data seam (common.catalog): what a job trains, by name, and the guard that
both roles ask it and nothing else."""

import ast
from pathlib import Path

import pytest
import torch

from common import catalog
from common.data import DataSource

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", catalog.MODEL_NAMES)
def test_a_model_takes_its_input_shape_and_is_the_one_its_fingerprint_names(name: str) -> None:
    model = catalog.build_model(name, seed=3)
    model.eval()
    with torch.no_grad():
        out = model(torch.zeros(2, *catalog.input_shape(name)))  # (2, C, H, W)
    assert out.shape == (2, 10)
    assert catalog.fingerprint(model) == catalog.all_fingerprints()[name]
    again = catalog.build_model(name, seed=3).state_dict()
    assert all(torch.equal(v, again[k]) for k, v in model.state_dict().items())


def test_the_catalog_names_the_built_in_models_and_data_sets() -> None:
    assert catalog.MODEL_NAMES == ("lenet", "resnet18")
    assert catalog.DATASET_NAMES == ("embedded", "fashion-mnist")
    assert set(catalog.all_fingerprints()) == set(catalog.MODEL_NAMES)
    assert catalog.largest_state_numel() == 11_175_818  # ResNet-18's parameters
    for ask in (catalog.build_model, catalog.input_shape):
        with pytest.raises(ValueError, match="unknown model 'gpt5'; choose one of"):
            ask("gpt5")


def test_the_training_and_test_sets_come_cut_to_their_limits() -> None:
    train = catalog.load_training_set(DataSource("embedded"), limit=100)
    test = catalog.load_test_set(DataSource("embedded"))
    assert (len(train), len(test)) == (100, 1000)
    assert tuple(train.images.shape[1:]) == catalog.IMAGE_SHAPE
    assert not torch.equal(train.images[:10], test.images[:10])


def imports_of(path: Path) -> set[str]:
    """Every `module` and `module.name` a file imports."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_both_roles_choose_what_they_train_through_the_catalog_only() -> None:
    """A second way to a model or a data set (an entry point wired into one role only) would
    let the server and its workers train different things."""
    behind = {"common.model.builtin", "common.data.load_split", "common.data.DATASETS"}
    allowed = {ROOT / "common" / "catalog.py"}
    offenders = [
        f"{path.relative_to(ROOT)}: {sorted(found)}"
        for package in ("common", "psserver", "psworker")
        for path in sorted((ROOT / package).rglob("*.py"))
        if path not in allowed and (found := imports_of(path) & behind)
    ]
    assert not offenders, "import these from common.catalog instead: " + "; ".join(offenders)
