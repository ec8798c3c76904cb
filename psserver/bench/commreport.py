"""What `ps-bench comm` prints of its record: the table of round times against the ZeroMQ
floor, with their CPU time, then the lines under it (sizes, the async rate, the servers'
memory, the notes, the turns, and what the CPU-bound column means). The plot shows the
table's runs.

What this is not: the runs and the record (psserver.bench.comm), nor the command and its
options (psserver.bench.commcli).
"""

from typing import Any, NamedTuple

from common.logs import counted

HEADERS = ["run", "median ms", "min ms", "max ms", "GB/s", "vs floor"]
HEADERS += ["server CPU ms", "CPU ms per worker", "CPU-bound ms"]
# How `over_floor_by_turn`'s rows are named in the line under the comm table.
TURN_LABELS = {"sync": "streamed", "whole": "whole", "sharded": "shards"}


class TableRun(NamedTuple):
    label: str
    stats: dict[str, float]  # the round's median, min and max, in ms
    over_floor: float  # its median over the floor's
    cpu: dict[str, float]  # its CPU time per round: the server's, each worker's
    cpu_bound: float | None  # the shortest round the CPU time allows; None: not known


def table_runs(result: dict[str, Any], num_shards: int) -> list[TableRun]:
    """The table's rows, as the record has them: the floor, then each ps-server run."""
    cpu, bound = result["cpu_ms_per_round"], result["cpu_bound_round_ms"]
    streamed = "buckets, streamed back" if result["sync_buckets"] > 1 else "1 bucket: not streamed"
    runs = [
        TableRun("zeromq floor", result["floor_round_ms"], 1.0, cpu["floor"], bound["floor"]),
        TableRun(f"ps sync round ({streamed})", result["sync_round_stats_ms"],
                 result["sync_over_floor"], cpu["sync"], bound["sync"]),
        TableRun("ps sync round, whole (--bucket-mb 0)", result["sync_whole_round_stats_ms"],
                 result["sync_whole_over_floor"], cpu["whole"], bound["whole"]),
    ]  # fmt: skip
    if num_shards > 1:
        runs.append(
            TableRun(f"ps sync round, {num_shards} shards", result["sync_sharded_round_stats_ms"],
                     result["sync_sharded_over_floor"], cpu["sharded"], bound["sharded"])
        )  # fmt: skip
    return runs


def table_rows(result: dict[str, Any], runs: list[TableRun]) -> list[list[Any]]:
    moved = result["bytes_per_round"]
    return [
        [
            run.label,
            run.stats["median_ms"],
            run.stats["min_ms"],
            run.stats["max_ms"],
            moved / run.stats["median_ms"] / 1e6,
            run.over_floor,
            run.cpu["server"],
            run.cpu["each_worker"],
            "" if run.cpu_bound is None else run.cpu_bound,
        ]
        for run in runs
    ]


def lines_under_table(result: dict[str, Any], num_shards: int, repeat: int) -> list[str]:
    lines = [
        f"\n{result['model_bytes'] / 1e6:.1f} MB per model; "
        f"{result['bytes_per_round'] / 1e6:.1f} MB moved per sync round; "
        f"async: {result['async_updates_per_second']:.1f} updates/s; server peak RSS "
        f"{result['server_peak_rss_mb']['sync']:.0f} MB (sync), "
        f"{result['server_peak_rss_mb']['async']:.0f} MB (async)"
        + sharded_rss_note(result, num_shards)
    ]
    lines += [f"note: {note}" for note in result["notes"]]
    if repeat > 1:
        lines.append(
            "turn by turn, over that turn's floor: "
            + "; ".join(
                f"{TURN_LABELS[kind]} {', '.join(f'{r:.2f}' for r in ratios)}"
                for kind, ratios in result["over_floor_by_turn"].items()
            )
        )
    shards_note = "; server CPU ms is the shards' leader alone" if num_shards > 1 else ""
    lines.append(
        "CPU-bound ms: the CPU time a round of the server, its follower shards and all the "
        f"workers, over the {counted(result['cores'], 'core')} they share; no round can be "
        "shorter "
        f"here{shards_note}"
    )
    return lines


def sharded_rss_note(result: dict[str, Any], num_shards: int) -> str:
    if num_shards == 1:
        return ""
    return f", {result['sync_sharded_peak_rss_mb']:.0f} MB ({num_shards} shards together)"
