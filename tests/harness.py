"""Real processes for integration tests: start ps-server / ps-worker / ps-local, wait with
timeouts, show each child's stderr when something fails, and kill whole process groups; and
what they need: free ports, small Fashion-MNIST files, waits for a log line.

What this is not: hand-driven protocol peers, sockets a test drives message by message
(tests.raw_peers).
"""

import contextlib
import os
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from common.roles import SERVER, WORKER, command_args

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
# A worker's device options unless a test names others: one CPU thread, so that workers
# running side by side on a small machine do not fight over its cores.
CPU_WORKER = ("--device", "cpu", "--threads", "1")


@dataclass
class Proc:
    role: str
    process: subprocess.Popen[bytes]
    stdout_path: Path
    stderr_path: Path

    def output(self) -> str:
        return self.stdout_path.read_text(errors="replace")

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def describe(self) -> str:
        return (
            f"--- {self.role} (exit {self.process.poll()}) stderr:\n{self.stderr()[-4000:]}\n"
            f"--- {self.role} stdout:\n{self.output()[-2000:]}"
        )


@dataclass
class Cluster:
    """Starts processes into a scratch folder and cleans up every one of them."""

    workdir: Path
    procs: list[Proc] = field(default_factory=list)

    def start(self, role: str, module: str, *args: str, stdin: bytes | None = None) -> Proc:
        """Start `python -m module args`; `stdin`: bytes written to its standard input."""
        index = len(self.procs)
        stdout_path = self.workdir / f"{index}-{role}.out"
        stderr_path = self.workdir / f"{index}-{role}.err"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        with open(stdout_path, "wb") as out, open(stderr_path, "wb") as err:
            process = subprocess.Popen(
                [sys.executable, "-m", module, *args],
                stdin=subprocess.DEVNULL if stdin is None else subprocess.PIPE,
                stdout=out,
                stderr=err,
                cwd=self.workdir,
                env=env,
                start_new_session=True,
            )
        if stdin is not None:
            assert process.stdin is not None
            process.stdin.write(stdin)
            process.stdin.close()
        proc = Proc(role, process, stdout_path, stderr_path)
        self.procs.append(proc)
        return proc

    def start_server(self, *args: str, name: str = "server") -> tuple[Proc, str]:
        """ps-server on a free port, one thread, 5 s of stop grace; `args` after those."""
        endpoint_file = self.workdir / f"{name}.endpoint"
        listening = {"bind": "tcp://127.0.0.1:*", "endpoint_file": endpoint_file}
        quick = {"threads": 1, "stop_grace": 5.0}
        proc = self.start(name, SERVER.module, *command_args(SERVER, listening, quick), *args)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if endpoint_file.exists():  # written whole: there at all, it holds one whole line
                text = endpoint_file.read_text()
                assert text.endswith("\n") and "\n" not in text[:-1], f"{name} wrote {text!r}"
                return proc, text.strip()
            if proc.process.poll() is not None:
                raise AssertionError(f"server exited before listening\n{proc.describe()}")
            time.sleep(0.05)
        raise AssertionError(f"server did not write its endpoint in 60 s\n{proc.describe()}")

    def start_follower(
        self, leader: str, *args: str, name: str = "follower", shard: int = 1,
        num_shards: int = 2, bind: str = "tcp://127.0.0.1:*", stdin: bytes | None = None,
    ) -> Proc:  # fmt: skip
        """Follower shard `shard` of `num_shards` that joins `leader`, on a free port unless
        `bind` says otherwise (never ps-server's default, a fixed port that another run on
        the host may hold); `args` after those."""
        told = {"shard": shard, "num_shards": num_shards, "leader": leader, "bind": bind}
        return self.start(name, SERVER.module, *command_args(SERVER, told), *args, stdin=stdin)

    def start_worker(
        self, endpoint: str, *args: str, name: str = "worker", device: Sequence[str] = CPU_WORKER
    ) -> Proc:
        """`device`: the worker's device options (`--gpu 0`, `--device cuda:0`, ...)."""
        told = command_args(WORKER, {"server": endpoint, "progress": "log", "timeout": 60.0})
        return self.start(name, WORKER.module, *told, *device, *args)

    def train_to_end(
        self,
        name: str,
        server_args: Sequence[str],
        devices: Sequence[Sequence[str]],
        timeout: float,
        worker_args: Sequence[str] = (),
        folder: str = "",
    ) -> tuple[Proc, dict[str, Any]]:
        """One job to its end: a server with `server_args` and the checkpoint folder
        `workdir / (folder or name)`, one worker per entry of `devices` (that worker's device
        options, see `start_worker`), each with `worker_args`. Waits up to `timeout` s for
        every process of the cluster; the server, and the final checkpoint (latest.pt)."""
        checkpoints = self.workdir / (folder or name)
        server, endpoint = self.start_server(
            *server_args, "--workers", str(len(devices)), "--checkpoint-dir", str(checkpoints),
            name=f"{name}-server",
        )  # fmt: skip
        for rank, device in enumerate(devices):
            self.start_worker(endpoint, *worker_args, name=f"{name}-worker{rank}", device=device)
        self.wait_all(timeout=timeout)
        return server, torch.load(checkpoints / "latest.pt", weights_only=True)

    def wait(self, proc: Proc, timeout: float, expect_code: int | None = 0) -> int:
        try:
            code = proc.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"{proc.role} still running after {timeout} s\n{self.describe_all()}"
            ) from None
        if expect_code is not None and code != expect_code:
            raise AssertionError(
                f"{proc.role} exited {code}, expected {expect_code}\n{self.describe_all()}"
            )
        return code

    def wait_all(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            self.wait(proc, max(0.1, deadline - time.monotonic()))

    def describe_all(self) -> str:
        return "\n".join(proc.describe() for proc in self.procs)

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.process.pid, signal.SIGKILL)
                proc.process.wait(timeout=10)
            assert proc.process.poll() is not None, f"{proc.role} survived SIGKILL"


# ---- small Fashion-MNIST files in the original idx format --------------------------------


def write_idx(path: Path, array: np.ndarray) -> None:
    magic = 0x00000800 | array.ndim  # 0x08: unsigned bytes
    header = struct.pack(">I", magic) + struct.pack(f">{array.ndim}I", *array.shape)
    path.write_bytes(header + array.astype(np.uint8).tobytes())


def make_fashion_mnist(
    root: Path, n_train: int = 40, n_test: int = 24, seed: int = 0
) -> dict[str, np.ndarray]:
    raw = root / "FashionMNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        "train-labels-idx1-ubyte": rng.integers(0, 10, n_train, dtype=np.uint8),
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        "t10k-labels-idx1-ubyte": rng.integers(0, 10, n_test, dtype=np.uint8),
    }
    arrays["train-images-idx3-ubyte"][0, 0, :2] = [0, 255]  # both ends of the range
    for name, array in arrays.items():
        write_idx(raw / name, array)
    assert (raw / "train-images-idx3-ubyte").read_bytes()[:4] == b"\x00\x00\x08\x03"
    assert (raw / "train-labels-idx1-ubyte").read_bytes()[:4] == b"\x00\x00\x08\x01"
    return arrays


# ---- waiting on what a process logs ----------------------------------------------------------


def wait_for_log(proc: Proc, text: str, timeout: float, count: int = 1, after: str = "") -> float:
    """Wait until `text` appears `count` times in the process's stderr (counted after the
    first `after`, if given); return when it did (monotonic)."""

    def seen() -> int:
        log = proc.stderr()
        return (log.partition(after)[2] if after else log).count(text)

    where = f" after {after!r}" if after else ""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if seen() >= count:
            return time.monotonic()
        if proc.process.poll() is not None and seen() < count:
            raise AssertionError(
                f"{proc.role} exited before logging {text!r}{where} {count} times\n"
                f"{proc.describe()}"
            )
        time.sleep(0.05)
    raise AssertionError(
        f"{proc.role} did not log {text!r}{where} {count} times within {timeout} s\n"
        f"{proc.describe()}"
    )


def wait_for_state(
    server: Proc,
    endpoint: str,
    what: str,
    ok: Callable[[dict[str, Any]], bool],
    timeout: float = 60,
) -> dict[str, Any]:
    """Ask the server for its status (ps-status's STATUS request) until `ok(status)` holds;
    return that status. Fails with the last status and the server's output."""
    from psserver.cli.status import request_status

    deadline = time.monotonic() + timeout
    status: dict[str, Any] = {}
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise AssertionError(f"{server.role} exited before its status showed {what}")
        status = request_status(endpoint, timeout_s=10)
        if ok(status):
            return status
        time.sleep(0.05)
    raise AssertionError(
        f"{server.role}'s status did not show {what} within {timeout} s; last: {status}\n"
        f"{server.describe()}"
    )


def wait_for_signal_handler(
    proc: "Proc | subprocess.Popen[Any]", signum: int, timeout: float
) -> None:
    """Wait until the process catches `signum` (Linux: its SigCgt mask in /proc), so that a
    signal sent then meets its handler, not the default action, however slow its start-up
    (importing torch takes seconds on a loaded machine)."""
    process, role = (proc.process, proc.role) if isinstance(proc, Proc) else (proc, "process")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"{role} exited before catching signal {signum}")
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{process.pid}/status").read_text().splitlines():
                if line.startswith("SigCgt:") and int(line.split()[1], 16) >> (signum - 1) & 1:
                    return
        time.sleep(0.05)
    raise AssertionError(f"{role} did not catch signal {signum} within {timeout} s")


def all_exit(pids: list[int], timeout: float) -> bool:
    """Whether every process in `pids` is gone (or a zombie) within `timeout` seconds; reads
    /proc, so Linux only."""

    def alive(pid: int) -> bool:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return False
        return state != "Z"

    deadline = time.monotonic() + timeout
    while any(alive(pid) for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


NOT_REAPED_EXIT_CODE = 97


def once_reaped(pid_file: Path) -> str:
    """Python source, for a stand-in process, that waits (30 s at most) until the process
    whose pid `pid_file` holds has been reaped by its parent (gone from /proc, no longer a
    zombie): that parent has then seen it end. A stand-in that must fail after its sibling
    failed, and be seen to, waits for this rather than sleeping a guess at it; if that never
    happens, it says so and exits with NOT_REAPED_EXIT_CODE, which no stand-in uses."""
    return (
        "import os, time\n"
        "def _reaped(path):\n"
        "    pid = open(path).read().strip() if os.path.exists(path) else ''\n"
        "    return pid != '' and not os.path.exists('/proc/' + pid)\n"
        "_deadline = time.monotonic() + 30\n"
        f"while not _reaped({str(pid_file)!r}):\n"
        "    if time.monotonic() > _deadline:\n"
        "        print('its sibling was not reaped within 30 s', flush=True)\n"
        f"        os._exit({NOT_REAPED_EXIT_CODE})\n"
        "    time.sleep(0.01)\n"
    )


def writes_its_pid(pid_file: Path) -> str:
    """Python source that writes the process's pid to `pid_file` (see `once_reaped`)."""
    return f"import os; open({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_port_pair() -> int:
    """A free port P with P + 1 free too (a 2-shard server's follower), as far as one can
    tell before binding them."""
    import socket

    for _ in range(100):
        port = free_port()
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise AssertionError("found no two free ports in a row")


def error_after_pausing_to_the_end(cluster: Cluster, paused: Proc, kept: Proc, server: Proc) -> str:
    """Stop `paused` (SIGSTOP) while `kept` trains to the end and `server` exits, then let it
    go on: the one `Error:` line it exits 1 with, once it finds the job gone."""
    paused.process.send_signal(signal.SIGSTOP)
    try:
        cluster.wait(kept, timeout=120)
        cluster.wait(server, timeout=60)  # the job is over, every server gone
    finally:
        paused.process.send_signal(signal.SIGCONT)
    cluster.wait(paused, timeout=60, expect_code=1)
    stderr = paused.stderr()
    assert "Traceback" not in stderr, stderr
    error = [line for line in stderr.splitlines() if line.startswith("Error:")]
    assert len(error) == 1, stderr
    return error[0]


def kill(proc: Proc, sig: int = signal.SIGKILL) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.process.pid, sig)
