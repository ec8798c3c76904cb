"""`ps-worker`: join a ps-server, compute gradients on one device until told to stop."""

import logging
import signal
import socket
from collections.abc import Mapping
from types import FrameType
from typing import Any

import click
import torch

from common.cli import ENV_PREFIX, EnvAwareCommand, explain_errors, signals_handled_by
from common.cpu_share import CpuShare
from common.data import DataSource
from common.device import resolve_device
from common.errors import DataError, PSError
from common.logs import counted, setup_logging
from common.memory import reuse_large_buffers
from common.metrics import prepare_log_dir
from common.options import WORKER_OPTIONS, options, spec_of, with_params
from common.roles import WorkerSpec
from common.security_options import client_security_from_options
from common.startup import freeze_imported_objects
from common.wire.protocol import JOB_FAILED
from psworker.connection import Connection, server_words
from psworker.trainer import Worker

log = logging.getLogger("ps.worker")


@click.command(
    cls=EnvAwareCommand, context_settings={"show_default": True, "max_content_width": 100}
)
@options(WORKER_OPTIONS)
@explain_errors
@with_params
def command(params: Mapping[str, Any]) -> None:
    """Train as one worker of a ps-server job. The server decides the model and the data."""
    setup_logging(params["log_level"], "worker")
    run(spec_of(WorkerSpec, params))


def run(spec: WorkerSpec) -> None:
    reuse_large_buffers()  # 45 MB messages: no page faults on every receive
    resolved = resolve_device(spec.gpu, spec.device)
    if resolved.type == "cuda":  # calls that name no device (streams, caches) mean this one
        torch.cuda.set_device(resolved)
    security = client_security_from_options(spec.curve_secret_key, spec.curve_server_key)
    cpu_share = CpuShare(spec.threads)
    # The dataset name comes from the server; only the location is this host's choice.
    data_dir = spec.data_dir
    try:
        source = DataSource("fashion-mnist" if data_dir else "embedded", data_dir, spec.download)
    except DataError as exc:
        raise PSError(str(exc)) from None
    if spec.log_dir is not None:
        prepare_log_dir(spec.log_dir)
    label = spec.name or f"{socket.gethostname()}:{resolved}"
    connection = Connection.open(
        spec.server, spec.timeout, spec.retries, security, join_timeout_s=spec.join_timeout
    )
    worker = Worker(
        connection, resolved, source, label, spec.progress, spec.step_delay, spec.log_dir,
        spec.overlap, cpu_share,
    )  # fmt: skip

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
    freeze_imported_objects()
    command(auto_envvar_prefix=ENV_PREFIX)


if __name__ == "__main__":
    main()
