"""The first code a console script runs: import its command's module, then call its `main`.

That import takes a second or more (torch, through almost every module). A Ctrl-C meanwhile
raised KeyboardInterrupt out of the import, before `explain_errors` was there to catch it, and
Python printed a traceback through torch's internals. Here it ends the command as a Ctrl-C
later does: exit 130 and one line. A command that starts another (a leader its followers)
starts it the same way, with `command_line`.

What it is not: the commands, nor their signal handling once they run (common.cli). It must
stay cheap to import: the standard library only, nothing from common that imports torch or
click, and nothing from psserver or psworker by name (their entry modules pass theirs).
"""

import gc
import importlib
import signal
import sys
from collections.abc import Callable
from types import FrameType

INTERRUPTED_EXIT_CODE = 130  # 128 + SIGINT, as a shell reports a command Ctrl-C stopped


def run_command(module: str, interrupt_held: bool = False) -> None:
    """Import `module` (e.g. "psserver.cli.server") and call its `main()`; Ctrl-C during the import
    exits 130 with one line on stderr.

    The KeyboardInterrupt does not always come out of the import as itself: raised inside
    numpy's import from torch's C code, it was swallowed there, and the next `import numpy`
    failed with "ImportError: cannot load module more than once per process". So whatever
    ends the import after a Ctrl-C is taken for the Ctrl-C. `interrupt_held`: SIGINT came
    blocked from the parent (common.processes.start_child), so that a Ctrl-C during Python's
    own start-up, before this, waited for it; it is let through here."""
    interrupted: list[int] = []

    def interrupt(signum: int, frame: FrameType | None) -> None:
        interrupted.append(signum)
        raise KeyboardInterrupt

    ours = signal.getsignal(signal.SIGINT) is signal.default_int_handler  # not ignored
    if ours:
        signal.signal(signal.SIGINT, interrupt)
    try:
        if interrupt_held:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
        main: Callable[[], None] = importlib.import_module(module).main
    except BaseException:
        if not interrupted:
            raise
        interrupted_while_starting()
    if interrupted:  # an import swallowed the KeyboardInterrupt and still finished
        interrupted_while_starting()
    if ours:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    main()


def interrupted_while_starting() -> None:
    """Nothing has started yet, so nothing is left behind: no more to say than one line. A
    second Ctrl-C (`timeout` passes one on to its whole process group) ends the teardown at
    once, rather than with a KeyboardInterrupt traceback from within it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    print("interrupted while starting", file=sys.stderr)
    raise SystemExit(INTERRUPTED_EXIT_CODE) from None


def freeze_imported_objects() -> None:
    """Leave the objects that the imports made, torch's above all, out of every garbage
    collection from now on (gc.freeze): they live as long as the process anyway. A full
    collection walked all of them (180,000 once torch is imported: 0.2 s of CPU each), now
    and then while a worker trained and more than once as Python exits: a ps-server or
    ps-worker of 20 LeNet steps took 1.85 s of CPU in all, 1.5 s with this. What the
    command makes afterwards is collected as before. Every command's `main()` calls this
    first, once its module's imports are done."""
    gc.freeze()


def command_line(module: str, name: str) -> list[str]:
    """The command line that runs `module`'s `main()` as its console script `name` does:
    through run_command, and named `name` in its usage lines. `python -m module` does
    neither: a follower shard a Ctrl-C caught in its import printed a traceback, then
    "ImportError: cannot load module more than once per process". For a child started
    with start_child(..., hold_interrupt=True)."""
    code = (
        f"import sys; sys.argv[0] = {name!r}; from common.startup import run_command; "
        f"run_command({module!r}, interrupt_held=True)"
    )
    return [sys.executable, "-c", code]
