"""Every command explains a bad option or a bad state in one line, with a non-zero exit code
and no traceback."""

import contextlib
import importlib
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from common.cli import ENV_PREFIX
from tests.harness import Cluster, all_exit, kill, make_fashion_mnist, wait_for_log


def run(module: str, *args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
    )


def refused(module: str, *args: str) -> subprocess.CompletedProcess:
    """`python -m module ARGS` for an option click refuses before the command runs (exit 2),
    in this process: the same command through click, as the module's main() calls it. That a
    real process says it in one line, with no traceback, is checked once for every command
    (test_a_refused_option_is_one_line_from_a_real_process); every option's own check here."""
    command = importlib.import_module(module).command
    result = CliRunner().invoke(command, list(args), auto_envvar_prefix=ENV_PREFIX)
    stderr = result.stderr
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        stderr += "".join(traceback.format_exception(result.exception))  # what Python prints
    return subprocess.CompletedProcess([module, *args], result.exit_code, result.stdout, stderr)


def assert_clean_error(result: subprocess.CompletedProcess, code: int, *phrases: str) -> None:
    assert result.returncode == code, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(error_lines) == 1, result.stderr
    for phrase in phrases:
        assert phrase.lower() in error_lines[0].lower(), error_lines[0]


@pytest.mark.integration
@pytest.mark.parametrize(
    ("module", "args", "phrase"),
    [
        ("psserver.cli.server", ["--workers", "0"], "--workers"),
        ("psworker.cli", ["--timeout", "nan"], "is not a finite number"),
        ("psserver.cli.local", ["--lr", "inf"], "is not a finite number"),
        ("psserver.bench.cli", ["train", "--bucket-mb", "1e-9"], "less than one float32 value"),
        ("psserver.cli.status", ["--timeout", "3000000"], "is not in the range 0<x<=1000000"),
    ],
)
def test_a_refused_option_is_one_line_from_a_real_process(
    tmp_path: Path, module: str, args: list[str], phrase: str
) -> None:
    assert_clean_error(run(module, *args, cwd=tmp_path), 2, phrase)


@pytest.mark.integration
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
def test_gpu_without_cuda_says_to_use_cpu(tmp_path: Path) -> None:
    result = run("psworker.cli", "--gpu", "0", cwd=tmp_path)
    assert_clean_error(result, 1, "--gpu 0", "no CUDA", "--device cpu")


@pytest.mark.integration
def test_bad_device_strings(tmp_path: Path) -> None:
    assert_clean_error(run("psworker.cli", "--device", "tpu:0", cwd=tmp_path), 2, "tpu:0")
    result = run("psworker.cli", "--gpu", "0", "--device", "cpu", cwd=tmp_path)
    assert_clean_error(result, 1, "not both")


@pytest.mark.parametrize(
    ("args", "phrase"),
    [
        (["--workers", "0"], "--workers"),
        (["--mode", "sideways"], "--mode"),
        (["--model", "vgg"], "--model"),
        (["--lr", "-1"], "--lr"),
        (["--momentum", "1.5"], "--momentum"),
    ],
)
def test_bad_server_options_exit_2(args: list[str], phrase: str) -> None:
    assert_clean_error(refused("psserver.cli.server", *args), 2, phrase)


@pytest.mark.parametrize(
    ("module", "args"),
    [
        ("psserver.cli.server", ["--bucket-mb", "nan"]),
        ("psserver.cli.server", ["--bucket-mb", "inf"]),
        ("psserver.cli.server", ["--lr", "nan"]),
        ("psserver.cli.server", ["--momentum", "nan"]),
        ("psworker.cli", ["--timeout", "nan"]),
        ("psserver.cli.local", ["--lr", "inf"]),
    ],
)
def test_numbers_that_are_not_finite_are_refused(module: str, args: list[str]) -> None:
    """nan passes every range check: --bucket-mb nan and a worker's --timeout nan used to end
    in a traceback."""
    result = refused(module, *args)
    assert_clean_error(result, 2, args[0], "is not a finite number")


@pytest.mark.parametrize(
    ("module", "args"),
    [
        ("psserver.cli.server", ["--bucket-mb", "1e-9"]),
        ("psserver.cli.local", ["--bucket-mb", "0.000003"]),
        ("psserver.bench.cli", ["train", "--bucket-mb", "1e-9"]),
        ("psserver.bench.cli", ["comm", "--bucket-mb", "1e-9"]),
    ],
)
def test_a_bucket_smaller_than_one_value_is_refused(module: str, args: list[str]) -> None:
    """A positive --bucket-mb under 4 bytes rounded to 0 values, which means one bucket: the
    job ran with the opposite of what was asked, without a word."""
    result = refused(module, *args)
    assert_clean_error(result, 2, "--bucket-mb", "less than one float32 value", "3.82e-06")


def test_the_smallest_bucket_holds_one_value() -> None:
    from common.errors import ConfigError
    from common.sharding import SMALLEST_BUCKET_MB, bucket_numel_of
    from psserver.config import ServerConfig

    assert bucket_numel_of(SMALLEST_BUCKET_MB) == 1
    assert ServerConfig(bucket_mb=SMALLEST_BUCKET_MB).bucket_numel == 1
    assert ServerConfig(bucket_mb=0).bucket_numel == 0
    with pytest.raises(ConfigError, match="less than one float32 value"):
        ServerConfig(bucket_mb=1e-9)


@pytest.mark.parametrize(
    ("module", "flag"),
    [
        ("psserver.cli.status", "--timeout"),
        ("psworker.cli", "--timeout"),
        ("psserver.cli.server", "--worker-timeout"),
    ],
)
def test_a_timeout_too_long_for_zeromq_is_refused(module: str, flag: str) -> None:
    """ZeroMQ takes int32 milliseconds: 3,000,000 s overflowed with a traceback."""
    result = refused(module, flag, "3000000")
    assert_clean_error(result, 2, flag, "is not in the range 0<x<=1000000")


@pytest.mark.parametrize(
    ("module", "args", "reason"),
    [
        (
            "psserver.cli.server",
            ["--compress", "zip"],
            "'--compress': choose none, fp16, bf16 or topk",
        ),
        (
            "psserver.cli.server",
            ["--compress", "topk:2"],
            "'--compress': the ratio must be in (0, 1]",
        ),
        ("psworker.cli", ["--device", "gpu"], "'--device': 'gpu' is not a device"),
        ("psworker.cli", ["--device", "mps"], "'--device': only cpu and cuda:n are supported"),
    ],
)
def test_an_option_value_of_the_wrong_form_exits_2(
    module: str, args: list[str], reason: str
) -> None:
    """As click's own types do (the README's rule): checked before anything starts."""
    assert_clean_error(refused(module, *args), 2, reason)


def test_the_server_config_refuses_numbers_that_are_not_finite() -> None:
    from common.errors import ConfigError
    from psserver.config import ServerConfig

    with pytest.raises(ConfigError, match="--step-timeout must be a finite number, got nan"):
        ServerConfig(model="lenet", step_timeout=float("nan"))


@pytest.mark.integration
def test_an_eval_device_or_summary_path_that_cannot_work_is_refused_at_start(
    tmp_path: Path,
) -> None:
    """Both used to fail only at the end: the first evaluation, or after the whole run."""
    bad_device = run("psserver.cli.server", "--eval-device", "foo", cwd=tmp_path)
    assert_clean_error(bad_device, 2, "'--eval-device': 'foo' is not a device")
    if not torch.cuda.is_available():
        no_gpu = run("psserver.cli.server", "--eval-device", "cuda", cwd=tmp_path)
        assert_clean_error(no_gpu, 1, "--eval-device cuda needs CUDA", "use --eval-device cpu")
    (tmp_path / "afile").write_text("")
    summary = run(
        "psserver.cli.server", "--summary", str(tmp_path / "afile" / "s.json"), cwd=tmp_path
    )
    assert_clean_error(summary, 1, "cannot write a file there")


def test_followers_started_by_the_leader_get_its_leader_timeout_and_secret_on_stdin(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from psserver.config import ServerConfig
    from psserver.shards import launch

    class Pipe(io.BytesIO):
        def close(self) -> None:  # kept open, so that the test can read what was written
            self.closed_by_leader = True

    class FakeFollower:
        def __init__(self, argv: list[str], **options: object) -> None:
            assert options["stdin"] is subprocess.PIPE
            self.argv, self.stdin = argv, Pipe()
            started.append(self)

    started: list[FakeFollower] = []
    monkeypatch.setattr(launch.subprocess, "Popen", FakeFollower)
    leader = ServerConfig(model="lenet", bind="tcp://127.0.0.1:*", num_shards=3)
    followers = launch.follower_configs(leader, "tcp://127.0.0.1:5555", None, 7.5)
    launch.start_followers(followers, launch.FollowerLaunch("info"), b"the job's secret")
    assert len(started) == 2
    assert all(f.argv[f.argv.index("--leader-timeout") + 1] == "7.5" for f in started)
    # The secret goes down a pipe, never on the command line (argv shows in `ps`) nor into
    # a file (a killed leader would leave it behind).
    assert all(f.argv[f.argv.index("--shard-secret-file") + 1] == "-" for f in started)
    assert all(f.stdin.getvalue() == b"the job's secret\n" for f in started)
    assert all(f.stdin.closed_by_leader for f in started)
    assert not any(b"the job's secret" in arg.encode() for f in started for arg in f.argv)


def test_a_read_only_checkpoint_dir_is_called_read_only_not_no_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--checkpoint-dir on a read-only mount said `it is not a folder`. (os.access stands in
    for the mount: root may write to any folder that chmod made read-only.)"""
    from common.errors import ConfigError
    from psserver import config

    folder, file = tmp_path / "mounted", tmp_path / "a-file"
    folder.mkdir()
    file.write_text("x")
    monkeypatch.setattr(config.os, "access", lambda path, mode: Path(path) != folder)
    with pytest.raises(ConfigError) as read_only:
        config.check_writable_folder(folder, "--checkpoint-dir")
    assert str(read_only.value) == (
        f"--checkpoint-dir {folder}: cannot write checkpoints there (it is not writable)"
    )
    with pytest.raises(ConfigError, match=r"there \(it is not a folder\)$"):
        config.check_writable_folder(file, "--checkpoint-dir")
    with pytest.raises(ConfigError, match=r"there \(.*mounted is not a writable folder\)$"):
        config.check_writable_folder(folder / "runs" / "a", "--checkpoint-dir")


@pytest.mark.integration
def test_bad_state_errors(tmp_path: Path) -> None:
    assert_clean_error(
        run("psserver.cli.server", "--resume", cwd=tmp_path), 1, "--resume needs --checkpoint-dir"
    )
    assert_clean_error(  # it used to be ignored: no checkpoint was ever written
        run("psserver.cli.server", "--checkpoint-every", "50", cwd=tmp_path),
        1,
        "--checkpoint-every 50 needs --checkpoint-dir",
    )
    # Checked at start-up, not when the first checkpoint is due after hours of training.
    (tmp_path / "a-file").write_text("x")
    assert_clean_error(
        run(
            "psserver.cli.server",
            "--checkpoint-dir",
            str(tmp_path / "a-file" / "ckpt"),
            cwd=tmp_path,
        ),
        1,
        "cannot write checkpoints there",
    )
    # An earlier run's checkpoints are never overwritten by a run that forgot --resume.
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / "previous.pt").write_bytes(b"an earlier run")
    assert_clean_error(
        run("psserver.cli.server", "--checkpoint-dir", str(earlier), cwd=tmp_path),
        1,
        "already holds previous.pt of an earlier run: add --resume",
    )
    assert (earlier / "previous.pt").read_bytes() == b"an earlier run"
    assert_clean_error(
        run("psserver.cli.server", "--dataset", "fashion-mnist", cwd=tmp_path), 1, "--data-dir"
    )
    missing = tmp_path / "nowhere"
    result = run(
        "psserver.cli.server",
        "--dataset",
        "fashion-mnist",
        "--data-dir",
        str(missing),
        cwd=tmp_path,
    )
    assert_clean_error(result, 1, "does not exist", "--download")
    empty = tmp_path / "empty"
    empty.mkdir()
    result = run(
        "psserver.cli.server", "--dataset", "fashion-mnist", "--data-dir", str(empty), cwd=tmp_path
    )
    assert_clean_error(result, 1, "train-images-idx3-ubyte is missing", "--download")


@pytest.mark.integration
def test_missing_and_corrupt_checkpoints(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    args = ["--model", "lenet", "--checkpoint-dir", str(ckpt), "--resume"]
    assert_clean_error(run("psserver.cli.server", *args, cwd=tmp_path), 1, "no checkpoint")
    ckpt.mkdir()
    (ckpt / "latest.pt").write_bytes(b"PK\x03\x04 this is not a checkpoint")
    assert_clean_error(run("psserver.cli.server", *args, cwd=tmp_path), 1, "corrupt")


@pytest.mark.integration
def test_port_in_use(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run(
            "psserver.cli.server",
            "--model",
            "lenet",
            "--bind",
            f"tcp://127.0.0.1:{port}",
            cwd=tmp_path,
        )
    assert_clean_error(result, 1, "cannot bind", "free port")


@pytest.mark.integration
def test_worker_without_a_server_times_out_clearly(tmp_path: Path) -> None:
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    result = run(
        "psworker.cli",
        "--server",
        f"tcp://127.0.0.1:{port}",
        "--device",
        "cpu",
        "--timeout",
        "1",
        "--join-timeout",
        "2",  # a first registration's wait: not --retries, whose default 5 back off for 15 s
        cwd=tmp_path,
    )
    assert_clean_error(result, 1, "nothing answered", "in 2 s", "ps-server", "--join-timeout")


def test_worker_whose_data_differs_from_the_servers_is_refused(cluster: Cluster) -> None:
    server_data, worker_data = cluster.workdir / "server-data", cluster.workdir / "worker-data"
    make_fashion_mnist(server_data, n_train=40)
    make_fashion_mnist(worker_data, n_train=50)
    server, endpoint = cluster.start_server(
        "--model",
        "lenet",
        "--workers",
        "1",
        "--dataset",
        "fashion-mnist",
        "--data-dir",
        str(server_data),
        "--batch-size",
        "8",
    )
    mismatched = cluster.start_worker(endpoint, "--data-dir", str(worker_data), name="wrong")
    cluster.wait(mismatched, timeout=60, expect_code=1)
    assert "training set has 50 images, the server's 40" in mismatched.stderr()
    assert "Traceback" not in mismatched.stderr()
    without = cluster.start_worker(endpoint, name="no-data-dir")
    cluster.wait(without, timeout=60, expect_code=1)
    assert "--data-dir" in without.stderr() and "Traceback" not in without.stderr()
    server.process.kill()


def test_resume_on_a_training_set_of_another_size_is_refused(cluster: Cluster) -> None:
    """Same --dataset and --train-limit, another folder: the checkpoint's data position is a
    place in a permutation of 40 images, which means nothing among 50."""
    small, large = cluster.workdir / "small", cluster.workdir / "large"
    make_fashion_mnist(small, n_train=40)
    make_fashion_mnist(large, n_train=50)
    ckpt = cluster.workdir / "ckpt"
    job = ["--model", "lenet", "--workers", "1", "--dataset", "fashion-mnist", "--batch-size",
           "8", "--checkpoint-dir", str(ckpt)]  # fmt: skip
    _, endpoint = cluster.start_server(*job, "--data-dir", str(small), "--max-steps", "2")
    cluster.start_worker(endpoint, "--data-dir", str(small))
    cluster.wait_all(timeout=120)
    assert torch.load(ckpt / "latest.pt", weights_only=True)["train_size"] == 40

    result = run(
        "psserver.cli.server", *job, "--data-dir", str(large), "--resume", cwd=cluster.workdir
    )
    assert_clean_error(
        result, 1, "the checkpoint's run trained on 40 images, this run's training set has 50"
    )
    _, endpoint = cluster.start_server(
        *job, "--data-dir", str(small), "--resume", "--max-steps", "4", name="same"
    )
    cluster.start_worker(endpoint, "--data-dir", str(small), name="worker-again")
    cluster.wait_all(timeout=120)
    assert torch.load(ckpt / "latest.pt", weights_only=True)["step"] == 4


@pytest.mark.integration
def test_a_data_dir_without_the_fashion_mnist_data_set_is_refused(tmp_path: Path) -> None:
    """It used to be ignored: the job trained on the embedded set without a word."""
    result = run(
        "psserver.cli.server", "--model", "lenet", "--data-dir", str(tmp_path), cwd=tmp_path
    )
    assert_clean_error(result, 1, "--data-dir is read only with --dataset fashion-mnist")
    result = run("psserver.cli.server", "--model", "lenet", "--download", cwd=tmp_path)
    assert_clean_error(result, 1, "--download is read only with --dataset fashion-mnist")


def run_local_in(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """ps-local with the temporary folder in tmp_path."""
    return subprocess.run(
        [sys.executable, "-m", "psserver.cli.local", "--model", "lenet", "--threads", "1", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )


@pytest.mark.integration
def test_ps_local_keeps_the_summary_its_server_names(tmp_path: Path) -> None:
    """Without --summary it used to be written into a folder deleted at the end, after the
    server's log had named it."""
    result = run_local_in(
        tmp_path, "--workers", "1", "--max-steps", "2", "--train-limit", "128",
        "--batch-size", "32", "--staleness", "3",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    # ps-local hands the server only the options given to it, so the server can tell them:
    # --staleness, given, is said to do nothing outside ssp; nothing else is warned about.
    warnings = [line for line in result.stderr.splitlines() if " WARNING " in line]
    assert len(warnings) == 1, warnings
    assert "--staleness bounds how far ahead a worker may run in --mode ssp only" in warnings[0]
    named = re.findall(r"summary written to (\S+)", result.stderr + result.stdout)
    assert len(named) == 1, result.stderr[-3000:]
    summary = json.loads(Path(named[0]).read_text())
    assert Path(named[0]).parent.parent == tmp_path and summary["global_steps"] == 2
    assert "[worker local-0]" in result.stderr + result.stdout
    assert " sync steps with 1 worker, lenet, " in result.stdout.splitlines()[-1]  # not workers


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--mode", "sync", "--no-staleness-lr"], ["--no-staleness-lr scales a stale"]),
        (
            ["--mode", "async", "--step-timeout", "5", "--no-stream-weights", "--min-workers",
             "1", "--staleness-lr"],
            ["--step-timeout closes a --mode sync step", "--no-stream-weights streams the"],
        ),
        (["--mode", "ssp", "--stream-weights", "--staleness", "1"], ["--stream-weights streams"]),
        (["--mode", "sync"], []),
        (["--mode", "async"], []),
        (["--mode", "ssp"], []),
    ],
)  # fmt: skip
def test_an_option_this_mode_does_not_read_is_warned_of_when_given(
    cluster: Cluster, args: list[str], expected: list[str]
) -> None:
    """--no-staleness-lr in sync mode, --step-timeout and --no-stream-weights in async and
    ssp were accepted and ignored without a word; only --staleness outside ssp warned. Each
    now warns when the person gave it, and the defaults say nothing."""
    server, _ = cluster.start_server("--model", "lenet", "--train-limit", "64", *args)
    wait_for_log(server, "listening on", timeout=60)
    kill(server)
    server.process.wait(timeout=10)
    mode = args[1]
    warnings = [line for line in server.stderr().splitlines() if " WARNING " in line]
    assert len(warnings) == len(expected), warnings
    for line, phrase in zip(warnings, expected, strict=True):
        assert phrase in line and line.endswith(f"this {mode} job ignores it"), line


@pytest.mark.integration
def test_ps_local_reports_the_failed_child_and_leaves_no_empty_summary(tmp_path: Path) -> None:
    result = run_local_in(tmp_path, "--dataset", "fashion-mnist", "--data-dir", "nowhere")
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    # The server's own error, relayed once, then ps-local's one line, which points to it:
    # the cause used to be said twice.
    lines = result.stderr.strip().splitlines()
    assert (
        lines[-1] == "Error: the server failed to start: it exited with code 1; see its error above"
    )
    assert lines[-2].startswith("[server] Error: ") and "does not exist" in lines[-2], lines[-2]
    assert result.stderr.count("does not exist") == 1, result.stderr
    assert "its last stderr" not in result.stderr
    assert not list(tmp_path.glob("ps-local-*")), "no summary came of the run"


@pytest.mark.integration
def test_checkpoint_that_does_not_fit_the_model(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    config = {
        "model": "lenet",
        "mode": "sync",
        "batch_size": 128,
        "dataset": "embedded",
        "train_limit": None,
        "seed": 0,
    }
    torch.save(
        {
            "format": "ps-checkpoint/2",
            "model": {"0.weight": torch.zeros(1)},
            "optimizer": {},
            "step": 1,
            "position": {"epoch": 0, "batch": 1, "cursors": []},
            "rng": torch.get_rng_state(),
            "config": config,
        },
        ckpt / "latest.pt",
    )
    result = run(
        "psserver.cli.server",
        "--model",
        "lenet",
        "--checkpoint-dir",
        str(ckpt),
        "--resume",
        cwd=tmp_path,
    )
    assert_clean_error(result, 1, "does not fit this model", "without --resume")


@pytest.mark.integration
@pytest.mark.timeout(120)
@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads children from /proc")
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_ps_local_stops_its_cluster_when_it_is_killed(tmp_path: Path, signum: int) -> None:
    """kill, or a closed terminal: the server and workers (in sessions of their own) must
    stop with ps-local. They used to train on under PID 1."""
    local = subprocess.Popen(
        [sys.executable, "-m", "psserver.cli.local", "--model", "lenet", "--workers", "2",
         "--epochs", "100", "--train-limit", "256", "--test-limit", "50", "--threads", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=tmp_path, text=True,
    )  # fmt: skip
    children: list[int] = []
    try:
        assert local.stdout is not None
        for line in local.stdout:  # the server says so once both workers are in
            if "training starts" in line:
                break
        children_file = Path(f"/proc/{local.pid}/task/{local.pid}/children")
        children = [int(pid) for pid in children_file.read_text().split()]
        assert len(children) == 3, children
        local.send_signal(signum)
        local.communicate(timeout=30)
        assert local.returncode == 128 + signum
        assert all_exit(children, timeout=10)
    finally:
        local.kill()
        local.wait()
        for pid in children:  # what a failed run left behind
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)


@pytest.mark.integration
def test_a_worker_checks_its_log_dir_before_it_joins(tmp_path: Path) -> None:
    """It used to register, then quit without telling the server, which kept the slot until
    the worker was declared dead. Now it stops before it tries to reach the server at all
    (port 1 has no server: reaching for it would take retries and end in another error)."""
    (tmp_path / "afile").write_text("")
    result = run(
        "psworker.cli", "--server", "tcp://127.0.0.1:1", "--device", "cpu",
        "--log-dir", str(tmp_path / "afile" / "logs"), cwd=tmp_path, timeout=30,
    )  # fmt: skip
    assert_clean_error(result, 1, "cannot write metrics to", "give --log-dir a writable folder")


def test_an_endpoint_file_is_written_whole_into_folders_made_for_it(tmp_path: Path) -> None:
    """It used to end the server in a traceback (FileNotFoundError) where --summary made
    the folders; and a reader polling the file could see it half written."""
    from common.errors import ConfigError, PSError
    from common.wire.endpoint_file import write_endpoint_file
    from psserver.config import ServerConfig

    path = tmp_path / "new" / "folders" / "server.ep"
    write_endpoint_file(path, "tcp://127.0.0.1:5555")
    assert path.read_text() == "tcp://127.0.0.1:5555\n"
    assert [p.name for p in path.parent.iterdir()] == ["server.ep"]  # no temporary left
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(PSError, match=r"--endpoint-file .*a-file/ep: cannot write it \("):
        write_endpoint_file(tmp_path / "a-file" / "ep", "tcp://127.0.0.1:5555")
    with pytest.raises(ConfigError, match=r"--endpoint-file .*: cannot write a file there"):
        ServerConfig(endpoint_file=tmp_path / "a-file" / "ep")  # refused at start-up


def test_help_writes_the_device_and_compression_choices_as_they_are_typed() -> None:
    """Click wrote them in capitals (`--device CPU|CUDA[:N]`), which the options refuse."""
    from click.testing import CliRunner

    from psserver.cli.server import command as server
    from psworker.cli import command as worker

    for command in (server, worker):
        text = CliRunner().invoke(command, ["--help"]).output
        assert "cpu|cuda[:N]" in text and "CPU|CUDA" not in text, text
    assert "--compress none|fp16|bf16|topk:RATIO" in CliRunner().invoke(server, ["--help"]).output


def test_a_shard_without_num_shards_is_told_to_give_it() -> None:
    """It said only "shards are numbered 0..0"."""
    from click.testing import CliRunner

    from psserver.cli.server import command

    result = CliRunner().invoke(command, ["--shard", "1", "--leader", "tcp://127.0.0.1:1"])
    assert result.exit_code == 1
    assert result.output.strip().splitlines()[-1] == (
        "Error: --shard 1 needs --num-shards K, the job's number of shards (more than 1), on "
        "every shard"
    )


def test_a_bad_value_from_a_ps_variable_names_the_variable() -> None:
    """It was reported under the option's name, which someone who set PS_WORKERS in a
    compose file or a manifest never typed."""
    from click.testing import CliRunner

    from common.cli import ENV_PREFIX
    from psserver.bench.cli import command as bench
    from psserver.cli.server import command as server

    def error(command: Any, args: list[str], env: dict[str, str]) -> str:
        result = CliRunner().invoke(command, args, env=env, auto_envvar_prefix=ENV_PREFIX)
        assert result.exit_code == 2, result.output
        return result.output.strip().splitlines()[-1]

    assert error(server, [], {"PS_WORKERS": "abc"}) == (
        "Error: Invalid value for '--workers' (set by PS_WORKERS): 'abc' is not a valid "
        "integer range."
    )
    assert error(server, ["--workers", "abc"], {}) == (
        "Error: Invalid value for '--workers': 'abc' is not a valid integer range."
    )
    assert "(set by PS_COMM_ROUNDS)" in error(bench, ["comm"], {"PS_COMM_ROUNDS": "x"})


def test_every_ps_variable_is_the_flag_as_typed() -> None:
    """Click names an option's variable after its value's name in the code: ps-status --json
    (as_json) read PS_AS_JSON and ignored PS_JSON, and ps-bench's --json read
    PS_COMM_JSON_PATH."""
    from click.testing import CliRunner

    from common.cli import ENV_PREFIX
    from psserver.bench.cli import command as bench
    from psserver.cli.status import command as status

    def last_line(command: Any, args: list[str], env: dict[str, str]) -> str:
        result = CliRunner().invoke(command, args, env=env, auto_envvar_prefix=ENV_PREFIX)
        return result.output.strip().splitlines()[-1]

    refused = "Error: Invalid value for '--json' (set by PS_JSON): 'maybe' is not a valid boolean"
    assert last_line(status, [], {"PS_JSON": "maybe"}).startswith(refused)
    # The code's own name is no variable: this one is not read, so nothing is refused.
    unread = last_line(
        status, ["--server", "tcp://127.0.0.1:1", "--timeout", "0.2"], {"PS_AS_JSON": "maybe"}
    )
    assert unread.startswith("Error: no answer from tcp://127.0.0.1:1"), unread
    said = last_line(bench, ["comm"], {"PS_COMM_JSON": "/"})
    assert said.startswith("Error: Invalid value for '--json' (set by PS_COMM_JSON): "), said


def test_an_error_across_options_names_the_ps_variables_that_set_them() -> None:
    """ "--max-workers (1) must be at least --workers (2)" named only the options, which
    someone who set PS_MAX_WORKERS in a compose file never typed."""
    from click.testing import CliRunner

    from common.cli import ENV_PREFIX
    from psserver.cli.server import command as server

    def error(args: list[str], env: dict[str, str]) -> str:
        result = CliRunner().invoke(server, args, env=env, auto_envvar_prefix=ENV_PREFIX)
        assert result.exit_code == 1, result.output
        return result.output.strip().splitlines()[-1]

    assert error(["--workers", "2"], {"PS_MAX_WORKERS": "1"}) == (
        "Error: --max-workers (1) must be at least --workers (2) (--max-workers was set by "
        "PS_MAX_WORKERS)"
    )
    assert error([], {"PS_MAX_WORKERS": "1", "PS_WORKERS": "2"}).endswith(
        "(--max-workers was set by PS_MAX_WORKERS; --workers was set by PS_WORKERS)"
    )
    assert error(["--max-workers", "1", "--workers", "2"], {}) == (
        "Error: --max-workers (1) must be at least --workers (2)"
    )


@pytest.mark.integration
@pytest.mark.parametrize(
    ("module", "args", "error"),
    [
        (
            "psserver.cli.server",
            ["--bind", "tcp://127.0.0.1:99999"],
            "--bind tcp://127.0.0.1:99999",
        ),
        ("psserver.cli.server", ["--bind", "tcp://127.0.0.1:-1"], "--bind tcp://127.0.0.1:-1"),
        ("psworker.cli", ["--server", "tcp://127.0.0.1:70000"], "--server tcp://127.0.0.1:70000"),
    ],
)
def test_a_port_out_of_range_is_refused_not_wrapped(
    tmp_path: Path, module: str, args: list[str], error: str
) -> None:
    """ZeroMQ took the port modulo 65536: --bind tcp://127.0.0.1:99999 listened on 34463."""
    result = run(module, *args, cwd=tmp_path)
    assert_clean_error(result, 1, f"{error}: the port must be 1 to 65535")
    assert ("or * for a free one" in result.stderr) == (module == "psserver.cli.server"), (
        result.stderr
    )


def test_every_endpoint_option_checks_its_port() -> None:
    from click.testing import CliRunner

    from common.errors import ConfigError
    from common.wire.endpoints import port_problem
    from psserver.cli.status import command as status
    from psserver.config import ServerConfig
    from psserver.shards.joining import FollowerConfig

    result = CliRunner().invoke(status, ["--server", "tcp://127.0.0.1:0"])
    assert result.exit_code == 1, result.output
    assert result.output.strip() == "Error: --server tcp://127.0.0.1:0: the port must be 1 to 65535"
    with pytest.raises(ConfigError, match=r"^--leader tcp://ps-0:65536: the port must be 1 to"):
        FollowerConfig(1, 2, "tcp://ps-0:65536")
    with pytest.raises(ConfigError, match=r"^--bind tcp://0.0.0.0:5x: the port must be 1 to"):
        FollowerConfig(1, 2, "tcp://ps-0:5555", bind="tcp://0.0.0.0:5x")
    with pytest.raises(ConfigError, match=r"^--bind tcp://127.0.0.1: it names no port"):
        ServerConfig(model="lenet", bind="tcp://127.0.0.1")
    for fine in ("tcp://127.0.0.1:*", "tcp://[::1]:5555", "tcp://eth0:1", "ipc:///tmp/ps"):
        assert port_problem(fine, bind=True) is None, fine
    assert port_problem("inproc://server", bind=False) is None
    assert port_problem("tcp://127.0.0.1:*", bind=False) == "the port must be 1 to 65535"
    assert port_problem("tcp://127.0.0.1:\u0665", bind=False) is not None  # an Arabic-Indic 5


@pytest.mark.parametrize(
    "module",
    [
        "psserver.cli.server", "psserver.cli.local", "psserver.cli.status", "psserver.cli.keys",
        "psserver.cli.plot", "psworker.cli", "psserver.bench.cli", "psserver.bench.synthetic",
        "psserver.bench.ddp", "psserver.bench.floor",
    ],
)  # fmt: skip
def test_every_command_leaves_its_imports_out_of_garbage_collection(
    module: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each command's main() freezes what its imports made before it runs the command
    (common.startup.freeze_imported_objects): one full collection of torch's objects cost
    0.2 s of CPU, and a process made more than one as it exited."""
    import gc

    calls: list[str] = []
    commands = importlib.import_module(module)
    monkeypatch.setattr(gc, "freeze", lambda: calls.append("freeze"))
    monkeypatch.setattr(commands, "command", lambda *args, **kwargs: calls.append("command"))
    commands.main()
    assert calls == ["freeze", "command"]
