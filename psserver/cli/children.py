"""The children of `ps-local`: each started in a session of its own, its output relayed line by
line under its role, and all of them watched until they end or the first one fails.

The first child to fail stops the others and ends the wait with a PSError that names it and
how it ended (its exit code, or the signal that killed it), and that points to its `Error:`
line relayed just above or, when it left none (a crash), gives the tail of its stderr. A
worker that fails because its server stopped the job on a failure is reported as the server's
failure, when the server exits with an error within `SERVER_BEHIND_S`.
Children are stopped workers first (so that each can still tell the server it leaves), then
the server, each killed if it has not exited `STOP_TIMEOUT_S` after its SIGTERM; workers
still running `AFTER_SERVER_S` after the server finished never heard it, and are stopped too.

What it is not: what the children run. psserver.cli.local builds their command lines and reads
the server's summary; this module only starts, relays, stops and waits.
"""

import collections
import contextlib
import os
import signal
import subprocess
import threading
import time
from typing import IO

import click

from common.errors import PSError
from common.processes import how_it_ended, start_child

STDERR_TAIL_LINES = 20
STOP_TIMEOUT_S = 10.0  # after SIGTERM, before SIGKILL
AFTER_SERVER_S = 10.0  # how long workers may still run once the server has finished
# How long a worker that says its server stopped the job waits for that server to fail too:
# the server first gives its workers --stop-grace (10 s; ps-local leaves the default) to hear
# STOP, then exits.
SERVER_BEHIND_S = 15.0
SERVER_STOPPED_THE_JOB = "Error: the server stopped the job"  # psworker.cli's last line then


class Child:
    """A child process whose output is relayed with a prefix and whose stderr tail is kept."""

    def __init__(self, role: str, argv: list[str], env: dict[str, str]) -> None:
        self.role = role
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL_LINES)
        self.process = start_child(  # and so a SIGKILL here stops them too
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,  # so a Ctrl-C here is handled by us, not sent to all
        )
        self._relays = [
            threading.Thread(target=self._relay, args=(self.process.stdout, False), daemon=True),
            threading.Thread(target=self._relay, args=(self.process.stderr, True), daemon=True),
        ]
        for relay in self._relays:
            relay.start()

    def _relay(self, stream: IO[str] | None, is_stderr: bool) -> None:
        assert stream is not None
        for line in stream:
            line = line.rstrip("\n")
            if is_stderr:
                self.stderr_tail.append(line)
            click.echo(f"[{self.role}] {line}", err=is_stderr)

    def finish_output(self) -> None:
        for relay in self._relays:
            relay.join(timeout=5)

    def terminate(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # it exited just now
                os.killpg(self.process.pid, signal.SIGTERM)

    def wait_or_kill(self, deadline: float) -> None:
        try:
            self.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def failure(self, subject: str | None = None) -> str:
        """How it ended, e.g. `server exited with code 1; see its error above` (`subject`
        instead of its role). Its own `Error:` line is its last, relayed just above: said
        again here, every start-up error was printed twice."""
        ended = f"{subject or self.role} {how_it_ended(self.process.returncode)}"
        last = self.stderr_tail[-1] if self.stderr_tail else ""
        if last.startswith("Error: "):
            return f"{ended}; see its error above"
        tail = "\n".join(f"    {line}" for line in self.stderr_tail) or "    (no stderr)"
        return f"{ended}; its last stderr:\n{tail}"


def stop_all(children: list[Child]) -> None:
    """Workers first and all at once, so that each can still tell the server it leaves;
    then the server. Whoever has not exited 10 s after its SIGTERM is killed."""
    workers = [child for child in children if child.role != "server"]
    for group in (workers, [child for child in children if child.role == "server"]):
        for child in group:
            child.terminate()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for child in group:
            child.wait_or_kill(deadline)


def _server_behind(failed: Child, children: list[Child]) -> Child:
    """The child to report for `failed`: the server, when a worker failed because the server
    stopped the job on a failure of its own (a checkpoint it could not write) and so exits
    with an error too, moments later; else `failed` itself."""
    server = next((c for c in children if c.role == "server"), None)
    if failed.role == "server" or server is None:
        return failed
    failed.finish_output()  # its last line, read to the end of its stderr
    if not (failed.stderr_tail and failed.stderr_tail[-1].startswith(SERVER_STOPPED_THE_JOB)):
        return failed  # a failure of its own: the others are stopped at once
    with contextlib.suppress(subprocess.TimeoutExpired):
        server.process.wait(timeout=SERVER_BEHIND_S)
    return server if server.process.returncode not in (None, 0) else failed


def supervise(children: list[Child], after_server_s: float = AFTER_SERVER_S) -> None:
    """Wait for every child; on the first failure stop the rest and report it.

    Workers normally end as soon as the server has told them to stop. One still running
    `after_server_s` after the server finished never heard it (a resumed run that was already
    over ends before any worker has registered) and would retry a gone server for minutes:
    it is stopped."""
    server_done: float | None = None
    while True:
        running = False
        for child in children:
            code = child.process.poll()
            if code is None:
                running = True
            elif code != 0:
                culprit = _server_behind(child, children)
                stop_all(children)
                culprit.finish_output()
                raise PSError(culprit.failure())
            elif child.role == "server" and server_done is None:
                server_done = time.monotonic()
        if running and server_done is not None and time.monotonic() - server_done > after_server_s:
            click.echo(
                f"the server finished {after_server_s:g} s ago; stopping the workers that "
                "never heard it", err=True,
            )  # fmt: skip
            stop_all(children)
            running = False
        if not running:
            for child in children:
                child.finish_output()
            return
        time.sleep(0.2)
