"""Start the processes a benchmark needs, wait for them with a timeout, clean up.

`with ProcessGroup(threads) as group:` kills every child on the way out and deletes the scratch
folder with their logs, except after a failure or Ctrl-C: then the logs stay for the person
to read, and an interrupt says where they are.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

from common.cli import without_option_variables
from common.errors import PSError
from common.processes import how_it_ended, start_child
from common.roles import SERVER, Role, Spec, command_args
from psserver.shards.auth import new_shard_secret, write_secret_file

STARTUP_TIMEOUT_S = 120.0
# When a client fails, how long to wait for its server to fail too: a server that stops (a
# follower shard it started could not bind, say) ends its clients' runs with an error that
# only points at it, while the cause is in the server's log.
SERVER_GRACE_S = 3.0
# The server's option for one bucket: the gradient goes, and the weights come, in one piece.
WHOLE_GRADIENT: Mapping[str, float] = {"bucket_mb": 0.0}


def bucketed(bucket_mb: float | None) -> Mapping[str, float | None]:
    """The server's --bucket-mb for a bucketed run; None leaves the server's default."""
    return {"bucket_mb": bucket_mb}


class ProcessGroup:
    """Children started with `python -m MODULE ...`, all killed on exit."""

    def __init__(self, threads: int = 1) -> None:
        self.scratch = Path(tempfile.mkdtemp(prefix="ps-bench-"))
        self.children: list[tuple[str, subprocess.Popen[bytes]]] = []
        self.servers: set[str] = set()  # roles whose failure explains their clients'
        self.env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}

    def __enter__(self) -> "ProcessGroup":
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close(keep_logs=exc_type is not None)
        if isinstance(exc, KeyboardInterrupt) and not str(exc):  # an inner group's says it
            # Ctrl-C: the logs stay, as after any failure, and the person is told where.
            raise KeyboardInterrupt(f"the logs of the run it stopped are in {self.scratch}")

    def close(self, keep_logs: bool = False) -> None:
        """Kill every child; delete the scratch folder unless its logs should stay."""
        self.kill()
        if not keep_logs:
            shutil.rmtree(self.scratch, ignore_errors=True)

    def start(
        self,
        role: str,
        module: str,
        *args: str,
        prefix: tuple[str, ...] = (),
        follower: bool = False,
        server: bool = False,
    ) -> subprocess.Popen[bytes]:
        """`prefix`: a command that runs the child elsewhere, e.g. `ip netns exec NS`; it
        must exec the child, so that killing the process group kills the child. `follower`:
        a follower shard, which refuses the job's PS_ variables (it takes the job from the
        leader), so the user's exported ones stay with the server and the workers. `server`:
        the others' server, whose failure is reported rather than theirs."""
        if server:
            self.servers.add(role)
        env = self.env
        if follower:
            env = without_option_variables(env)
        log = open(self.scratch / f"{role}.log", "wb")  # noqa: SIM115 - lives as long as the child
        process = start_child(  # a ps-bench killed with SIGKILL stops them too
            [*prefix, sys.executable, "-m", module, *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        self.children.append((role, process))
        return process

    def start_role(
        self, name: str, role: Role, *specs: Spec, prefix: tuple[str, ...] = (),
        follower: bool = False, server: bool = False,
    ) -> subprocess.Popen[bytes]:  # fmt: skip
        """`start` a `role` told `specs` (common.roles.command_args)."""
        args = command_args(role, *specs)
        return self.start(name, role.module, *args, prefix=prefix, follower=follower, server=server)

    def shard_secret(self) -> tuple[bytes, Path]:
        """A new shard secret, and a file in the scratch folder that holds it (only this user
        looks inside: mkdtemp), for a leader whose followers this group does not start."""
        secret = new_shard_secret()
        return secret, write_secret_file(self.scratch / "shard.secret", secret)

    def start_server(
        self,
        phase: str,
        job: Spec,
        bind: str = "tcp://127.0.0.1:*",
        prefix: tuple[str, ...] = (),
    ) -> tuple[subprocess.Popen[bytes], str]:
        """Start ps-server with the options `job` (on a free localhost port by default);
        return it and its endpoint. The options it is not given keep their defaults, or
        take the PS_ variables the person exported."""
        listening = {"bind": bind, "endpoint_file": self.scratch / "server.ep"}
        quiet = {"log_level": "warning"}
        server = self.start_role(
            "server", SERVER, listening, quiet, job, prefix=prefix, server=True
        )
        return server, self.endpoint("server.ep", server, phase)

    def endpoint(self, name: str, server: subprocess.Popen[bytes], phase: str) -> str:
        """Wait for a server to write its bound endpoint to the file `name` in the scratch."""
        path = self.scratch / name
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if path.exists() and path.read_text().strip():
                return path.read_text().strip()
            code = server.poll()
            if code is not None:  # its own log says why: "floor-server.log", say
                role = next((r for r, p in self.children if p is server), "server")
                raise self._failed(phase, role, code)
            time.sleep(0.05)
        raise PSError(
            f"{phase}: the server did not listen within {STARTUP_TIMEOUT_S:.0f} s "
            f"(logs in {self.scratch})"
        )

    def wait(
        self,
        timeout: float,
        phase: str,
        roles: Iterable[str] | None = None,
        hint: str = "",
        watch: Callable[[], object] | None = None,
    ) -> None:
        """Wait for the children (or those `roles`); report the first that fails, whichever.
        `watch`, called on every check, raises for a failure it watches for."""
        roles = list(roles) if roles is not None else None  # read on every check below
        deadline = time.monotonic() + timeout
        while not self.finished(phase, roles):
            if watch is not None:
                watch()
            if time.monotonic() > deadline:
                pending = ", ".join(self.running(roles))
                raise PSError(
                    f"{phase}: {pending} still running after {timeout:.0f} s"
                    f"{'; ' + hint if hint else ''} (logs in {self.scratch})"
                )
            time.sleep(0.1)

    def running(self, roles: Iterable[str] | None = None) -> list[str]:
        """The children (or those `roles`) that have not exited yet."""
        wanted = set(roles) if roles is not None else None
        return [
            role
            for role, process in self.children
            if (wanted is None or role in wanted) and process.poll() is None
        ]

    def finished(self, phase: str, roles: Iterable[str] | None = None) -> bool:
        """Whether the children (or those `roles`) have all exited, without waiting; the
        first that failed raises, whichever it is."""
        wanted = set(roles) if roles is not None else None
        done = True
        for role, process in self.children:
            if wanted is not None and role not in wanted:
                continue
            code = process.poll()
            if code is None:
                done = False
            elif code != 0:
                raise self._blame(phase, role, code)
        return done

    def _blame(self, phase: str, role: str, code: int) -> PSError:
        """The error for `role`'s failure, or its server's when that failed too: the
        client's own message then only says that the server went away."""
        if role in self.servers:
            return self._failed(phase, role, code)
        servers = [(r, p) for r, p in self.children if r in self.servers]
        deadline = time.monotonic() + SERVER_GRACE_S
        while any(p.poll() is None for _, p in servers) and time.monotonic() < deadline:
            time.sleep(0.05)
        for server, process in servers:
            server_code = process.poll()
            if server_code not in (None, 0):
                return self._failed(phase, server, server_code, f"; {role} stopped with it")
        return self._failed(phase, role, code)

    def _failed(self, phase: str, role: str, code: int, more: str = "") -> PSError:
        cause = log_cause(self.scratch / f"{role}.log")
        return PSError(
            f"{phase}: {role} {how_it_ended(code)}: {cause}{more} (logs in {self.scratch})"
        )

    def read_json(self, name: str) -> Any:
        return json.loads((self.scratch / name).read_text())

    def kill(self) -> None:
        for _, process in self.children:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def log_cause(log: Path) -> str:
    """What a child's log says went wrong: its `Error:` lines (a ps- command's last words;
    a leader's may be its follower's too: "cannot bind ...", then "shard 1 exited"), else
    its last line (a traceback's exception)."""
    text = log.read_text(errors="replace") if log.exists() else ""
    lines = [line.strip() for line in text.strip().splitlines()]
    errors = [line.removeprefix("Error: ") for line in lines if line.startswith("Error: ")]
    if errors:
        return "; ".join(errors[-3:])
    return lines[-1] if lines else "(no output)"
