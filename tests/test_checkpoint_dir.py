"""A checkpoint folder over several runs (psserver.checkpoints.kept_steps,
psserver.checkpoints.directory and the folder side of psserver.checkpoints.files): kept step-N.pt
files, going back to one, falling back on them when latest.pt and previous.pt are damaged, and the
advice a diverged run gives."""

import os
from pathlib import Path

import pytest

from common.errors import CheckpointError, ConfigError, PSError
from psserver.checkpoints.directory import divergence_advice, step_of_another_line
from psserver.checkpoints.files import LATEST, PREVIOUS, newest_checkpoint, read_checkpoint
from psserver.checkpoints.files import save_checkpoint as save
from psserver.checkpoints.kept_steps import kept_checkpoints
from psserver.config import ServerConfig
from tests.test_checkpoint import a_state, no_hard_links


def steps(folder: Path) -> list[int]:
    return [step for step, _ in kept_checkpoints(folder)]


def test_kept_checkpoints_are_the_last_k_written_each_the_bytes_of_its_latest(
    tmp_path: Path,
) -> None:
    for step in range(1, 6):
        save(tmp_path, a_state(step), keep=3)
    kept = kept_checkpoints(tmp_path)
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
        save(tmp_path, a_state(step), keep=2)
    assert steps(tmp_path) == [2, 3]
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
        save(tmp_path, a_state(step), keep=2)
    for age, name in enumerate(("step-00000003.pt", "step-00000004.pt")):
        os.utime(tmp_path / name, ns=(10**18 + age, 10**18 + age))  # written long ago, in order
    again = a_state(2)
    again["config"]["lr"] = 0.01  # the resumed run's
    save(tmp_path, again, keep=2)
    assert [path.name for _, path in kept_checkpoints(tmp_path)] == [
        "step-00000004.pt", "step-00000002.pt",
    ]  # fmt: skip
    assert read_checkpoint(tmp_path / "step-00000002.pt")["config"]["lr"] == 0.01
    save(tmp_path, a_state(3), keep=2)
    assert steps(tmp_path) == [2, 3]


@pytest.mark.parametrize("links", [True, False], ids=["hard links", "no hard links"])
def test_the_first_write_after_going_back_makes_the_file_gone_back_to_previous(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, links: bool
) -> None:
    """Resumed from step 1 (here a copy in another folder) of a run that reached step 3: the
    new step 2 is latest.pt and step 1 previous.pt, not the abandoned step 3."""
    elsewhere = tmp_path / "elsewhere"
    save(elsewhere, a_state(1))
    folder = tmp_path / "ck"
    for step in (1, 2, 3):
        save(folder, a_state(step))
    if not links:
        monkeypatch.setattr(os, "link", no_hard_links)
    save(folder, a_state(2), previous_from=elsewhere / LATEST)
    assert read_checkpoint(folder / LATEST)["step"] == 2
    assert read_checkpoint(folder / PREVIOUS)["step"] == 1
    assert (folder / PREVIOUS).samefile(elsewhere / LATEST) == links
    assert sorted(p.name for p in folder.iterdir()) == [LATEST, PREVIOUS]
    # The file gone back to was removed meanwhile: the write rotates as usual.
    (elsewhere / LATEST).unlink()
    save(folder, a_state(3), previous_from=elsewhere / LATEST)
    assert read_checkpoint(folder / PREVIOUS)["step"] == 2


@pytest.mark.parametrize("name", [PREVIOUS, "step-00000004.pt"])
def test_going_back_to_what_previous_pt_already_is_leaves_no_temporary(
    tmp_path: Path, name: str
) -> None:
    """rename(2) of one name of a file onto another does nothing, so the temporary link used
    to stay behind as .previous.pt.tmp-PID."""
    for step in (2, 4, 6):
        save(tmp_path, a_state(step), keep=3)
    save(tmp_path, a_state(5), keep=3, previous_from=tmp_path / name)
    assert not list(tmp_path.glob(".*")), list(tmp_path.glob(".*"))
    assert read_checkpoint(tmp_path / PREVIOUS)["step"] == 4


def test_resume_falls_back_on_the_kept_files_not_those_that_are_the_damaged_ones(
    tmp_path: Path,
) -> None:
    """Damage inside latest.pt and previous.pt (the same files as the kept steps 6 and 4)
    leaves step 2; damage by replacing them leaves the kept links whole."""
    for step in (2, 4, 6):
        save(tmp_path, a_state(step), keep=3)
    for name in (LATEST, PREVIOUS):
        os.truncate(tmp_path / name, 500)
    path, state = newest_checkpoint(tmp_path)
    assert (path.name, state["step"]) == ("step-00000002.pt", 2)
    for name in (LATEST, PREVIOUS):
        (tmp_path / name).unlink()
    assert newest_checkpoint(tmp_path)[0].name == "step-00000002.pt"
    os.truncate(tmp_path / "step-00000002.pt", 500)
    with pytest.raises(CheckpointError) as caught:
        newest_checkpoint(tmp_path)
    message = str(caught.value)
    assert message.startswith(f"no loadable checkpoint in {tmp_path}: latest.pt is missing; "
                              "previous.pt is missing; checkpoint "), message  # fmt: skip
    assert message.endswith(
        "to start over, move the folder aside (the damaged files may still be worth a look) "
        "or give another --checkpoint-dir"
    ), message


def test_resume_goes_on_from_a_folder_of_kept_files_only(tmp_path: Path) -> None:
    for step in (2, 4):
        save(tmp_path, a_state(step), keep=2)
    (tmp_path / LATEST).unlink()
    (tmp_path / PREVIOUS).unlink()
    path, state = newest_checkpoint(tmp_path)
    assert (path.name, state["step"]) == ("step-00000004.pt", 4)


def test_a_file_torch_did_not_write_is_named_so(tmp_path: Path) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("epoch 3: loss 0.4\n")
    with pytest.raises(CheckpointError, match=r"not a file that torch\.save wrote\)$"):
        read_checkpoint(text)


def test_the_server_config_checks_resume_from_and_keep_checkpoints(tmp_path: Path) -> None:
    save(tmp_path / "ck", a_state(1), keep=1)
    kept = tmp_path / "ck" / "step-00000001.pt"
    with pytest.raises(ConfigError, match=r"give --resume .* or --resume-from FILE .*not both"):
        ServerConfig(checkpoint_dir=tmp_path / "ck", resume=True, resume_from=kept)
    with pytest.raises(ConfigError, match="not both"):  # before "--resume needs ..."
        ServerConfig(resume=True, resume_from=kept)
    with pytest.raises(ConfigError, match=r"--resume-from .*nowhere\.pt: no such file"):
        ServerConfig(resume_from=tmp_path / "nowhere.pt")
    with pytest.raises(ConfigError, match="--keep-checkpoints 3 needs --checkpoint-dir"):
        ServerConfig(keep_checkpoints=3)
    # Going on from a file is a resume: the folder's checkpoints are not "an earlier run's".
    config = ServerConfig(checkpoint_dir=tmp_path / "ck", resume_from=kept, keep_checkpoints=2)
    assert config.resuming
    with pytest.raises(ConfigError, match=r"already holds latest\.pt and 1 kept step-N\.pt of an"):
        ServerConfig(checkpoint_dir=tmp_path / "ck")
    # Kept files alone are an earlier run's too.
    (tmp_path / "ck" / LATEST).unlink()
    with pytest.raises(ConfigError, match=r"already holds 1 kept step-N\.pt of an earlier run"):
        ServerConfig(checkpoint_dir=tmp_path / "ck")


def test_going_back_into_a_folder_of_another_job_is_refused(tmp_path: Path) -> None:
    folder, elsewhere = tmp_path / "ck", tmp_path / "elsewhere"
    job = ServerConfig(model="lenet").to_dict()
    save(elsewhere, {**a_state(4), "config": job})
    save(folder, {**a_state(7), "config": {**job, "lr": 0.5}})  # lr may change: the same job
    config = ServerConfig(model="lenet", checkpoint_dir=folder, resume_from=elsewhere / LATEST)
    assert step_of_another_line(folder, elsewhere / LATEST, config) == 7
    assert step_of_another_line(folder, folder / LATEST, config) is None  # the same file
    resnet = ServerConfig(model="resnet18", checkpoint_dir=folder, resume_from=elsewhere / LATEST)
    with pytest.raises(PSError, match=r"holds the checkpoints of another job \(its "
                       r"model='lenet', this job's model='resnet18'\)"):  # fmt: skip
        step_of_another_line(folder, elsewhere / LATEST, resnet)
    os.truncate(folder / LATEST, 100)  # unreadable: nothing to compare, nothing refused
    assert step_of_another_line(folder, elsewhere / LATEST, resnet) is None


def test_divergence_advice_offers_the_checkpoints_from_before_the_weights_diverged(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "ck"
    for step in (2, 4, 6):
        save(folder, a_state(step), keep=3)
    kept = ServerConfig(lr=70.0, checkpoint_dir=folder, keep_checkpoints=3, resume=True)
    advice = divergence_advice(kept, {PREVIOUS: 4, LATEST: 6}, diverged_at=6)
    assert advice == (
        "The usual cause is a learning rate too high for the batch (this job: --lr 70, "
        "--momentum 0, batch 128 per worker); start again with a lower --lr, or go on with a "
        "lower --lr from a checkpoint from before the train loss grew: "
        f"{folder} holds step-00000002.pt (step 2) and previous.pt (step 4) and "
        "step-00000004.pt (step 4); latest.pt and step-00000006.pt: step 6 or later, after "
        f"the weights diverged; go on from one with --resume-from {folder}/FILE"
    )
    # After a --resume, this run knows latest.pt's step only: previous.pt is read for its.
    plain = ServerConfig(checkpoint_dir=tmp_path / "plain", resume=True)
    for step in (2, 4, 6):
        save(tmp_path / "plain", a_state(step))
    advice = divergence_advice(plain, {LATEST: 6}, diverged_at=6)
    assert advice.endswith(
        "holds previous.pt (step 4); latest.pt: step 6 or later, after the weights diverged; "
        f"go on from one with --resume-from {tmp_path / 'plain'}/FILE (--keep-checkpoints K "
        "keeps K more, next time)"
    ), advice
    # Nothing from before: only a fresh start helps.
    advice = divergence_advice(plain, {LATEST: 6}, diverged_at=2)
    assert advice.endswith(
        "start again with a lower --lr; latest.pt and previous.pt: step 2 or later, after the "
        "weights diverged"
    ), advice
    assert divergence_advice(ServerConfig(), {}, 5).endswith("start again with a lower --lr")
