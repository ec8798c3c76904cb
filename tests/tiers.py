"""The two test tiers, `unit` and `integration`, and the guard that keeps them honest.

A test is `integration` when it starts a process: a ps-server, ps-worker, ps-local or ps-bench
(through tests/harness.py's Cluster, a command invoked with CliRunner, subprocess or
multiprocessing), or any other child. Collection marks it so from an explicit
`@pytest.mark.integration` (or a module's `pytestmark`) and from the fixtures it uses, directly
or through other fixtures (PROCESS_FIXTURES); every other test is `unit`. `pytest -m unit` runs
the fast tier, plain `pytest` both.

A marking that is wrong cannot pass unseen: while a unit test runs (its setup, call and
teardown), starting a child process fails it, with a line that says to mark it integration.

What this is not: the fixtures themselves (tests/conftest.py) or the processes they start
(tests/harness.py).
"""

import _posixsubprocess
import os
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

# subprocess.Popen itself, as imported: a test may put a stand-in of its own in its place.
POPEN = subprocess.Popen

# What libraries run to look something up about the machine, not processes a test starts; some
# run only where a cache is missing (a fresh CI machine), so a guard counting them would pass
# here and fail there: ctypes.util.find_library (ps-server's reuse_large_buffers, CUDA's library
# loader) runs ldconfig; matplotlib's first font cache, fc-list; platform.processor(), uname.
LOOKUPS = frozenset({"ldconfig", "fc-list", "uname"})

# A fixture that starts processes asks for `starts_processes` (conftest.py), as `cluster` does: a
# test using one, even through other fixtures, is integration.
PROCESS_FIXTURES = frozenset({"starts_processes"})

MARK_IT = (
    "this test started a child process ({what}), which a unit test may not: mark it "
    "@pytest.mark.integration (or its module: pytestmark = pytest.mark.integration), "
    "or start processes through the cluster fixture"
)


def mark_tiers(items: list[pytest.Item]) -> None:
    """Mark each collected test `unit` or `integration` (see the module's docstring)."""
    for item in items:
        explicit_unit = item.get_closest_marker("unit") is not None
        integration = item.get_closest_marker("integration") is not None
        starts = PROCESS_FIXTURES.intersection(getattr(item, "fixturenames", ()))
        if explicit_unit and (integration or starts):
            reason = "is marked integration" if integration else "uses a fixture that does"
            raise pytest.UsageError(
                f"{item.nodeid} is marked unit but {reason}, which starts processes: "
                "remove its unit mark"
            )
        if integration or starts:
            if not integration:
                item.add_marker(pytest.mark.integration)
        elif not explicit_unit:
            item.add_marker(pytest.mark.unit)


def is_unit(item: pytest.Item) -> bool:
    return item.get_closest_marker("unit") is not None


class ChildProcessGuard:
    """While on, every way Python starts a child process fails: subprocess.Popen (and so
    subprocess.run, os.popen, CliRunner commands that start children), fork, posix_spawn,
    os.system and multiprocessing's spawn and forkserver starts (_posixsubprocess.fork_exec).
    A start from another thread fails that thread and is kept in `started`, so that the test
    fails even where that thread's error would be lost."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self._lock = threading.Lock()

    def refuse(self, what: str) -> None:
        message = MARK_IT.format(what=what)
        if threading.current_thread() is not threading.main_thread():
            message += f" (in thread {threading.current_thread().name})"
        with self._lock:
            self.started.append(message)
        pytest.fail(message, pytrace=False)

    def take(self) -> str | None:
        """The first refused start since the last take, if any."""
        with self._lock:
            first = self.started[0] if self.started else None
            self.started.clear()
        return first

    @contextmanager
    def on(self) -> Iterator[None]:
        patch = pytest.MonkeyPatch()
        popen_init = POPEN.__init__
        looking_up = threading.local()  # a lookup's own start, through the calls patched below

        def popen(process: object, args: Any, *rest: Any, **kwargs: Any) -> None:
            argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
            program = os.path.basename(os.fsdecode(argv[0])) if argv else ""
            if program in LOOKUPS and not kwargs.get("shell"):
                looking_up.now = True
                try:
                    popen_init(process, args, *rest, **kwargs)
                finally:
                    looking_up.now = False
                return
            self.refuse(f"subprocess.Popen: {' '.join(map(str, argv))[:160]}")

        def refusing(module: Any, name: str) -> None:
            original = getattr(module, name)

            def refused(*args: Any, **kwargs: Any) -> Any:
                if getattr(looking_up, "now", False):
                    return original(*args, **kwargs)
                self.refuse(f"{module.__name__}.{name}")

            patch.setattr(module, name, refused)

        try:
            patch.setattr(POPEN, "__init__", popen)
            refusing(_posixsubprocess, "fork_exec")
            for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system"):
                if hasattr(os, name):
                    refusing(os, name)
            yield
        finally:
            patch.undo()
