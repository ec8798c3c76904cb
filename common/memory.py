"""Keep large freed buffers in the process heap instead of returning them to the kernel.

glibc's malloc serves requests above its mmap threshold (at most 32 MB by default) with fresh
mmap'd pages and unmaps them on free, so every 45 MB message ZeroMQ receives pays ~17 ms of
page faults. Raising the mmap and trim thresholds makes freed message buffers reusable, which
is what lets a sync round run close to the bare-ZeroMQ floor. Other C libraries are left alone.
"""

import ctypes
import ctypes.util
import logging

log = logging.getLogger("ps")
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
ONE_GIB = 1 << 30


def reuse_large_buffers() -> bool:
    """Tune glibc malloc for large reused buffers; False (and no change) elsewhere."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False  # not glibc (musl, macOS): nothing to tune
    ok = mallopt(M_MMAP_THRESHOLD, ONE_GIB) == 1 and mallopt(M_TRIM_THRESHOLD, 2 * ONE_GIB) == 1
    log.debug("glibc malloc tuned for large buffers: %s", ok)
    return ok
