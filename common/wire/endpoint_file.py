"""`--endpoint-file PATH`: where a process that bound a `*` port says which port it got.

Written whole (a temporary file, then a rename), so that a script or test polling the
file never reads half an address; missing folders are made, as for --summary."""

import contextlib
import os
from pathlib import Path

from common.errors import PSError


def write_endpoint_file(path: Path, endpoint: str) -> None:
    """Write `endpoint` (and a newline) to `path`; a PSError saying so when it cannot."""
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary.write_text(endpoint + "\n")
        os.replace(temporary, path)
    except OSError as exc:
        with contextlib.suppress(OSError):  # its folder may be what failed
            temporary.unlink(missing_ok=True)
        raise PSError(
            f"--endpoint-file {path}: cannot write it ({exc.strerror or exc}); give a path "
            "in a folder you can write to"
        ) from None
