"""Kept checkpoints: with `--keep-checkpoints K`, every checkpoint is also `DIR/step-N.pt`, a
hard link to the `latest.pt` it was written as (a copy where there are none), and the K most
recently written stay. `psserver.checkpoints.files` writes them; `--resume` falls back on them."""

import contextlib
import os
import re
import shutil
from pathlib import Path

KEPT_NAME = re.compile(r"step-(\d+)\.pt")


def kept_name(step: int) -> str:
    """The file a kept checkpoint of this step goes to; the digits sort as the steps do."""
    return f"step-{step:08d}.pt"


def same_file(path: Path, other: Path) -> bool:
    """Whether both names are one file (hard links); False when either is missing."""
    try:
        return path.samefile(other)
    except OSError:
        return False


def link_or_copy(source: Path, kept: Path) -> None:
    """`kept` becomes `source`'s contents, replacing what was there: a hard link, or a copy
    where there are none (or `source` is on another file system)."""
    if same_file(kept, source):
        return  # and rename(2) of one link onto another of the same file would do nothing
    temporary = kept.with_name(f".{kept.name}.tmp-{os.getpid()}")
    temporary.unlink(missing_ok=True)
    try:
        os.link(source, temporary)
    except OSError:
        shutil.copyfile(source, temporary)
        with open(temporary, "rb") as f:
            os.fsync(f.fileno())
    os.replace(temporary, kept)


def kept_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """The kept checkpoints in a folder, (step, path), oldest written first."""
    found = []
    for path in directory.glob("step-*.pt"):
        match = KEPT_NAME.fullmatch(path.name)
        with contextlib.suppress(OSError):  # removed meanwhile
            if match is not None and path.is_file():
                found.append((path.stat().st_mtime_ns, int(match.group(1)), path))
    return [(step, path) for _, step, path in sorted(found)]


def remove_past(directory: Path, keep: int, written: Path) -> None:
    """Remove all but the `keep` most recently written kept checkpoints, `written` (this
    write's) always among them: by when they were written, not by step, so that after a
    --resume-from an earlier step the new run's files stay and the abandoned run's go first."""
    older = [path for _, path in kept_checkpoints(directory) if path != written]
    for path in older[: max(0, len(older) - (keep - 1))]:
        path.unlink(missing_ok=True)
