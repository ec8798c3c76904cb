"""Checkpoint files on their own (psserver.checkpoints.files): what a write leaves behind when it
fails, and what loading refuses that unpickling alone would let through."""

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from common.errors import CheckpointError, first_line
from psserver.checkpoints import files as checkpoint
from psserver.checkpoints import write_failure as checkpoint_failure
from psserver.checkpoints.files import LATEST, PREVIOUS, newest_checkpoint, read_checkpoint

MARKER = 1.2345  # a value whose bytes are easy to find in the file


def a_state(step: int) -> dict[str, Any]:
    weight = torch.full((256,), MARKER)
    return {
        "model": {"layer.weight": weight, "layer.bias": torch.zeros(4)},
        "optimizer": {"state": {0: {"momentum_buffer": torch.ones(260)}}, "param_groups": []},
        "step": step,
        "position": {"epoch": 0, "batch": step},
        "rng": torch.get_rng_state(),
        "config": {"model": "lenet", "lr": 0.1},
    }


def no_hard_links(*_: object) -> None:
    raise OSError("hard links are not supported here")


def test_a_write_then_a_second_keeps_both_and_no_temporary(tmp_path: Path) -> None:
    checkpoint.save_checkpoint(tmp_path, a_state(1))
    checkpoint.save_checkpoint(tmp_path, a_state(2))
    assert read_checkpoint(tmp_path / LATEST)["step"] == 2
    assert read_checkpoint(tmp_path / PREVIOUS)["step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST, PREVIOUS]


def test_without_hard_links_the_rotation_renames(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "link", no_hard_links)
    checkpoint.save_checkpoint(tmp_path, a_state(1))
    checkpoint.save_checkpoint(tmp_path, a_state(2))
    assert read_checkpoint(tmp_path / PREVIOUS)["step"] == 1
    assert read_checkpoint(tmp_path / LATEST)["step"] == 2


def test_a_full_disk_is_one_error_and_leaves_no_half_written_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch.save raises RuntimeError, not OSError, when the disk fills under it: it used to
    end the server with a traceback and leave the half-written file to keep the disk full."""
    checkpoint.save_checkpoint(tmp_path, a_state(1))
    good = (tmp_path / LATEST).read_bytes()

    def disk_full(_: object, f: Any) -> None:
        f.write(b"PK\x03\x04 half")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 3712")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(CheckpointError, match=r"could not write checkpoint .*unexpected pos"):
        checkpoint.save_checkpoint(tmp_path, a_state(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST]
    assert (tmp_path / LATEST).read_bytes() == good


@pytest.mark.parametrize(
    "failure", [RuntimeError("unexpected pos 104256 vs 104152"), OSError(28, "No space left")]
)
def test_a_full_disk_is_said_in_words_with_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failure: Exception
) -> None:
    """torch.save's error on a full disk is its zip writer's `[enforce fail at
    inline_container.cc:672] . unexpected pos 104256 vs 104152`, which was all the person saw."""
    checkpoint.save_checkpoint(tmp_path, a_state(1))

    def disk_full(_: object, f: Any) -> None:
        raise failure

    monkeypatch.setattr(torch, "save", disk_full)
    free = 1000 if isinstance(failure, RuntimeError) else 10**9  # ENOSPC needs no look
    usage = checkpoint_failure.shutil.disk_usage(tmp_path)._replace(free=free)
    monkeypatch.setattr(checkpoint_failure.shutil, "disk_usage", lambda _: usage)
    with pytest.raises(CheckpointError) as info:
        checkpoint.save_checkpoint(tmp_path, a_state(2))
    message = str(info.value)
    assert message.startswith(f"could not write checkpoint {tmp_path / LATEST}: the disk is full (")
    assert "a checkpoint takes about 0.0 MB" in message and "unexpected pos" not in message
    assert f"the checkpoints already in {tmp_path} are kept: free space on it" in message
    assert f"--resume-from {tmp_path / LATEST}" in message
    assert read_checkpoint(tmp_path / LATEST)["step"] == 1


@pytest.mark.parametrize("stop", [KeyboardInterrupt, lambda: SystemExit(143)])
def test_ctrl_c_or_sigterm_mid_write_leaves_no_half_written_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stop: Any
) -> None:
    """Ctrl-C or SIGTERM (ps-server raises SystemExit on it) while torch.save writes: the
    half-written temporary stayed in the folder (45 MB for ResNet-18) until the next write,
    which a run that is not resumed never makes."""
    checkpoint.save_checkpoint(tmp_path, a_state(1))

    def interrupted(_: object, f: Any) -> None:
        f.write(b"PK\x03\x04 half")
        raise stop()

    monkeypatch.setattr(torch, "save", interrupted)
    with pytest.raises((KeyboardInterrupt, SystemExit)):
        checkpoint.save_checkpoint(tmp_path, a_state(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST]
    assert read_checkpoint(tmp_path / LATEST)["step"] == 1


def test_a_folder_that_went_away_is_one_error(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    folder.write_text("a file where the folder was")
    with pytest.raises(CheckpointError, match="could not write checkpoint"):
        checkpoint.save_checkpoint(folder, a_state(1))


def test_stale_temporaries_of_a_dead_writer_are_removed(tmp_path: Path) -> None:
    stale = tmp_path / f".{LATEST}.tmp-999999999"
    stale.write_bytes(b"half a checkpoint from a process killed mid-write")
    checkpoint.save_checkpoint(tmp_path, a_state(1))
    assert not stale.exists()


def test_flipped_bytes_fail_the_checksum_and_loading_falls_back(tmp_path: Path) -> None:
    """torch's zip reader does not check its CRCs: a damaged weight loaded silently."""
    checkpoint.save_checkpoint(tmp_path, a_state(1))
    checkpoint.save_checkpoint(tmp_path, a_state(2))
    latest = tmp_path / LATEST
    data = bytearray(latest.read_bytes())
    at = bytes(data).index(torch.tensor([MARKER]).numpy().tobytes())
    data[at] ^= 0xFF
    latest.write_bytes(bytes(data))
    assert torch.load(latest, weights_only=True)["step"] == 2  # torch alone sees nothing
    with pytest.raises(CheckpointError, match="do not match its checksum"):
        read_checkpoint(latest)
    path, state = newest_checkpoint(tmp_path)
    assert (path.name, state["step"]) == (PREVIOUS, 1)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda s: s["model"]["layer.weight"].__setitem__(3, float("nan")), "not finite"),
        (
            lambda s: s["optimizer"]["state"][0]["momentum_buffer"].fill_(float("inf")),
            "not finite",
        ),
        (lambda s: s.__setitem__("config", None), "config is not a dict"),
        (lambda s: s.__setitem__("position", [0, 1]), "position is not a dict"),
        (lambda s: s.__setitem__("step", -1), "step -1"),
    ],
)
def test_edited_checkpoints_are_refused_as_corrupt(tmp_path: Path, edit: Any, message: str) -> None:
    """Files of the right form whose contents cannot be trained on: written without a
    checksum (as a release before it did, or a person editing one), so only the content
    checks can catch them. NaN weights used to resume, then fail the first push."""
    state = {"format": checkpoint.FORMAT, **a_state(1)}
    edit(state)
    torch.save(state, tmp_path / LATEST)
    with pytest.raises(CheckpointError, match=message):
        read_checkpoint(tmp_path / LATEST)


def test_a_checkpoint_from_before_the_checksum_still_loads(tmp_path: Path) -> None:
    torch.save({"format": checkpoint.FORMAT, **a_state(5)}, tmp_path / LATEST)
    assert read_checkpoint(tmp_path / LATEST)["step"] == 5


def test_a_cut_off_file_is_refused_in_one_sentence(tmp_path: Path) -> None:
    """torch's error for it names its zip reader and goes on, in one line, to call itself
    internal; it used to be cut in the middle of a word ("there is a high")."""
    path = checkpoint.save_checkpoint(tmp_path, a_state(1))
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(CheckpointError) as caught:
        read_checkpoint(path)
    message = str(caught.value)
    assert message == (
        f"checkpoint {path} is corrupt or not a checkpoint (cut short or damaged: its zip "
        "archive cannot be read)"
    )  # not torch's "PytorchStreamReader failed ... This is an internal miniz error."


def test_a_long_error_line_is_cut_at_a_sentence_or_marked_as_cut() -> None:
    sentences = RuntimeError("It failed. " + "More words follow here. " * 10 + "\nadvice")
    assert (
        first_line(sentences, limit=60)
        == "It failed. More words follow here. More words follow here."
    )
    one_long_word = RuntimeError("x" * 200)
    assert first_line(one_long_word, limit=60) == "x" * 57 + "..."
    assert first_line(RuntimeError("short\nsecond line")) == "short"
    assert first_line(RuntimeError("")) == "RuntimeError"


def test_a_permission_error_is_not_called_a_full_disk_and_a_first_checkpoint_names_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An OSError says what it is: a read-only or failing disk with less free space than a
    checkpoint was called full. And the run's first checkpoint has no latest.pt to go on from:
    the advice named one."""
    from psserver.checkpoints.write_failure import why_not_written

    usage = checkpoint_failure.shutil.disk_usage(tmp_path)._replace(free=10)
    monkeypatch.setattr(checkpoint_failure.shutil, "disk_usage", lambda _: usage)
    refused = PermissionError(13, "Permission denied")
    said = why_not_written(tmp_path, 1000, refused, tmp_path / LATEST)
    assert said == (
        "[Errno 13] Permission denied; no checkpoint was written there yet: make "
        f"{tmp_path} writable, then start the run again"
    )
    (tmp_path / LATEST).write_bytes(b"a checkpoint")
    said = why_not_written(tmp_path, 1000, RuntimeError("unexpected pos 1"), tmp_path / LATEST)
    assert said.startswith("the disk is full (0.0 MB free, a checkpoint takes about 0.0 MB); ")
    assert said.endswith(f"--resume-from {tmp_path / LATEST}")
