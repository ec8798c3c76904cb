"""Checkpoint files on their own (psserver.checkpoint): what a write leaves behind when it
fails, and what loading refuses that unpickling alone would let through."""

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from common.errors import CheckpointError, first_line
from psserver import checkpoint
from psserver.checkpoint import LATEST, PREVIOUS, newest_checkpoint, read_checkpoint

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
    """torch's error for it goes on, in one line, to call itself internal; it used to be cut
    in the middle of a word ("there is a high")."""
    path = checkpoint.save_checkpoint(tmp_path, a_state(1))
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(CheckpointError) as caught:
        read_checkpoint(path)
    message = str(caught.value)
    assert message.startswith(f"checkpoint {path} is corrupt or not a checkpoint ("), message
    assert message.endswith(".)") and "If you are seeing" not in message, message


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


def test_kept_checkpoints_are_the_last_k_written_each_the_bytes_of_its_latest(
    tmp_path: Path,
) -> None:
    for step in range(1, 6):
        checkpoint.save_checkpoint(tmp_path, a_state(step), keep=3)
    kept = checkpoint.kept_checkpoints(tmp_path)
    assert [(step, path.name) for step, path in kept] == [
        (3, "step-00000003.pt"), (4, "step-00000004.pt"), (5, "step-00000005.pt"),
    ]  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [LATEST, PREVIOUS, *(path.name for _, path in kept)]
    )
    assert (tmp_path / LATEST).samefile(tmp_path / "step-00000005.pt")  # a link, no more disk
    assert (tmp_path / PREVIOUS).samefile(tmp_path / "step-00000004.pt")
    assert [read_checkpoint(path)["step"] for _, path in kept] == [3, 4, 5]


def test_without_hard_links_kept_checkpoints_are_copies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "link", no_hard_links)
    for step in (1, 2, 3):
        checkpoint.save_checkpoint(tmp_path, a_state(step), keep=2)
    assert [step for step, _ in checkpoint.kept_checkpoints(tmp_path)] == [2, 3]
    assert read_checkpoint(tmp_path / "step-00000003.pt")["step"] == 3
    assert not (tmp_path / LATEST).samefile(tmp_path / "step-00000003.pt")
    assert not list(tmp_path.glob(".*tmp*"))


def test_after_going_back_to_an_earlier_step_the_abandoned_files_go_first(
    tmp_path: Path,
) -> None:
    """A run resumed from step 1 of a run that reached step 4 writes step 2 again: that file
    replaces the old step 2 and stays; the old run's steps 3 and 4, written before it, are
    removed first, though their steps are higher."""
    for step in range(1, 5):
        checkpoint.save_checkpoint(tmp_path, a_state(step), keep=2)
    for age, name in enumerate(("step-00000003.pt", "step-00000004.pt")):
        os.utime(tmp_path / name, ns=(10**18 + age, 10**18 + age))  # written long ago, in order
    again = a_state(2)
    again["config"]["lr"] = 0.01  # the resumed run's
    checkpoint.save_checkpoint(tmp_path, again, keep=2)
    assert [path.name for _, path in checkpoint.kept_checkpoints(tmp_path)] == [
        "step-00000004.pt", "step-00000002.pt",
    ]  # fmt: skip
    assert read_checkpoint(tmp_path / "step-00000002.pt")["config"]["lr"] == 0.01
    checkpoint.save_checkpoint(tmp_path, a_state(3), keep=2)
    assert [step for step, _ in checkpoint.kept_checkpoints(tmp_path)] == [2, 3]


def test_the_server_config_checks_resume_from_and_keep_checkpoints(tmp_path: Path) -> None:
    from common.errors import ConfigError
    from psserver.config import ServerConfig

    checkpoint.save_checkpoint(tmp_path / "ck", a_state(1), keep=1)
    kept = tmp_path / "ck" / "step-00000001.pt"
    with pytest.raises(ConfigError, match=r"give --resume .* or --resume-from FILE .*not both"):
        ServerConfig(checkpoint_dir=tmp_path / "ck", resume=True, resume_from=kept)
    with pytest.raises(ConfigError, match=r"--resume-from .*nowhere\.pt: no such file"):
        ServerConfig(resume_from=tmp_path / "nowhere.pt")
    with pytest.raises(ConfigError, match="--keep-checkpoints 3 needs --checkpoint-dir"):
        ServerConfig(keep_checkpoints=3)
    # Going on from a file is a resume: the folder's checkpoints are not "an earlier run's".
    config = ServerConfig(checkpoint_dir=tmp_path / "ck", resume_from=kept, keep_checkpoints=2)
    assert config.resuming
    with pytest.raises(ConfigError, match=r"already holds latest\.pt of an earlier run"):
        ServerConfig(checkpoint_dir=tmp_path / "ck")


def test_divergence_advice_names_every_checkpoint_left_and_how_to_go_on_from_it(
    tmp_path: Path,
) -> None:
    from psserver.config import ServerConfig
    from psserver.keeper import divergence_advice

    folder = tmp_path / "ck"
    for step in (4, 8):
        checkpoint.save_checkpoint(folder, a_state(step), keep=2)
    held = {PREVIOUS: 4, LATEST: 8}
    kept = ServerConfig(lr=3.0, checkpoint_dir=folder, keep_checkpoints=2, resume=True)
    advice = divergence_advice(kept, held)
    cause = "The usual cause is a learning rate too high for the batch (this job: --lr 3, "
    assert advice.startswith(f"{cause}--momentum 0, batch 128 per worker)"), advice
    assert advice.endswith(
        f"{folder} holds previous.pt (step 4) and step-00000004.pt (step 4) and latest.pt "
        f"(step 8) and step-00000008.pt (step 8); --resume goes on from latest.pt, "
        f"--resume-from {folder}/FILE from any one of them"
    ), advice
    not_kept = ServerConfig(checkpoint_dir=tmp_path / "other", resume=True)
    (tmp_path / "other").mkdir()
    advice = divergence_advice(not_kept, {LATEST: 8})
    assert advice.endswith(
        f"holds latest.pt (step 8); --resume goes on from latest.pt, --resume-from "
        f"{tmp_path / 'other'}/FILE from any one of them (--keep-checkpoints K keeps K more, "
        "next time)"
    ), advice
    assert divergence_advice(ServerConfig(), {}).endswith("(the log's train loss says when)")


def test_with_latest_and_previous_both_bad_the_error_points_at_the_kept_ones(
    tmp_path: Path,
) -> None:
    for step in (2, 4, 6):
        checkpoint.save_checkpoint(tmp_path, a_state(step), keep=3)
    for name in (LATEST, PREVIOUS):  # new files, so the kept links keep their good bytes
        (tmp_path / name).unlink()
        (tmp_path / name).write_bytes(b"PK\x03\x04 damaged")
    with pytest.raises(CheckpointError) as caught:
        newest_checkpoint(tmp_path)
    assert str(caught.value).endswith(
        f"go on from an older one with --resume-from {tmp_path}/step-N.pt (it keeps steps 2, 4, "
        "6), or delete the folder to start over"
    ), caught.value


@pytest.mark.parametrize("links", [True, False], ids=["hard links", "no hard links"])
def test_the_first_write_after_going_back_makes_the_file_gone_back_to_previous(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, links: bool
) -> None:
    """Resumed from step 1 (here a copy in another folder) of a run that reached step 3: the
    new step 2 is latest.pt and step 1 previous.pt, not the abandoned step 3."""
    elsewhere = tmp_path / "elsewhere"
    checkpoint.save_checkpoint(elsewhere, a_state(1))
    folder = tmp_path / "ck"
    for step in (1, 2, 3):
        checkpoint.save_checkpoint(folder, a_state(step))
    if not links:
        monkeypatch.setattr(os, "link", no_hard_links)
    checkpoint.save_checkpoint(folder, a_state(2), previous_from=elsewhere / LATEST)
    assert read_checkpoint(folder / LATEST)["step"] == 2
    assert read_checkpoint(folder / PREVIOUS)["step"] == 1
    assert (folder / PREVIOUS).samefile(elsewhere / LATEST) == links
    assert sorted(p.name for p in folder.iterdir()) == [LATEST, PREVIOUS]
    # The file gone back to was removed meanwhile: the write rotates as usual.
    (elsewhere / LATEST).unlink()
    checkpoint.save_checkpoint(folder, a_state(3), previous_from=elsewhere / LATEST)
    assert read_checkpoint(folder / PREVIOUS)["step"] == 2
