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
M_ARENA_MAX = -8
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
    # One arena: ZeroMQ's I/O thread allocates what the main thread frees, and a per-thread
    # arena (at most 64 MB per heap) would hand 45 MB messages straight to mmap again.
    ok = all(
        mallopt(option, value) == 1
        for option, value in (
            (M_ARENA_MAX, 1),
            (M_MMAP_THRESHOLD, ONE_GIB),
            (M_TRIM_THRESHOLD, 2 * ONE_GIB),
        )
    )
    log.debug("glibc malloc tuned for large buffers: %s", ok)
    return ok
