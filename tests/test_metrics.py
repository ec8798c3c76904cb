"""Per-step metrics: the JSON Lines and TensorBoard files of `--log-dir`, and `ps-plot`."""

import builtins
import json
import logging
import os
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner
from matplotlib.figure import Figure

from common.errors import ConfigError
from common.metrics import MetricsWriter
from psserver.cli import plot
from tests.harness import REPO

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PLOTS = ("loss.png", "accuracy.png", "staleness.png", "step_time.png")
SERVER_UPDATE_KEYS = {
    "time", "role", "event", "step", "epoch", "train_loss", "train_accuracy", "samples",
    "images_per_s", "step_time_s", "staleness", "workers",
}  # fmt: skip
SERVER_EVAL_KEYS = {
    "time", "role", "event", "step", "epoch", "test_accuracy", "test_loss", "test_samples",
}  # fmt: skip
WORKER_STEP_KEYS = {
    "time", "role", "event", "step", "epoch", "worker", "batch", "version", "samples",
    "train_loss", "train_accuracy", "images_per_s", "compute_s", "comm_s", "step_time_s",
    "staleness", "applied",
}  # fmt: skip


def read_jsonl(path: Path) -> list[dict]:
    text = path.read_text()
    assert text.endswith("\n"), f"{path} does not end with a whole line"
    return [json.loads(line) for line in text.splitlines()]


def test_writer_writes_exact_json_lines_and_tensorboard_events(tmp_path: Path) -> None:
    clock = iter([100.0, 101.5])
    writer = MetricsWriter(tmp_path / "logs", "worker", 3, clock=lambda: next(clock))
    assert writer.enabled
    writer.write("step", 7, 0, train_loss=0.5, applied=True, workers=[1, 2])
    writer.write("step", 8, 1, train_loss=0.25, applied=False, note="x")
    writer.close()
    assert read_jsonl(tmp_path / "logs" / "worker-3.jsonl") == [
        {
            "time": 100.0,
            "role": "worker",
            "event": "step",
            "step": 7,
            "epoch": 0,
            "worker": 3,
            "train_loss": 0.5,
            "applied": True,
            "workers": [1, 2],
        },
        {
            "time": 101.5,
            "role": "worker",
            "event": "step",
            "step": 8,
            "epoch": 1,
            "worker": 3,
            "train_loss": 0.25,
            "applied": False,
            "note": "x",
        },
    ]
    # A second writer on the same file appends (a resumed server continues its file).
    again = MetricsWriter(tmp_path / "logs", "worker", 3, clock=lambda: 102.0)
    again.write("step", 9, 1)
    again.close()
    assert [r["step"] for r in read_jsonl(tmp_path / "logs" / "worker-3.jsonl")] == [7, 8, 9]

    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "logs" / "tb" / "worker-3"))
    events.Reload()
    # Only numbers become scalars (not bools, strings or lists), tagged with their key.
    assert events.Tags()["scalars"] == ["train_loss"]
    assert [(e.step, e.value) for e in events.Scalars("train_loss")] == [(7, 0.5), (8, 0.25)]


def test_writer_without_a_log_dir_writes_nothing(tmp_path: Path) -> None:
    writer = MetricsWriter(None, "server")
    assert not writer.enabled and writer.path is None
    writer.write("update", 1, 0, train_loss=1.0)
    writer.close()
    assert list(tmp_path.iterdir()) == []


def test_writer_without_tensorboard_says_so_once_and_writes_json_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real_import = builtins.__import__

    def import_without_tensorboard(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.startswith(("tensorboard", "torch.utils.tensorboard")):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", import_without_tensorboard)
    with caplog.at_level(logging.INFO, logger="ps.metrics"):
        writer = MetricsWriter(tmp_path, "server")
        writer.write("update", 1, 0, train_loss=1.0)
        writer.close()
    assert [r.getMessage() for r in caplog.records] == [
        f"no TensorBoard events in {tmp_path / 'tb' / 'server'}: `pip install tensorboard` to "
        "get them"
    ]
    assert [r["train_loss"] for r in read_jsonl(tmp_path / "server.jsonl")] == [1.0]
    assert not (tmp_path / "tb").exists()


def test_writer_refuses_a_log_dir_it_cannot_create(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"cannot write metrics to .*writable folder"):
        MetricsWriter(tmp_path / "file" / "logs", "server")


def test_ps_plot_says_what_is_missing_in_an_empty_dir(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("no metrics here\n")
    result = CliRunner().invoke(plot.command, [str(tmp_path)])
    assert result.exit_code == 1, result.output
    assert "Error: no metrics in" in result.output and "--log-dir" in result.output
    # A file there that holds no records is named as the trouble, not --log-dir.
    (tmp_path / "server.jsonl").write_text("not json\n")
    result = CliRunner().invoke(plot.command, [str(tmp_path)])
    assert result.exit_code == 1, result.output
    assert "skipped line 1 of" in result.output
    assert (
        result.output.strip()
        .splitlines()[-1]
        .endswith(
            ": none of its 1 .jsonl files holds a record of ps-server or ps-worker --log-dir (see "
            "the lines skipped above)"
        )
    )


def test_ps_plot_names_json_lines_that_are_no_records(tmp_path: Path) -> None:
    """JSON that is not a record (a step that is text, another program's file) was dropped
    without a word, and the error then pointed to `the lines skipped above`: there were none."""
    (tmp_path / "server.jsonl").write_text(
        '{"time": 1, "role": "server", "event": "update", "step": "x"}\n[1, 2]\n'
    )
    result = CliRunner().invoke(plot.command, [str(tmp_path)])
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert lines[0] == (
        f"skipped 2 lines of {tmp_path / 'server.jsonl'}: JSON, but not a record with an "
        "event, a numeric time and a numeric step"
    )
    assert lines[-1].endswith("(see the lines skipped above)") and len(lines) == 2


def test_ps_plot_says_an_empty_metrics_file_is_empty(tmp_path: Path) -> None:
    """A writer that gave up at its first line (a full disk) leaves an empty file: the error
    pointed to `the lines skipped above` with nothing above it."""
    (tmp_path / "worker-1.jsonl").write_text("")
    result = CliRunner().invoke(plot.command, [str(tmp_path)])
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert lines[0] == f"skipped {tmp_path / 'worker-1.jsonl'}: empty", result.output
    assert lines[-1].endswith("(see the lines skipped above)") and len(lines) == 2


def test_ps_plot_skips_a_torn_last_line(tmp_path: Path) -> None:
    writer = MetricsWriter(tmp_path, "server", clock=lambda: 5.0)
    for step in range(1, 4):
        writer.write("update", step, 0, train_loss=1.0 / step, staleness=step % 2, step_time_s=0.1)
    writer.write("eval", 3, 1, test_accuracy=0.5, test_loss=1.2)
    writer.close()
    with open(tmp_path / "server.jsonl", "a") as f:
        f.write('{"time": 6.0, "role": "ser')  # a process killed mid-line
    result = CliRunner().invoke(plot.command, [str(tmp_path), "--out", str(tmp_path / "png")])
    assert result.exit_code == 0, result.output
    assert "skipped line 5" in result.output
    for name in PLOTS:
        assert (tmp_path / "png" / name).read_bytes()[:8] == PNG_MAGIC


@pytest.mark.integration
def test_step_times_script_tabulates_each_runs_medians_after_the_warm_up(tmp_path: Path) -> None:
    run = tmp_path / "compress-bf16"
    for worker, compute in ((1, [9.0, 0.010, 0.030]), (2, [9.0, 0.020, 0.040])):
        writer = MetricsWriter(run, f"worker-{worker}", clock=lambda: 5.0)
        for step, compute_s in enumerate(compute, 1):  # the first step of each is warm-up
            writer.write("step", step, 0, compute_s=compute_s, comm_s=0.005, step_time_s=0.1)
        writer.close()
    empty = tmp_path / "empty"
    empty.mkdir()
    script = [sys.executable, str(REPO / "scripts" / "step_times.py"), "--skip", "1"]
    done = subprocess.run([*script, str(run)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "| compress-bf16 | 4 | 25.0 | 5.0 | 100.0 |" in done.stdout  # median of 10,20,30,40
    failed = subprocess.run([*script, str(empty)], capture_output=True, text=True, timeout=120)
    assert failed.returncode == 1 and "train with --log-dir DIR first" in failed.stderr
    assert "Traceback" not in failed.stderr


def test_ps_plot_draws_a_huge_staleness_without_an_array_that_size(tmp_path: Path) -> None:
    """A histogram array as long as the largest staleness (a bogus 10**12 from a hostile
    client) could not be allocated, and ps-plot died with a traceback."""
    writer = MetricsWriter(tmp_path, "server", clock=lambda: 5.0)
    for step, staleness in ((1, 0), (2, 10**12)):
        writer.write("update", step, 0, train_loss=1.0, staleness=staleness, step_time_s=0.1)
    writer.close()
    result = CliRunner().invoke(plot.command, [str(tmp_path), "--out", str(tmp_path / "png")])
    assert result.exit_code == 0, result.output


def test_ps_plot_skips_what_is_not_a_record_and_draws_the_rest(tmp_path: Path) -> None:
    """Each of these ended ps-plot with a traceback."""
    writer = MetricsWriter(tmp_path, "server", clock=lambda: 5.0)
    writer.write("update", 1, 0, train_loss=1.0, staleness=0, step_time_s=0.1)
    writer.write("update", 2, 0, train_loss=1.0, staleness="high", step_time_s=0.1)
    writer.close()
    (tmp_path / "worker-1.jsonl").write_text(  # a step record without compute_s
        '{"time": 1, "role": "worker", "event": "step", "step": 1, "epoch": 0, '
        '"step_time_s": 0.1}\n'
    )
    (tmp_path / "worker-2.jsonl").write_bytes(b'\xff\xfe{"time": 1}\n')  # not UTF-8
    (tmp_path / "worker-3.jsonl").mkdir()  # a folder with a metrics file's name
    result = CliRunner().invoke(plot.command, [str(tmp_path), "--out", str(tmp_path / "png")])
    assert result.exit_code == 0, result.output
    assert "skipped" in result.output and "worker-2.jsonl: cannot be read as text" in result.output
    for name in PLOTS:
        assert (tmp_path / "png" / name).read_bytes()[:8] == PNG_MAGIC


def records(role: str, *rows: tuple[str, float, int, dict[str, Any]]) -> list[dict[str, Any]]:
    """ps-plot's records of one file: (event, time, step, values) each."""
    return [
        {"time": t, "role": role, "event": event, "step": step, "epoch": 0, **values}
        for event, t, step, values in rows
    ]


def update(t: float, step: int, staleness: int = 0, step_time_s: float = 0.01) -> tuple:
    return ("update", t, step, {"staleness": staleness, "step_time_s": step_time_s})


def worker_step(t: float, step: int, step_time_s: float = 1.0) -> tuple:
    times = {"step_time_s": step_time_s, "compute_s": 0.8 * step_time_s, "comm_s": 0.1}
    return ("step", t, step, {"train_loss": 1.0, "train_accuracy": 0.5, "staleness": 0, **times})


def drawn(draw: Any, runs: dict[str, list[dict[str, Any]]]) -> Any:
    figure = Figure()
    axes = figure.add_subplot()
    draw(runs, axes)
    return axes


@pytest.mark.parametrize(
    ("mode", "title"),
    [
        ("async", "Staleness (3 updates; async mode)"),
        ("ssp", "Staleness (3 updates; ssp mode)"),
        ("sync", "Staleness (3 updates; sync mode: always 0)"),
        (None, "Staleness (3 updates)"),  # a file from before the job record
    ],
)
def test_the_staleness_chart_is_titled_by_the_runs_mode(mode: str | None, title: str) -> None:
    """An async run's chart was titled "always 0 in sync mode"."""
    job = [("job", 0.5, 1, {"mode": mode, "model": "lenet"})] if mode else []
    runs = {"server": records("server", *job, update(1, 1), update(2, 2, 1), update(3, 3, 2))}
    assert drawn(plot.plot_staleness, runs).get_title() == title


def test_the_steps_a_resumed_server_trained_again_count_once() -> None:
    """A server killed at step 64 and resumed from its checkpoint at step 50 trains 51..64
    again: the file held 202 updates where the summary said 188 steps."""
    first = [update(t, t) for t in range(1, 65)]  # step s at time s
    again = [update(100 + s, s) for s in range(51, 189)]
    server = records("server", *first, ("resume", 100.0, 50, {}), *again)
    acked = [(s + 0.5, s) for s in range(1, 65)] + [(100.5 + s, s) for s in range(51, 189)]
    worker = records("worker", *(worker_step(t, s) for t, s in acked))
    kept = plot.standing({"server": server, "worker-1": worker})
    assert [r["step"] for r in kept["server"] if r["event"] == "update"] == list(range(1, 189))
    assert [r["step"] for r in kept["worker-1"]] == list(range(1, 189))
    assert drawn(plot.plot_staleness, kept).get_title() == "Staleness (188 updates)"
    figure = Figure()
    top, _ = figure.subplots(2, 1)
    plot.plot_step_time({"server": server, "worker-1": worker}, top, _)  # time was spent
    server_faint = next(line for line in top.lines if line.get_color() == "black")
    assert np.isfinite(server_faint.get_ydata()).sum() == len(first) + len(again)


def test_the_step_time_chart_shows_the_server_and_breaks_its_lines_at_an_outage() -> None:
    """The server's line was drawn under the workers' (in sync mode the same times), on a
    scale where milliseconds against seconds lay flat on the axis; an outage was drawn as a
    straight line across it."""
    steps = [*range(1, 31), *range(31, 61)]
    times = [*range(1, 31), *(s + 100 for s in range(31, 61))]  # no record from 30 s to 131 s
    server = records("server", *(update(t, s) for t, s in zip(times, steps, strict=True)))
    workers = {
        f"worker-{i}": records(
            "worker", *(worker_step(t, s) for t, s in zip(times, steps, strict=True))
        )
        for i in (1, 2)
    }
    figure = Figure()
    top, bottom = figure.subplots(2, 1)
    plot.plot_step_time({"server": server, **workers}, top, bottom)
    server_lines = [line for line in top.lines if line.get_color() == "black"]
    worker_lines = [line for line in top.lines if line not in server_lines]
    assert top.lines[-1].get_label() == "server: between updates" and worker_lines
    assert min(line.get_zorder() for line in server_lines) > max(
        line.get_zorder() for line in worker_lines
    )
    assert top.get_yscale() == "log"  # 10 ms against 1 s
    for line in top.lines + bottom.lines:  # one break, where the records stop
        x, y = (np.asarray(data, float) for data in line.get_data())
        (gap,) = np.flatnonzero(np.isnan(y))
        assert x[gap - 1] <= 29 and x[gap + 1] >= 130, line.get_label()  # from the first record
    # Between two updates a minute apart (slow steps) is no outage.
    slow = {"server": records("server", *(update(60.0 * s, s, 0, 60.0) for s in range(1, 5)))}
    figure = Figure()
    top, bottom = figure.subplots(2, 1)
    plot.plot_step_time(slow, top, bottom)
    assert not np.isnan(np.asarray(top.lines[0].get_ydata(), float)).any()
    assert top.get_yscale() == "linear"


def test_the_loss_and_accuracy_panels_draw_their_own_records() -> None:
    """One function draws both: each takes its own key from the workers' steps and from the
    server's evaluations, and its own axis."""
    worker = records("worker-1", worker_step(1, 1), worker_step(2, 2))
    evaluation = ("eval", 3, 2, {"test_loss": 2.5, "test_accuracy": 0.75})
    runs = {"server": records("server", evaluation), "worker-1": worker}
    for measure, train, test in ((plot.LOSS, 1.0, 2.5), (plot.ACCURACY, 0.5, 0.75)):
        axes = drawn(partial(plot.plot_train_and_test, measure=measure), runs)
        (trained, tested) = axes.lines
        assert trained.get_label() == "worker-1 train" and tested.get_label() == "server test"
        assert list(trained.get_xdata()) == [1, 2] and list(trained.get_ydata()) == [train] * 2
        assert list(tested.get_xdata()) == [2] and list(tested.get_ydata()) == [test]
        assert (axes.get_title(), axes.get_ylabel()) == (measure.title, measure.ylabel)
    assert drawn(partial(plot.plot_train_and_test, measure=plot.ACCURACY), runs).get_ylim() == (
        0,
        1,
    )


def test_an_empty_panel_says_why() -> None:
    """A server that evaluated nothing yet, and no worker files: the loss, accuracy and
    bottom step-time panels had nothing on them, and said nothing."""
    runs = {"server": records("server", update(1, 1), update(2, 2))}
    for measure in (plot.LOSS, plot.ACCURACY):
        (note,) = drawn(partial(plot.plot_train_and_test, measure=measure), runs).texts
        assert note.get_text().startswith("no data: no worker-*.jsonl here"), note.get_text()
    figure = Figure()
    top, bottom = figure.subplots(2, 1)
    plot.plot_step_time(runs, top, bottom)
    assert not top.texts and bottom.texts[0].get_text().startswith("no data: no worker-")
    nothing = {"server": records("server", ("eval", 1, 0, {"test_loss": 2.3}))}
    (note,) = drawn(plot.plot_staleness, nothing).texts
    assert note.get_text() == "no data: server.jsonl records no applied update yet"
    loss = partial(plot.plot_train_and_test, measure=plot.LOSS)
    assert not drawn(loss, nothing).texts  # the evaluation is drawn


def test_ps_plot_to_a_folder_it_cannot_make_is_one_error(tmp_path: Path) -> None:
    writer = MetricsWriter(tmp_path, "server", clock=lambda: 5.0)
    writer.write("update", 1, 0, train_loss=1.0, staleness=0, step_time_s=0.1)
    writer.close()
    (tmp_path / "afile").write_text("")
    out = tmp_path / "afile" / "plots"  # under a file
    result = CliRunner().invoke(plot.command, [str(tmp_path), "--out", str(out)])
    assert result.exit_code == 1, result.output
    assert "Error: cannot write the plots to" in result.output and "--out" in result.output
    assert "Traceback" not in result.output


def run_ps_local(tmp_path: Path, args: list[str]) -> "subprocess.CompletedProcess[str]":
    return subprocess.run(
        [sys.executable, "-m", "psserver.cli.local", *args],
        capture_output=True, text=True, timeout=100, cwd=tmp_path,
    )  # fmt: skip


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_ps_local_log_dir_writes_every_role_and_ps_plot_draws_them(tmp_path: Path) -> None:
    logs, out = tmp_path / "logs", tmp_path / "plots"
    # 512 images, 2 workers, batch 64: 4 steps per shard, so 8 async updates in all.
    args = ["--model", "lenet", "--workers", "2", "--epochs", "1", "--train-limit", "512"]
    args += ["--batch-size", "64", "--threads", "1", "--mode", "async", "--log-dir", str(logs)]
    run = run_ps_local(tmp_path, args)
    assert run.returncode == 0, f"ps-local failed:\n{run.stderr[-6000:]}"

    server = read_jsonl(logs / "server.jsonl")
    # First, what ps-plot titles its charts with, at the step of the first update.
    job = {"event": "job", "role": "server", "step": 1, "epoch": 0, "mode": "async"}
    assert {k: server[0][k] for k in job} == job and server[0]["model"] == "lenet"
    updates = [r for r in server if r["event"] == "update"]
    evaluations = [r for r in server if r["event"] == "eval"]
    assert [r["step"] for r in updates] == list(range(1, 9))
    assert all(set(r) == SERVER_UPDATE_KEYS and r["role"] == "server" for r in updates)
    assert sum(r["samples"] for r in updates) == 512
    assert all(len(r["workers"]) == 1 and r["staleness"] >= 0 for r in updates)
    assert [(r["step"], r["epoch"]) for r in evaluations] == [(8, 1)]
    assert set(evaluations[0]) == SERVER_EVAL_KEYS

    worker_files = sorted(logs.glob("worker-*.jsonl"))
    assert [p.name for p in worker_files] == ["worker-1.jsonl", "worker-2.jsonl"]
    steps_seen = []
    for path in worker_files:
        job, *records = read_jsonl(path)
        worker_id = int(path.stem.split("-")[1])
        assert (job["event"], job["step"], job["mode"]) == ("job", records[0]["step"], "async")
        assert len(records) == 4, records
        for record in records:
            assert set(record) == WORKER_STEP_KEYS, record
            assert record["worker"] == worker_id and record["applied"] is True
            assert record["compute_s"] > 0 and record["comm_s"] > 0
            assert record["step_time_s"] >= record["compute_s"] + record["comm_s"] - 1e-9
        assert [r["batch"] for r in records] == [0, 1, 2, 3]
        steps_seen += [r["step"] for r in records]
    # Each worker's step is the server version after its push: together, every update once.
    assert sorted(steps_seen) == list(range(1, 9))
    by_step = {r["step"]: r for r in updates}
    for path in worker_files:
        for record in read_jsonl(path)[1:]:
            assert record["staleness"] == by_step[record["step"]]["staleness"]
            assert record["train_loss"] == pytest.approx(by_step[record["step"]]["train_loss"])

    try:
        import tensorboard  # noqa: F401
    except ImportError:
        pass
    else:
        for role in ("server", "worker-1", "worker-2"):
            assert list((logs / "tb" / role).glob("events.out.tfevents.*")), role

    script = Path(sys.executable).with_name("ps-plot")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "psserver.cli.plot"]
    # --out from the environment, as every command takes its options (PS_OUT).
    drawn = subprocess.run(
        [*command, str(logs)], capture_output=True, text=True, timeout=60,
        env={**os.environ, "PS_OUT": str(out)},
    )  # fmt: skip
    assert drawn.returncode == 0, drawn.stderr
    assert drawn.stdout.split() == [str(out / name) for name in PLOTS]
    for name in PLOTS:
        assert (out / name).read_bytes()[:8] == PNG_MAGIC, name


def test_an_abandoned_steps_pushes_are_not_in_the_next_update_record(tmp_path: Path) -> None:
    """Their samples and loss used to spill into the first update of the next epoch."""
    from psserver.status.report import TrainingMeter, UpdateRecorder

    recorder, meter = UpdateRecorder(tmp_path, "sync", "lenet"), TrainingMeter()
    recorder.record_push(32, 64.0, 10)  # taken by a step that is then abandoned
    meter.record_push(32, 64.0, 10, nbytes=1000)
    recorder.discard_pending()
    meter.retract_push(32, 64.0, 10, 1000)
    recorder.record_push(16, 8.0, 12)
    meter.record_push(16, 8.0, 12, nbytes=500)
    recorder.record_update(1, 1, 0, [2])
    recorder.close()
    job, update = read_jsonl(tmp_path / "server.jsonl")
    assert (job["event"], job["step"], job["mode"], job["model"]) == ("job", 1, "sync", "lenet")
    assert (update["samples"], update["train_loss"], update["train_accuracy"]) == (16, 0.5, 0.75)
    assert (meter.samples, meter.pushes, meter.push_bytes) == (16, 1, 500)
    assert (meter.window_samples, meter.window_loss, meter.window_correct) == (16, 8.0, 12)


@pytest.mark.integration
@pytest.mark.timeout(120)
@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (Linux)")
def test_a_full_disk_under_log_dir_costs_the_metrics_not_the_job(tmp_path: Path) -> None:
    """Every write to /dev/full fails with ENOSPC, as on a full disk: the server and the
    worker each crashed with a traceback at their first flush. Each now says it once and
    trains to the end."""
    logs = tmp_path / "logs"
    logs.mkdir()
    for name in ("server.jsonl", "worker-1.jsonl"):
        (logs / name).symlink_to("/dev/full")
    args = ["--model", "lenet", "--workers", "1", "--epochs", "1", "--train-limit", "320"]
    args += ["--batch-size", "32", "--threads", "1", "--log-dir", str(logs)]
    run = run_ps_local(tmp_path, args)
    output = run.stdout + run.stderr
    assert run.returncode == 0, f"ps-local failed:\n{output[-6000:]}"
    assert "Traceback" not in output, output[-6000:]
    for role, name in (("server", "server.jsonl"), ("worker", "worker-1.jsonl")):
        said = [
            line
            for line in output.splitlines()
            if f"could not write metrics to {logs / name}" in line
        ]
        assert len(said) == 1, output[-6000:]
        assert "No space left on device" in said[0] and f"this {role} writes no more" in said[0]
    assert "after 10 sync steps" in run.stdout


@pytest.mark.integration
def test_a_line_is_on_disk_as_soon_as_it_is_written(tmp_path: Path) -> None:
    """A line went out only once a second had passed since the last flush: a role that then
    waited (a held pull) kept it in its buffer, and a kill lost it. Here a second process
    reads the file while the writer is still open, as whatever survives a kill would."""
    writer = MetricsWriter(tmp_path, "worker", 1, clock=lambda: 7.0)
    writer.write("step", step=1, epoch=0, train_loss=0.5)
    writer.write("step", step=2, epoch=0, train_loss=0.25)
    seen = subprocess.run(
        [sys.executable, "-c", f"print(open({str(tmp_path / 'worker-1.jsonl')!r}).read(), end='')"],
        capture_output=True, text=True, timeout=30, check=True,
    ).stdout  # fmt: skip
    assert [json.loads(line)["step"] for line in seen.splitlines()] == [1, 2]
    writer.close()
