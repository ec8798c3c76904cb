"""`ps-local`: one server and N workers on this machine, in one command.

It starts `ps-server` on a free localhost port and then the workers, one GPU each when there
are enough GPUs and on the CPU otherwise. Each child's output is shown line by line with its
role as a prefix. When a child fails, the others are stopped and the failure is reported with
how the child ended, after its own error (or the tail of its stderr). The children get their
options on their command lines only, none of this command's PS_ variables. The run ends with
one line: the test accuracy.

What it is not: the children's supervisor. Starting a child, relaying its output, stopping it and
watching for the first failure are psserver.cli.children's, and the choice of devices is
psserver.cli.devices'; this module builds the command lines and reads the server's summary.
"""

import json
import os
import shutil
import sys
import tempfile
import time
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
from common.errors import PSError, first_line
from common.logs import LEVELS, counted
from psserver.cli.children import Child, stop_all, supervise
from psserver.cli.devices import worker_devices
from psserver.cli.options import training_options

STARTUP_TIMEOUT_S = 120.0


def kept_summary_path() -> Path:
    """Where the summary goes without --summary: summary.json in a folder of its own in the
    temporary folder, which outlives the run, since the server's log names it. The file
    itself is left for the server to create: an empty one would look like a broken summary."""
    return Path(tempfile.mkdtemp(prefix="ps-local-")) / "summary.json"


def server_argv(options: dict[str, Any], endpoint_file: Path, log_level: str) -> list[str]:
    argv = [
        sys.executable,
        "-m",
        "psserver.cli.server",
        "--bind",
        "tcp://127.0.0.1:*",
        "--endpoint-file",
        str(endpoint_file),
        "--log-level",
        log_level,
    ]
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else f"--no-{key.replace('_', '-')}")
        elif value is not None:
            argv += [flag, str(value)]
    return argv


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
    devices: list[str],
    threads: int,
    summary_path: Path,
    log_level: str,
    options: dict[str, Any],
    given: set[str],
) -> dict[str, Any]:
    """Start the server and the workers, see them to the end; the server's summary. The
    server gets the training options in `given` (the others it defaults as ps-local does),
    so that it can tell which ones the person chose."""
    # Their options are all on their command lines. A PS_ variable of the person's is one of
    # ps-local's own options, already there, or one of a child's that ps-local does not have:
    # PS_STEP_DELAY made every worker a straggler, PS_SHARD broke the server with an error
    # about an option nobody had typed.
    env = {**without_option_variables(os.environ), "PYTHONUNBUFFERED": "1"}
    with tempfile.TemporaryDirectory(prefix="ps-local-") as scratch:
        endpoint_file = Path(scratch) / "endpoint"
        server = Child(
            "server",
            server_argv(
                {
                    **{name: options[name] for name in given},
                    "summary": summary_path,
                    "threads": threads,
                },
                endpoint_file,
                log_level,
            ),
            env,
        )
        children = [server]
        try:
            endpoint = wait_for_endpoint(server, endpoint_file)
            for rank, worker_device in enumerate(devices):
                argv = [
                    sys.executable,
                    "-m",
                    "psworker.cli",
                    "--server",
                    endpoint,
                    "--device",
                    worker_device,
                    "--threads",
                    str(threads),
                    "--progress",
                    "log",
                    "--log-level",
                    log_level,
                    "--name",
                    f"local-{rank}:{worker_device}",
                ]
                if options["data_dir"] is not None:
                    argv += ["--data-dir", str(options["data_dir"])]
                if options["log_dir"] is not None:
                    argv += ["--log-dir", str(options["log_dir"])]
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
@training_options
@click.option(
    "--device",
    type=click.Choice(["auto", "cpu", "cuda"]),
    default="auto",
    help="auto: one GPU per worker if there are enough, else the CPU.",
)
@click.option(
    "--threads",
    type=click.IntRange(min=1),
    default=None,
    help="Torch threads per child (default: CPU cores / (workers + 1), at least 1).",
)
@click.option(
    "--summary",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write the server's JSON summary here (default: summary.json in a new ps-local-* "
    "folder in the temporary folder).",
)
@click.option("--log-level", type=click.Choice(LEVELS), default="info", help="Log verbosity.")
@explain_errors
def command(
    device: str, threads: int | None, summary: Path | None, log_level: str, **options: Any
) -> None:
    """Train with one ps-server and --workers ps-workers on this machine."""
    devices = worker_devices(options["workers"], device)
    threads = threads or max(1, (os.cpu_count() or 1) // (options["workers"] + 1))
    summary_path = summary or kept_summary_path()
    try:
        given = set(chosen_options(click.get_current_context(), options))
        result = run_cluster(devices, threads, summary_path, log_level, options, given)
    except BaseException:
        if summary is None:  # no summary came of it
            shutil.rmtree(summary_path.parent, ignore_errors=True)
        raise
    click.echo(
        f"test accuracy {result['test_accuracy']:.4f} (loss {result['test_loss']:.4f}) after "
        f"{result['global_steps']} {result['mode']} steps with "
        f"{counted(result['workers'], 'worker')}, "
        f"{result['model']}, {result['wall_seconds']:.1f} s, "
        f"{result['images_per_second']:.1f} img/s"
    )


def main() -> None:
    with unwinding_on_termination():  # kill or a closed terminal: stop the cluster, as Ctrl-C does
        command(auto_envvar_prefix=ENV_PREFIX)


if __name__ == "__main__":
    main()
