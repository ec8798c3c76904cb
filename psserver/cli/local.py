"""`ps-local`: one server and N workers on this machine, in one command.

It starts `ps-server` on a free localhost port and then the workers, one GPU each when there
are enough GPUs and on the CPU otherwise. Each child's output is shown line by line with its
role as a prefix. When a child fails, the others are stopped and the failure is reported with
how the child ended, after its own error (or the tail of its stderr). The children get their
options on their command lines only, none of this command's PS_ variables. The run ends with
one line: the test accuracy.

What it is not: the children's supervisor. Starting a child, relaying its output, stopping it and
watching for the first failure are psserver.cli.children's, the choice of devices
psserver.cli.devices', and the command lines common.roles'; this module says what each child
is told and reads the server's summary.
"""

import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import click

from common.cli import (
    ENV_PREFIX,
    EnvAwareCommand,
    chosen_options,
    explain_errors,
    unwinding_on_termination,
    without_option_variables,
)
from common.cpu_share import share_of, usable_cores
from common.errors import PSError, first_line
from common.logs import counted
from common.options import JOB_OPTIONS, LOCAL_OPTIONS, options, with_params
from common.roles import SERVER, WORKER, WorkerSpec, command_args
from common.startup import freeze_imported_objects
from psserver.cli.children import Child, stop_all, supervise
from psserver.cli.devices import worker_devices

STARTUP_TIMEOUT_S = 120.0


def kept_summary_path() -> Path:
    """Where the summary goes without --summary: summary.json in a folder of its own in the
    temporary folder, which outlives the run, since the server's log names it. The file
    itself is left for the server to create: an empty one would look like a broken summary."""
    return Path(tempfile.mkdtemp(prefix="ps-local-")) / "summary.json"


def wait_for_endpoint(server: Child, endpoint_file: Path) -> str:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if endpoint_file.exists() and endpoint_file.read_text().strip():
            return endpoint_file.read_text().strip()
        if server.process.poll() is not None:
            server.finish_output()
            raise PSError(f"the server failed to start: {server.failure('it')}")
        time.sleep(0.1)
    raise PSError(f"the server did not start listening within {STARTUP_TIMEOUT_S:.0f} s")


def run_cluster(
    server: Mapping[str, Any], workers: Sequence[WorkerSpec], summary_path: Path
) -> dict[str, Any]:
    """Start the server and the workers, see them to the end; the server's summary (at
    `summary_path`). `server`: the options the server is given (those the person gave
    ps-local, so that it can tell which ones the person chose, and ps-local's own); each
    worker dials the server once it listens."""
    # Their options are all on their command lines. A PS_ variable of the person's is one of
    # ps-local's own options, already there, or one of a child's that ps-local does not have:
    # PS_STEP_DELAY made every worker a straggler, PS_SHARD broke the server with an error
    # about an option nobody had typed.
    env = {**without_option_variables(os.environ), "PYTHONUNBUFFERED": "1"}
    with tempfile.TemporaryDirectory(prefix="ps-local-") as scratch:
        endpoint_file = Path(scratch) / "endpoint"
        listening = {"bind": "tcp://127.0.0.1:*", "endpoint_file": endpoint_file}
        argv = [sys.executable, "-m", SERVER.module, *command_args(SERVER, listening, server)]
        children = [Child("server", argv, env)]
        try:
            endpoint = wait_for_endpoint(children[0], endpoint_file)
            for rank, worker in enumerate(workers):
                args = command_args(WORKER, dataclasses.replace(worker, server=endpoint))
                argv = [sys.executable, "-m", WORKER.module, *args]
                children.append(Child(f"worker local-{rank}", argv, env))
            supervise(children)
        finally:
            stop_all(children)
        return read_summary(summary_path)


def read_summary(path: Path) -> dict[str, Any]:
    """The summary the server wrote; PSError when it did not (the cluster ended well)."""
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise PSError(
            f"the job ended, but its server left no summary in {path} ({first_line(exc)}); "
            "its log above says how the job went"
        ) from None
    if not isinstance(summary, dict):
        raise PSError(f"the job ended, but {path} holds no run summary")
    return summary


@click.command(
    cls=EnvAwareCommand, context_settings={"show_default": True, "max_content_width": 100}
)
@options(LOCAL_OPTIONS)
@explain_errors
@with_params
def command(params: Mapping[str, Any]) -> None:
    """Train with one ps-server and --workers ps-workers on this machine."""
    count, log_level = params["workers"], params["log_level"]
    devices = worker_devices(count, params["device"])
    # Every child is told, so that none counts the others as they start (common.cpu_share).
    threads = params["threads"] or share_of(usable_cores(), count + params["num_shards"])
    summary = params["summary"]
    summary_path = summary or kept_summary_path()
    given = chosen_options(click.get_current_context(), [option.dest for option in JOB_OPTIONS])
    server = {
        **{name: params[name] for name in given},
        "summary": summary_path, "threads": threads, "log_level": log_level,
    }  # fmt: skip
    workers = [
        WorkerSpec(
            device=device,
            threads=threads,
            progress="log",
            log_level=log_level,
            name=f"local-{rank}:{device}",
            data_dir=params["data_dir"],
            log_dir=params["log_dir"],
        )
        for rank, device in enumerate(devices)
    ]
    try:
        result = run_cluster(server, workers, summary_path)
    except BaseException:
        if summary is None:  # no summary came of it
            shutil.rmtree(summary_path.parent, ignore_errors=True)
        raise
    click.echo(
        f"test accuracy {result['test_accuracy']:.4f} (loss {result['test_loss']:.4f}) after "
        f"{counted(result['global_steps'], result['mode'] + ' step')} with "
        f"{counted(result['workers'], 'worker')}, "
        f"{result['model']}, {result['wall_seconds']:.1f} s, "
        f"{result['images_per_second']:.1f} img/s"
    )


def main() -> None:
    freeze_imported_objects()
    with unwinding_on_termination():  # kill or a closed terminal: stop the cluster, as Ctrl-C does
        command(auto_envvar_prefix=ENV_PREFIX)


if __name__ == "__main__":
    main()
