"""`ps-bench comm`: its options, where its clients run, and the record printed, written and
plotted.

What this is not: the runs and the record (psserver.bench.comm), nor what is printed of it
(psserver.bench.commreport), nor the group the command belongs to (psserver.bench.cli).
"""

from collections.abc import Mapping
from typing import Any

import click

from common.cli import EnvAwareCommand, explain_errors
from common.logs import counted
from common.options import Option, options, with_params
from psserver.bench import options as bench
from psserver.bench.comm import run_comm
from psserver.bench.commreport import HEADERS, lines_under_table, table_rows, table_runs
from psserver.bench.report import bar_plot, markdown_table, write_json

COMM_OPTIONS = (
    bench.workers("Synthetic workers."),
    bench.model("resnet18", "Whose parameter count sets the message size."),
    Option("--rounds", type=click.IntRange(min=3), default=30, help="Timed rounds per run."),
    bench.num_shards(
        "Above 1, add a sync run on this many server shards (slices moved in parallel)."
    ),
    bench.BENCH_BUCKET_MB,
    bench.repeat("Runs of each kind, taking turns; each row then holds all their rounds."),
    *bench.output_options("the round times"),
)


@click.command(cls=EnvAwareCommand)
@options(COMM_OPTIONS)
@explain_errors
@with_params
def comm(params: Mapping[str, Any]) -> None:
    """Sync round time (push + update + pull) against the bare ZeroMQ floor, and async rate."""
    workers, model, rounds = params["workers"], params["model"], params["rounds"]
    num_shards, repeat = params["num_shards"], params["repeat"]
    click.echo(
        f"ps-bench comm: {counted(workers, 'worker')}, {model}, {rounds} rounds per run...",
        err=True,
    )
    result = run_comm(workers, model, rounds, num_shards, params["bucket_mb"], repeat)
    runs = table_runs(result, num_shards)
    click.echo(markdown_table(HEADERS, table_rows(result, runs)))
    for line in lines_under_table(result, num_shards, repeat):
        click.echo(line)
    if params["json_path"] is not None:
        write_json(params["json_path"], result)
    if params["plot"] is not None:
        bar_plot(
            params["plot"],
            f"sync round, {counted(workers, 'worker')}, {model}",
            [run.label.split(" (")[0] for run in runs],
            [run.stats["median_ms"] for run in runs],
            "milliseconds (median)",
        )
