"""`ps-bench` for a new user: odd input gets one clear line and exit code 2 before anything
runs, an interrupt says where the logs are, and reports say when a number means nothing.

Most tests here start no benchmark; those that do start real processes, with timeouts.
"""

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from common.errors import PSError
from psserver.bench.buckets import gradient_buckets
from psserver.bench.cli import command
from psserver.bench.procs import ProcessGroup
from tests.harness import once_reaped, writes_its_pid

SOMEWHERE_ELSE = "no-such-host.invalid"  # RFC 2606: .invalid never resolves


def refused(*args: str, env: dict[str, str] | None = None) -> str:
    """The one line `ps-bench ARGS` ends with, checked to be a usage error before any run."""
    result: Result = CliRunner().invoke(command, list(args), env=env, auto_envvar_prefix="PS")
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and "[1/" not in result.output, result.output
    return result.output.strip().splitlines()[-1]


@pytest.mark.parametrize("subcommand", ["comm", "train", "straggler", "link"])
def test_json_and_plot_on_one_file_are_refused(tmp_path: Path, subcommand: str) -> None:
    """The plot overwrote the results (or the other way round), after every run."""
    same = tmp_path / "out.png"
    line = refused(subcommand, "--json", str(same), "--plot", str(same))
    assert line.startswith("Error: Invalid value for '--plot': "), line
    assert "is --json's file too: the plot would overwrite the results" in line
    # The same file by another name, the other way round.
    line = refused(subcommand, "--plot", str(same), "--json", str(tmp_path / "." / "out.png"))
    assert "is --plot's file too" in line, line


def test_an_empty_or_folder_output_path_says_what_is_wrong(tmp_path: Path) -> None:
    line = refused("comm", "--json", "")
    assert line == "Error: Invalid value for '--json': is empty: name the file to write, e.g. " \
        "results.json"  # fmt: skip
    line = refused("comm", "--plot", str(tmp_path))
    assert f"{tmp_path} is a folder: name a file in it, e.g. {tmp_path}/results.json" in line


@pytest.mark.parametrize("subcommand", ["comm", "train"])
def test_more_shards_than_a_server_takes_is_a_usage_error(subcommand: str) -> None:
    """--num-shards 65 ran, and every sharded run failed on the server's own limit."""
    line = refused(subcommand, "--num-shards", "65")
    assert line == "Error: Invalid value for '--num-shards': 65 is not in the range 1<=x<=64."


@pytest.mark.parametrize("subcommand", ["train", "link"])
def test_phases_from_a_variable_are_a_usage_error_that_names_it(subcommand: str) -> None:
    variable = f"PS_{subcommand.upper()}_PHASES"
    line = refused(subcommand, env={variable: "sync"})
    assert line == (
        f"Error: Invalid value for '--phases' (set by {variable}): must include ddp: every "
        "rate is reported against it"
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--train-limit", "6001"), "6001 is more than the 6000 images of the embedded "
                                    "training set: give at most 6000"),
        (("--train-limit", "100", "--workers", "2", "--batch-size", "64"),
         "100 images are less than one step's batches (2 workers x 64): give at least 128"),
    ],
)  # fmt: skip
def test_a_straggler_train_limit_that_cannot_work_is_refused(
    args: tuple[str, ...], message: str
) -> None:
    line = refused("straggler", *args)
    assert line.startswith(f"Error: Invalid value for '--train-limit': {message}"), line


def test_a_straggler_delay_skips_the_calibration(monkeypatch: pytest.MonkeyPatch) -> None:
    """The calibration only chooses a delay: with --delay given it was time spent for
    nothing."""
    from psserver.bench import straggler

    def no_calibration(*args: object) -> float:
        raise AssertionError("calibrated although --delay was given")

    delays: list[object] = []

    def run_policy(mode: str, *args: object) -> dict[str, object]:
        delays.append(args[-2])
        return {"mode": mode, "images_per_second": 1.0, "test_accuracy": 0.5}

    monkeypatch.setattr(straggler, "time_one_step", no_calibration)
    monkeypatch.setattr(straggler, "run_policy", run_policy)
    result = straggler.run_straggler(2, "lenet", 16, 1, 128, 0.25, 1)
    assert delays == [0.25] * 3
    assert result["step_s"] is None and result["slowdown"] is None


def test_help_explains_every_straggler_option() -> None:
    straggler_help = CliRunner().invoke(command, ["straggler", "--help"]).output
    for option in ("--model", "--epochs", "--train-limit"):
        text = straggler_help.split(option, 1)[1].split("\n  --", 1)[0]
        assert re.search(r"[a-z]{4}", text.split("]", 1)[-1] + text), (option, text)
        assert len(text.split()) > 4, (option, text)  # more than its type and default


def test_a_model_in_one_bucket_has_no_overlap_gain() -> None:
    """LeNet fits in the default bucket: the `sync` run pushes it after backward, as the
    no-overlap run does, and their ratio is noise."""
    from psserver.bench.link import LinkBench, link_report, summarize_link
    from psserver.bench.trainbench import TrainBench
    from psserver.bench.trainreport import summarize, table_rows

    assert gradient_buckets("lenet", None) == 1 and gradient_buckets("lenet", 0.05) > 1
    assert gradient_buckets("resnet18", None) > 1
    rates = {"sync": 50.0, "sync_no_overlap": 40.0, "sync_no_stream": 45.0, "ddp": 100.0}
    runs = {phase: [rate] for phase, rate in rates.items()}
    bench = TrainBench(workers=2, model="lenet", batch_size=16, steps=10, threads=1)
    train = summarize(
        bench, ["cpu", "cpu"], {p: runs[p] for p in ("sync", "sync_no_overlap", "ddp")}
    )
    assert train["overlap_gain"] is None and train["sync_buckets"] == 1
    assert "fits in one 2 MB gradient bucket" in train["notes"][0]
    assert "--bucket-mb 0.1 cuts it into buckets" in train["notes"][0]
    assert table_rows(train)[0][0] == "ps sync (1 bucket: nothing to overlap)"
    link_bench = LinkBench(bench, 100.0, 2, ("sync", "sync_no_stream", "sync_no_overlap", "ddp"))
    link = summarize_link(link_bench, runs)
    assert link["overlap_gain"] is None and link["streaming_gain"] is None
    report = link_report(link_bench, link)
    assert "overlap gain: n/a (1 bucket); streaming gain: n/a (1 bucket)" in report
    assert report.splitlines()[-1].startswith("note: lenet's gradient")


def test_link_use_too_short_to_measure_reads_n_a() -> None:
    from psserver.bench.link import LinkBench, link_report, summarize_link
    from psserver.bench.trainbench import TrainBench

    bench = LinkBench(TrainBench(2, "lenet", 16, 4, 1, "cpu", 60.0, 1, 0.05), 100.0, 2, ("ddp",))
    unmeasured = {"sent": None, "received": None, "busy_seconds": 0.0, "hosts": 0}
    results = summarize_link(bench, {"ddp": [10.0]}, {"ddp": [unmeasured]})
    assert results["link_use"] == {"ddp": {"sent": None, "received": None}}
    report = link_report(bench, results)
    assert "| pytorch ddp | 10.00 | 1.00 | n/a | n/a |" in report
    assert "note: link use n/a: the run's traffic was too short or too light" in report


def test_a_plot_title_fits_its_figure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Over the axes, right of long bar labels, the link plot's title ran off the figure."""
    import matplotlib.pyplot as plt

    from psserver.bench.report import bar_plot

    figures: list[object] = []
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure to measure it
    title = "4 workers, resnet18, batch 64, 1000 Mbit/s links (cubic), and a longer tail"
    labels = ["ps sync, overlap, weights not streamed", "pytorch ddp"]
    bar_plot(tmp_path / "t.png", title, labels, [1.0, 2.0], "images per second")
    [figure] = figures
    box = figure._suptitle.get_window_extent(figure.canvas.get_renderer())
    assert box.x0 >= 0 and box.x1 <= figure.bbox.width, (box, figure.bbox)
    plt.close(figure)


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_a_client_that_fails_with_its_server_reports_the_servers_cause(tmp_path: Path) -> None:
    """A sharded server whose follower could not bind stopped; its worker's error (the job
    was lost) was reported, and the cause was only in the server's log."""
    client_pid = tmp_path / "client.pid"
    # The server fails once the group has seen its client fail (reaped it): the failure
    # the group sees first is the client's, whatever the machine's load.
    (tmp_path / "fake_server.py").write_text(
        once_reaped(client_pid)
        + "print('Error: shard 1: cannot bind tcp://127.0.0.1:9: Address already in use')\n"
        "print('Error: shard 1 exited with code 1 before joining; see its error above')\n"
        "raise SystemExit(1)\n"
    )
    (tmp_path / "fake_client.py").write_text(
        writes_its_pid(client_pid) + "import sys; sys.exit('the server refused')\n"
    )
    with ProcessGroup() as group:
        group.env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), group.env.get("PYTHONPATH", "")])
        group.start("server", "fake_server", server=True)
        group.start("worker0", "fake_client")
        with pytest.raises(PSError) as failed:
            group.wait(30, "sync")
    assert str(failed.value).startswith(
        "sync: server exited with code 1: shard 1: cannot bind tcp://127.0.0.1:9: Address "
        "already in use; shard 1 exited with code 1 before joining; see its error above; "
        "worker0 stopped with it (logs in "
    ), failed.value


@contextlib.contextmanager
def taken_port_above_a_free_one() -> Iterator[int]:
    """A free port whose next one is held (listening) until the block ends. Other tests on
    the machine take ports too, so a pair is looked for until one fits, not skipped."""
    for _ in range(100):
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1] - 1
            with socket.socket() as probe:
                try:
                    probe.bind(("127.0.0.1", port))
                except OSError:
                    continue
            yield port
            return
    pytest.fail("no free port below a taken one in 100 tries")


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_comm_on_shards_whose_port_is_taken_names_the_cause() -> None:
    from psserver.bench.commruns import run_system

    # The leader's port, and its follower's (the next) taken.
    with taken_port_above_a_free_one() as port, pytest.raises(PSError) as failed:
        run_system("sync", 1, "lenet", 3, num_shards=2, port=port)
    message = str(failed.value)
    assert message.startswith("sync: server exited with code 1: shard 1: cannot bind"), message
    assert "Address already in use" in message and "worker0 stopped with it" in message


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_ctrl_c_says_where_the_logs_are_and_exits_130(tmp_path: Path) -> None:
    bench = subprocess.Popen(
        [sys.executable, "-m", "psserver.bench.cli", "comm", "--workers", "2", "--model",
         "lenet", "--rounds", "100000"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
    )  # fmt: skip
    scratch: Path | None = None
    try:
        children = Path(f"/proc/{bench.pid}/task/{bench.pid}/children")
        deadline = time.monotonic() + 60
        while len(children.read_text().split()) < 3:  # the floor's server and 2 clients
            assert time.monotonic() < deadline, "the floor never started"
            time.sleep(0.2)
        bench.send_signal(signal.SIGINT)
        _, stderr = bench.communicate(timeout=30)
        assert bench.returncode == 130, stderr
        assert "Traceback" not in stderr, stderr
        found = re.search(r"interrupted: the logs of the run it stopped are in (\S+)", stderr)
        assert found is not None, stderr
        scratch = Path(found.group(1))
        assert (scratch / "floor-server.log").exists()
        assert "[1/4] zeromq floor: 1 server, 2 clients, 100000 rounds ... interrupted" in stderr
    finally:
        bench.kill()
        bench.wait()
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_comm_runs_more_rounds_than_one_epoch_of_data() -> None:
    """At batch 1 an epoch of the embedded set is 3,000 rounds for 2 workers; --rounds
    100000 made the server finish its one epoch while the workers waited for more."""
    from psserver.bench.commruns import run_system

    run = run_system("sync", 2, "lenet", 12, job={"train_limit": 8})
    assert len(run.rounds) == 12  # epochs of 4 steps each
