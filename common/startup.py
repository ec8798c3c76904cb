"""The first code a console script runs: import its command's module, then call its `main`.

That import takes a second or more (torch, through almost every module). A Ctrl-C meanwhile
raised KeyboardInterrupt out of the import, before `explain_errors` was there to catch it, and
Python printed a traceback through torch's internals. Here it ends the command as a Ctrl-C
later does: exit 130 and one line.

What it is not: the commands, nor their signal handling once they run (common.cli). It must
stay cheap to import: the standard library only, nothing from common that imports torch or
click, and nothing from psserver or psworker by name (their entry modules pass theirs).
"""

import importlib
import sys
from collections.abc import Callable

INTERRUPTED_EXIT_CODE = 130  # 128 + SIGINT, as a shell reports a command Ctrl-C stopped


def run_command(module: str) -> None:
    """Import `module` (e.g. "psserver.cli") and call its `main()`; Ctrl-C during the import
    exits 130 with one line on stderr."""
    try:
        main: Callable[[], None] = importlib.import_module(module).main
    except KeyboardInterrupt:
        # nothing has started yet, so nothing is left behind: no more to say than this
        print("interrupted while starting", file=sys.stderr)
        raise SystemExit(INTERRUPTED_EXIT_CODE) from None
    main()
