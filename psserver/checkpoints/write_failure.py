"""What a checkpoint that could not be written means to the person: a full disk, said in
megabytes (torch.save's own error for one is its zip writer's internal "unexpected pos 104256
vs 104152"), or a folder that cannot be written; and what to do next.

What this is not: the writing itself, or what is kept when it fails (psserver.checkpoints.files).
"""

import errno
import shutil
from pathlib import Path

from common.errors import first_line


def why_not_written(directory: Path, needed_bytes: int, exc: Exception, latest: Path) -> str:
    """The cause of `exc`, met writing a checkpoint of about `needed_bytes` into `directory`,
    in words, and what to do; `latest` is the checkpoint a run there goes on from."""
    try:
        free: int | None = shutil.disk_usage(directory).free
    except OSError:
        free = None
    code = getattr(exc, "errno", None)
    # An OSError says what it is; torch's RuntimeError does not, so the free space decides.
    full = code in (errno.ENOSPC, errno.EDQUOT) or (
        code is None and free is not None and free < needed_bytes
    )
    if full:
        room = "" if free is None else f"{free / 1e6:.1f} MB free, "
        cause = f"the disk is full ({room}a checkpoint takes about {needed_bytes / 1e6:.1f} MB)"
        todo = "free space on it"
    else:
        cause, todo = first_line(exc), f"make {directory} writable"
    if not latest.is_file():  # the run's first checkpoint: there is nothing to go on from
        return f"{cause}; no checkpoint was written there yet: {todo}, then start the run again"
    return (
        f"{cause}; the checkpoints already in {directory} are kept: {todo}, then go on with "
        f"--resume, or give another --checkpoint-dir with --resume-from {latest}"
    )
