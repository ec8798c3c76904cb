"""Where a worker's steps went: the medians of compute, communication and step time in the
worker-*.jsonl files that `--log-dir` writes, one row per log folder.

    python scripts/step_times.py --skip 20 RUN_DIR...

compute_s is forward and backward (with the sends that overlap it); comm_s is the pull and
the part of the push that backward did not hide. Not a benchmark of its own: it reads what a
run already recorded (benchmarks/gpu-check.sh's compress stage uses it).
"""

import statistics
from pathlib import Path

import click

from common.errors import DataError
from psserver.cli.plot import is_number, read_metrics

FIELDS = ("compute_s", "comm_s", "step_time_s")


def step_records(run_dir: Path, skip: int) -> list[dict]:
    """The step records of every worker in `run_dir`, less each worker's first `skip` (read
    as ps-plot reads them: a torn last line is skipped)."""
    records: list[dict] = []
    for name, run in read_metrics(run_dir).items():
        if name.startswith("worker-"):
            steps = [r for r in run if r["event"] == "step"]
            records.extend(r for r in steps[skip:] if all(is_number(r.get(f)) for f in FIELDS))
    return records


@click.command()
@click.option("--skip", type=click.IntRange(min=0), default=20, help="Warm-up steps to leave out.")
@click.argument("run_dirs", nargs=-1, type=click.Path(exists=True, file_okay=False, path_type=Path))
def main(skip: int, run_dirs: tuple[Path, ...]) -> None:
    click.echo("| run | steps | compute ms | comm ms | step ms |")
    click.echo("|---|---|---|---|---|")
    for run_dir in run_dirs:
        try:
            records = step_records(run_dir, skip)
        except DataError as exc:
            raise click.ClickException(str(exc)) from None
        if not records:
            raise click.ClickException(f"{run_dir}: no worker step records after the first {skip}")
        medians = [statistics.median(r[field] for r in records) * 1000 for field in FIELDS]
        cells = " | ".join(f"{value:.1f}" for value in medians)
        click.echo(f"| {run_dir.name} | {len(records)} | {cells} |")


if __name__ == "__main__":
    main()
