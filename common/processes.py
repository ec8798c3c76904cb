"""Child processes that do not outlive the command that started them, started so that no
signal is lost or mishandled on the way, and how to say how one ended.

A command that starts servers and workers (ps-local, ps-bench, a leader with --num-shards)
stops them on its way out; but a SIGKILL (an OOM kill, `kill -9`) gives it no way out, and
its children, in sessions of their own, ran on for ever (a ps-server of 665 MB under PID 1).
On Linux the kernel sends them SIGTERM when their parent dies (PR_SET_PDEATHSIG), which each
of them handles as any termination. Elsewhere that part is a no-op.

What it is not: what the children run, nor how a command stops them (psserver.cli.children,
psserver.shards.launch); nor the handlers of a running command (common.cli).
"""

import contextlib
import ctypes
import os
import signal
import subprocess
import threading
from collections.abc import Callable, Iterator, Mapping
from types import FrameType
from typing import IO, Any

PR_SET_PDEATHSIG = 1
CHILD_STOP_S = 5.0  # how long a child started as a stop signal came has to end on SIGTERM
# The signals that stop a command (Ctrl-C, kill, a closed terminal): a child that ended on
# one may have been stopped along with the command itself.
STOPPING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


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


def start_child(
    argv: list[str],
    hold_interrupt: bool = False,
    env: Mapping[str, str] | None = None,
    stdin: int | IO[Any] | None = None,
    stdout: int | IO[Any] | None = None,
    stderr: int | IO[Any] | None = None,
    start_new_session: bool = False,
    text: bool = False,
) -> "subprocess.Popen[Any]":
    """subprocess.Popen(argv, ...) for a child that dies with this process (die_with_parent),
    with the STOPPING signals held back while it forks. `text`: its pipes carry lines of
    text, each passed on as it ends (line-buffered). `hold_interrupt`:
    SIGINT stays blocked in the child, for a command that lets it through once it can
    handle it (common.startup.command_line): a Ctrl-C while Python itself starts ended in
    "Fatal Python error: init_import_site" and a traceback.

    Between fork and exec the child runs Python code (logging's and threading's at-fork
    hooks, the preexec_fn) with this process's signal handlers, and this process runs its
    own at-fork hooks. A Ctrl-C or a SIGTERM there raised common.cli's exception inside a
    hook, which Python prints as `Exception ignored in: <function _releaseLock>` with a
    traceback and drops: the child lost the signal, or the parent did and went on (a leader
    that ps-local stopped then reported its follower, stopped by the same signal, as a
    failure). So this thread blocks them and this process only notes them meanwhile; the
    child takes their default actions back (an ignored one stays ignored, as exec keeps it)
    before it lets them through, so one that came for it ends it as it would have after
    exec; and this process handles those it noted once the child has started."""
    setup = _child_setup(hold_interrupt)
    noted: list[int] = []
    try:
        with signals_noted(noted):
            child = subprocess.Popen(
                argv,
                preexec_fn=setup,
                env=env,
                stdin=stdin,
                stdout=stdout,
                stderr=stderr,
                start_new_session=start_new_session,
                text=text,
                bufsize=1 if text else -1,
            )
    except BaseException:
        for signum in noted:
            signal.raise_signal(signum)
        raise
    if noted:
        # Its handler runs now, as it would have a moment ago, and the caller (stopping)
        # never gets this child to stop: it is stopped here.
        child.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=CHILD_STOP_S)
        if child.poll() is None:
            child.kill()
            child.wait()
        for signum in noted:
            signal.raise_signal(signum)
    return child


@contextlib.contextmanager
def signals_noted(noted: list[int]) -> Iterator[None]:
    """While the block runs, the STOPPING signals are blocked in this thread and, in the main
    thread, those another thread takes are appended to `noted` instead of handled."""

    def note(signum: int, frame: FrameType | None) -> None:
        noted.append(signum)

    handlers: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for signum in STOPPING:
            handler = signal.getsignal(signum)
            if handler not in (None, signal.SIG_IGN):  # None: not set from Python; leave it
                handlers[signum] = handler
                signal.signal(signum, note)
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOPPING)
    try:
        yield
    finally:
        for held, handler in handlers.items():
            signal.signal(held, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # one still pending comes now


def _child_setup(hold_interrupt: bool) -> Callable[[], None]:
    """The preexec_fn of start_child: the death signal, then the STOPPING signals back to
    what exec would make of them, then unblocked. It is made before they are blocked and runs
    in the child, where they still are: nothing can interrupt it."""
    set_death_signal = die_with_parent()
    ignored = {signum for signum in STOPPING if signal.getsignal(signum) == signal.SIG_IGN}
    blocked_before = signal.pthread_sigmask(signal.SIG_BLOCK, [])  # as it is: none added
    if hold_interrupt:
        blocked_before = {*blocked_before, signal.SIGINT}

    def setup() -> None:
        set_death_signal()
        for signum in STOPPING:
            if signum not in ignored:
                signal.signal(signum, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked_before)

    return setup


def stopped_by(code: int) -> str | None:
    """The STOPPING signal a child's exit code says it ended on, killed by it (-N) or having
    handled it (128 + N, as common.cli and common.startup exit); None for any other end."""
    for signum in STOPPING:
        if code in (-signum, 128 + signum):
            return signal.Signals(signum).name
    return None


def how_it_ended(code: int) -> str:
    """`exited with code 1`, `was killed by SIGKILL`, `was stopped by SIGTERM (exit code 143)`:
    a child's end in words (Popen gives -N for a signal, which said nothing to a person)."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:  # a real-time signal, say
            return f"was killed by signal {-code}"
    if (name := stopped_by(code)) is not None:
        return f"was stopped by {name} (exit code {code})"
    return f"exited with code {code}"
