"""Start the processes a benchmark needs, wait for them with a timeout, clean up."""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common.errors import PSError

STARTUP_TIMEOUT_S = 120.0


class ProcessGroup:
    """Children started with `python -m MODULE ...`, all killed on exit."""

    def __init__(self, threads: int = 1) -> None:
        self.scratch = Path(tempfile.mkdtemp(prefix="ps-bench-"))
        self.children: list[tuple[str, subprocess.Popen[bytes]]] = []
        self.env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}

    def start(self, role: str, module: str, *args: str) -> subprocess.Popen[bytes]:
        log = open(self.scratch / f"{role}.log", "wb")  # noqa: SIM115 - lives as long as the child
        process = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.env,
            start_new_session=True,
        )
        self.children.append((role, process))
        return process

    def endpoint(self, name: str, process: subprocess.Popen[bytes]) -> str:
        path = self.scratch / name
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if path.exists() and path.read_text().strip():
                return path.read_text().strip()
            if process.poll() is not None:
                raise PSError(f"a benchmark process failed to start:\n{self.tail()}")
            time.sleep(0.05)
        raise PSError("a benchmark server did not start listening in time")

    def wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for role, process in self.children:
            try:
                code = process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise PSError(f"benchmark process {role} hung\n{self.tail()}") from None
            if code != 0:
                raise PSError(f"benchmark process {role} exited with {code}\n{self.tail()}")

    def tail(self) -> str:
        parts = []
        for role, _ in self.children:
            text = (self.scratch / f"{role}.log").read_text(errors="replace")[-1500:]
            parts.append(f"--- {role}:\n{text}")
        return "\n".join(parts)

    def read_json(self, name: str) -> Any:
        return json.loads((self.scratch / name).read_text())

    def close(self) -> None:
        for _, process in self.children:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        shutil.rmtree(self.scratch, ignore_errors=True)
