"""Child processes that do not outlive the command that started them.

A command that starts servers and workers (ps-local, ps-bench, a leader with --num-shards)
stops them on its way out; but a SIGKILL (an OOM kill, `kill -9`) gives it no way out, and
its children, in sessions of their own, ran on for ever (a ps-server of 665 MB under PID 1).
On Linux the kernel sends them SIGTERM when their parent dies (PR_SET_PDEATHSIG), which each
of them handles as any termination. Elsewhere this is a no-op.
"""

import contextlib
import ctypes
import os
import signal
from collections.abc import Callable

PR_SET_PDEATHSIG = 1


def die_with_parent() -> Callable[[], None]:
    """A `preexec_fn` for subprocess.Popen: SIGTERM to the child when this process dies.

    libc is loaded here, in the parent: between fork and exec the child must not take locks
    (a thread of the parent could have held the loader's), only make the one system call.
    The thread that starts the child must live as long as it: the signal follows the
    thread, not the process (every caller starts its children from the main thread)."""
    try:
        prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return lambda: None
    parent = os.getpid()

    def set_death_signal() -> None:
        with contextlib.suppress(OSError):
            prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before the call: nobody will stop us
            os._exit(1)

    return set_death_signal
