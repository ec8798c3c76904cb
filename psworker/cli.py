"""`ps-worker`: join a ps-server, compute gradients on one device until told to stop."""

import logging
import signal
import socket
from pathlib import Path
from types import FrameType

import click
import torch

from common.cli import (
    ENV_PREFIX,
    DeviceName,
    EnvAwareCommand,
    FiniteFloatRange,
    explain_errors,
    signals_handled_by,
    timeout_seconds,
)
from common.data import DataSource
from common.device import resolve_device
from common.errors import DataError, PSError
from common.logs import LEVELS, counted, setup_logging
from common.memory import reuse_large_buffers
from common.metrics import prepare_log_dir
from common.security_options import client_security_from_options, client_security_options
from common.wire.endpoints import check_endpoint
from common.wire.protocol import JOB_FAILED
from psworker.connection.client import ServerConnection
from psworker.connection.failures import server_words
from psworker.progress import PROGRESS_MODES
from psworker.trainer import Worker

log = logging.getLogger("ps.worker")


@click.command(
    cls=EnvAwareCommand, context_settings={"show_default": True, "max_content_width": 100}
)
@click.option("--server", default="tcp://127.0.0.1:5555", help="The ps-server endpoint.")
@click.option("--gpu", type=click.IntRange(min=0), default=None, help="Compute on cuda:GPU.")
@click.option(
    "--device",
    type=DeviceName(),
    default=None,
    help="Explicit device: cpu or cuda:N (default: cuda:0 if present, else cpu).",
)
@click.option(
    "--data-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="This host's folder holding FashionMNIST/raw (for --dataset fashion-mnist).",
)
@click.option(
    "--download/--no-download",
    default=False,
    help="Download Fashion-MNIST into --data-dir if it is not there.",
)
@click.option("--name", default=None, help="Label in the server's logs (default: host:device).")
@click.option(
    "--timeout",
    type=timeout_seconds(),
    default=60.0,
    help="Seconds of server silence (no reply, no heartbeat) before a retry.",
)
@click.option(
    "--retries",
    type=click.IntRange(min=0),
    default=5,
    help="Retries of a request, with exponential backoff, before giving up.",
)
@click.option(
    "--step-delay",
    type=FiniteFloatRange(min=0),
    default=0.0,
    help="Sleep this long before each push: fault injection, to play a straggler.",
)
@click.option(
    "--threads",
    type=click.IntRange(min=1),
    default=None,
    help="Torch CPU threads (default: torch's choice).",
)
@click.option(
    "--progress",
    type=click.Choice(PROGRESS_MODES),
    default="auto",
    help="A progress bar on a terminal, or log lines when piped.",
)
@click.option(
    "--log-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Write per-step metrics to DIR/worker-ID.jsonl and TensorBoard events to DIR/tb.",
)
@click.option(
    "--overlap/--no-overlap",
    default=True,
    show_default=True,
    help="Send each gradient bucket (the server's --bucket-mb) and each server shard's slice "
    "as soon as backward has produced it, instead of the whole gradient after backward; in "
    "sync mode the server then streams each updated bucket back as soon as it is applied.",
)
@client_security_options
@click.option("--log-level", type=click.Choice(LEVELS), default="info", help="Log verbosity.")
@explain_errors
def command(
    server: str,
    gpu: int | None,
    device: str | None,
    data_dir: Path | None,
    download: bool,
    name: str | None,
    timeout: float,
    retries: int,
    step_delay: float,
    threads: int | None,
    progress: str,
    log_dir: Path | None,
    overlap: bool,
    curve_secret_key: Path | None,
    curve_server_key: Path | None,
    log_level: str,
) -> None:
    """Train as one worker of a ps-server job. The server decides the model and the data."""
    setup_logging(log_level, "worker")
    check_endpoint(server, "--server")
    reuse_large_buffers()  # 45 MB messages: no page faults on every receive
    resolved = resolve_device(gpu, device)
    if resolved.type == "cuda":  # calls that name no device (streams, caches) mean this one
        torch.cuda.set_device(resolved)
    security = client_security_from_options(curve_secret_key, curve_server_key)
    if threads:
        torch.set_num_threads(threads)
    # The dataset name comes from the server; only the location is this host's choice.
    try:
        source = DataSource("fashion-mnist" if data_dir else "embedded", data_dir, download)
    except DataError as exc:
        raise PSError(str(exc)) from None
    if log_dir is not None:
        prepare_log_dir(log_dir)
    label = name or f"{socket.gethostname()}:{resolved}"
    connection = ServerConnection(server, timeout, retries, security)
    worker = Worker(connection, resolved, source, label, progress, step_delay, log_dir, overlap)

    received: list[int] = []

    def leave_after_this_step(signum: int, frame: FrameType | None) -> None:
        if worker.shutdown.is_set():  # asked twice: do not wait for the step
            raise SystemExit(128 + signum)
        log.warning("got signal %d: leaving the job after the current step", signum)
        received.append(signum)
        worker.shutdown.set()

    connection.interrupt = worker.shutdown  # a pull the server holds ends at once
    # Ctrl-C too: the server should hear that this worker leaves, not wait for it to time out.
    # Only while it trains: a signal in the teardown after it ends the process silently,
    # Ctrl-C too (Python's KeyboardInterrupt would be printed from an atexit callback).
    # Started with Ctrl-C ignored (a background job of a script): still ignored afterwards.
    interrupt_ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    try:
        with signals_handled_by(leave_after_this_step, (signal.SIGTERM, signal.SIGINT)):
            try:
                result = worker.run()
            finally:
                connection.close()
    finally:  # a worker that failed has its teardown (and its error to print) ahead too
        signal.signal(signal.SIGINT, signal.SIG_IGN if interrupt_ignored else signal.SIG_DFL)
    tally = result.tally
    again = (
        f"; {tally.redone} of those steps trained again after the server went back to its "
        "checkpoint"
        if tally.redone
        else ""
    )
    log.info(
        "stopped after %s (%s%s): %s",
        counted(tally.steps, "step"), counted(tally.samples, "image"), again,
        server_words(result.stop_reason),
    )  # fmt: skip
    if result.stop_reason.endswith(JOB_FAILED):  # the server exits 1 too; see its log
        raise PSError(
            "the server stopped the job: "
            f"{server_words(result.stop_reason.removesuffix(JOB_FAILED))}; start "
            "this worker again when the server is back"
        )
    if result.by_signal and received:
        # Its share of the job is not done: exit as a process killed by that signal would,
        # so that a supervisor (a Kubernetes Job after an eviction) starts it again instead of
        # counting it complete. Only a STOP from the server ends a worker with 0.
        raise SystemExit(128 + received[0])


def main() -> None:
    command(auto_envvar_prefix=ENV_PREFIX)


if __name__ == "__main__":
    main()
