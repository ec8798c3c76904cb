"""`ps-bench`: both benchmarks run end to end on real processes and write what they promise.

No timed asserts: the numbers must be there and positive, never fast.
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner, Result

from common.catalog import build_model
from common.data import ImageSet
from common.errors import PSError
from common.logs import counted
from psserver.bench.baselines import rank_rate, run_ddp
from psserver.bench.cli import command
from psserver.bench.clients import ClientJob, run_clients
from psserver.bench.commruns import _per_round
from psserver.bench.ddp import load_training_set, timed_training
from psserver.bench.options import in_turns, parse_phases
from psserver.bench.procs import ProcessGroup
from psserver.bench.report import bar_plot
from psserver.bench.train import describe
from psserver.bench.trainbench import PHASES, SHARDED_PHASES, TrainBench
from psserver.bench.trainps import steady_rate
from psserver.bench.trainreport import summarize
from psserver.status.report import WARMUP_STEPS, TrainingMeter
from tests.harness import all_exit, free_port

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# tc tbf lets a link carry its rate plus one burst; sampling times add a little jitter.
MAX_LINK_USE = 1.05


def invoke(*args: str) -> Result:
    result = CliRunner().invoke(command, list(args))
    assert result.exit_code == 0, f"ps-bench {' '.join(args)} failed:\n{result.output}"
    return result


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_train_writes_eight_rates_and_a_plot(tmp_path: Path) -> None:
    json_path, plot = tmp_path / "train.json", tmp_path / "train.png"
    result = invoke(
        "train",
        *("--workers", "2", "--model", "lenet", "--batch-size", "16", "--steps", "10"),
        *("--threads", "1", "--device", "cpu", "--json", str(json_path), "--plot", str(plot)),
        *("--num-shards", "2", "--bucket-mb", "0.05"),  # lenet's slices in buckets
    )
    results = json.loads(json_path.read_text())
    rates = results["images_per_second"]
    assert set(rates) == {*PHASES, *SHARDED_PHASES}
    assert all(rate > 0 for rate in rates.values()), rates
    assert results["num_shards"] == 2
    assert all(len(runs) == 1 for runs in results["images_per_second_runs"].values())
    gain = rates["sync_sharded"] / rates["sync_sharded_no_overlap"]
    assert results["sharded_overlap_gain"] == pytest.approx(gain)
    assert results["overlap_gain"] == pytest.approx(rates["sync"] / rates["sync_no_overlap"])
    assert results["sync_over_ddp"] == pytest.approx(rates["sync"] / rates["ddp"])
    assert results["async_over_ddp"] == pytest.approx(rates["async"] / rates["ddp"])
    bound = rates["compute_bound"] / rates["ddp"]
    assert results["compute_bound_over_ddp"] == pytest.approx(bound)
    keys = ("workers", "model", "batch_size", "steps", "threads", "bucket_mb")
    config = {k: results[k] for k in keys}
    expected = {"workers": 2, "model": "lenet", "batch_size": 16, "steps": 10, "threads": 1}
    assert config == {**expected, "bucket_mb": 0.05}
    assert plot.read_bytes().startswith(PNG_MAGIC)
    assert "| ps sync |" in result.output and "| pytorch ddp |" in result.output
    assert "| ps sync, sharded, overlap |" in result.output
    assert "| ps sync, no overlap |" in result.output


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_comm_writes_round_times(tmp_path: Path) -> None:
    json_path = tmp_path / "comm.json"
    result = invoke(
        "comm", "--workers", "2", "--model", "lenet", "--rounds", "3", "--num-shards", "3",
        "--bucket-mb", "0.05", "--repeat", "2", "--json", str(json_path),
    )  # fmt: skip
    results = json.loads(json_path.read_text())
    # Three buckets: parts go up and updated buckets come back, so every pull after each
    # worker's first (of 2 warm-up and 3 timed rounds) finds its weights there already; two
    # turns of everything, and each row holds both turns' rounds.
    assert results["repeat"] == 2
    assert results["sync_streamed_pulls"] == 2 * 2 * (2 + 3 - 1)
    assert results["sync_whole_round_ms"] > 0 and results["sync_whole_over_floor"] > 0
    assert results["num_shards"] == 3 and results["sync_sharded_round_ms"] > 0
    assert results["sync_sharded_peak_rss_mb"] > 0
    for key in ("sync_round_ms", "floor_round_ms", "async_updates_per_second", "sync_over_floor"):
        assert key in results, f"{key} missing from {sorted(results)}"
    assert results["sync_round_ms"] > 0
    assert results["floor_round_ms"]["median_ms"] > 0
    assert results["async_updates_per_second"] > 0
    assert results["sync_over_floor"] > 0
    assert results["sync_whole_gb_per_s"] > 0 and results["sync_sharded_gb_per_s"] > 0
    # The floor times as many rounds as the system (it used to time 2 fewer: its warm-up
    # rounds came out of --rounds), in each of the 2 turns.
    assert results["timed_rounds"] == {"floor": 6, "sync": 6, "whole": 6, "sharded": 6}
    # Every process spent CPU in its timed rounds, and the server's came from its status.
    cpu = results["cpu_ms_per_round"]
    assert set(cpu) == {"floor", "sync", "whole", "sharded"}
    for run, use in cpu.items():
        assert use["server"] > 0 and use["each_worker"] > 0, (run, use)
    # The 3 shards' leader started its 2 followers and reports their CPU time (None would
    # mean it could not); one server has none. /proc counts CPU in 10 ms ticks, and the
    # followers' share of 6 LeNet rounds can round down to 0, so only its presence is sure.
    assert cpu["sharded"]["followers"] is not None and cpu["sharded"]["followers"] >= 0
    assert cpu["floor"]["followers"] == cpu["sync"]["followers"] == cpu["whole"]["followers"] == 0
    # The CPU bound is all their CPU time over the cores they shared.
    cores = results["cores"]
    assert cores == len(os.sched_getaffinity(0))
    assert set(results["cpu_bound_round_ms"]) == {"floor", "sync", "whole", "sharded"}
    for run, bound in results["cpu_bound_round_ms"].items():
        use = cpu[run]
        total = use["server"] + use["followers"] + 2 * use["each_worker"]
        assert bound == pytest.approx(total / cores), run
    assert "| CPU-bound ms |" in result.output
    # Turn by turn, each sync row over the floor run of its own turn.
    by_turn = results["over_floor_by_turn"]
    assert set(by_turn) == {"sync", "whole", "sharded"}
    assert all(len(ratios) == 2 and min(ratios) > 0 for ratios in by_turn.values()), by_turn
    assert "turn by turn, over that turn's floor: streamed " in result.output
    # Progress: every run says what it is and how it went; the second turn starts one later.
    assert "[1/10] zeromq floor: 1 server, 2 clients, 3 rounds ... " in result.output
    assert "[6/10] ps sync, buckets streamed back: ps-server + 2 synthetic workers" in result.output
    assert "[10/10] zeromq floor" in result.output
    assert result.output.count("ms a round (median)") == 8
    assert result.output.count(" updates/s (") == 2
    assert f"over the {counted(cores, 'core')} they share" in result.output


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_straggler_runs_the_three_policies_with_one_slow_worker(tmp_path: Path) -> None:
    json_path, plot = tmp_path / "straggler.json", tmp_path / "straggler.png"
    result = invoke(
        "straggler", "--workers", "2", "--model", "lenet", "--batch-size", "16",
        "--epochs", "1", "--train-limit", "128", "--delay", "0.05",
        "--json", str(json_path), "--plot", str(plot),
    )  # fmt: skip
    results = json.loads(json_path.read_text())
    assert results["slow_worker_delay_s"] == 0.05
    assert results["step_s"] is None and results["slowdown"] is None  # --delay: not timed
    runs = {run["mode"]: run for run in results["runs"]}
    assert list(runs) == ["sync", "async", "ssp"]
    for mode, run in runs.items():
        assert run["images_per_second"] > 0 and 0 <= run["test_accuracy"] <= 1, run
        assert run["global_steps"] > 0, run
        assert f"| {mode} |" in result.output
    # 128 images over 2 workers in batches of 16: sync takes one gradient from each a step.
    assert runs["sync"]["global_steps"] == 128 // (2 * 16)
    assert runs["sync"]["staleness_max"] == 0
    # SSP runs with --staleness 2: with two workers, a gradient is at most 3 updates old.
    assert runs["ssp"]["staleness_max"] <= 3, runs["ssp"]
    assert "] calibration:" not in result.output  # only --slowdown needs a step timed
    assert "[1/3] ps sync: ps-server + 2 ps-workers, worker 0 0.05 s slower a step" in result.output
    assert "worker 0 slept 50.0 ms a step (--delay: no calibration run" in result.output
    assert result.output.count("img/s, test accuracy") == 3
    assert plot.read_bytes().startswith(PNG_MAGIC)


def test_the_straggler_delay_is_calibrated_to_the_slowdown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without --delay, the slow worker sleeps (slowdown - 1) worker steps, as timed."""
    from psserver.bench import straggler

    started: list[float] = []
    monkeypatch.setattr(straggler, "time_one_step", lambda *args: 0.02)

    def run_policy(mode: str, *args: object) -> dict[str, object]:
        started.append(args[-2])  # type: ignore[arg-type]  # the delay
        return {"mode": mode, "images_per_second": 1.0, "test_accuracy": 0.5}

    monkeypatch.setattr(straggler, "run_policy", run_policy)
    result = straggler.run_straggler(2, "lenet", 16, 1, 128, None, 1, slowdown=2.5)
    assert started == [pytest.approx(0.03)] * 3  # every policy's slow worker sleeps 1.5 steps
    assert result["slowdown"] == pytest.approx(2.5)
    assert result["step_s"] == 0.02


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_one_step_is_timed_by_a_short_sync_run() -> None:
    from psserver.bench.straggler import CALIBRATION_STEPS, time_one_step

    started = time.monotonic()
    step_s = time_one_step(2, "lenet", 16, 1)
    # One step's time, not the run's: the timed steps (all but 2 of CALIBRATION_STEPS) fit in
    # the run. Both sides grow with the machine's load, so no load can break this.
    assert 0 < step_s < (time.monotonic() - started) / (CALIBRATION_STEPS - 2)


def test_reference_loop_times_all_but_the_warmup_steps() -> None:
    device = torch.device("cpu")
    full = load_training_set(device)
    data = ImageSet(full.images[:100], full.labels[:100])
    # 100 images in batches of 40: steps 0-2 take 40, 40 and 20; step 3 starts epoch 1.
    timing = timed_training(build_model("lenet", seed=0), data, 40, 4, device)
    assert WARMUP_STEPS == 2
    assert timing.samples == 20 + 40
    assert timing.seconds > 0


def test_the_steady_rate_starts_after_every_workers_warmup_pushes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = [100.0]
    monkeypatch.setattr("psserver.status.report.time.monotonic", lambda: clock[0])
    meter = TrainingMeter(warmup_pushes=WARMUP_STEPS * 2)  # 2 workers
    meter.start()
    for seconds in (10.0, 0.0, 3.0, 0.0):  # two slow warm-up steps of 2 pushes of 32
        clock[0] += seconds
        meter.record_push(32, 0.0, 0)
        assert meter.steady_images_per_second is None
    for _ in range(3):  # then 3 steps of 2 s
        clock[0] += 2.0
        meter.record_push(32, 0.0, 0)
        meter.record_push(32, 0.0, 0)
    meter.finished = clock[0]
    assert meter.steady_images_per_second == 3 * 64 / 6.0
    assert meter.images_per_second == 10 * 32 / 19.0  # the first steps count here
    assert steady_rate({"steady_images_per_second": 32.0}) == 32.0
    with pytest.raises(PSError, match="within its 4 warm-up pushes; give it more --steps"):
        steady_rate({"steady_images_per_second": None, "warmup_pushes": 4})


@pytest.mark.integration
@pytest.mark.timeout(180)
@pytest.mark.parametrize("sync", [True, False], ids=["ddp", "ranks-apart"])
def test_ddp_ranks_end_identical_and_ranks_apart_do_not(sync: bool, tmp_path: Path) -> None:
    """Each rank run checks its own premise (rank_rate refuses a run that fails it): DDP's
    two ranks hold the same weights at the end, the compute bound's two do not (each
    trained its own shard), so the compute bound really moved no gradients."""
    bench = TrainBench(workers=2, model="lenet", batch_size=8, steps=4, threads=1)
    assert run_ddp(bench, ["cpu", "cpu"], sync=sync) > 0


def test_a_rank_run_that_broke_its_premise_is_refused() -> None:
    same, apart = {"replicas_identical": True}, {"replicas_identical": False}
    assert rank_rate({"images_per_second": 5.0, **same}, sync=True, ranks=2) == 5.0
    assert rank_rate({"images_per_second": 7.0, **apart}, sync=False, ranks=2) == 7.0
    with pytest.raises(PSError, match="the DDP ranks ended with different weights"):
        rank_rate({"images_per_second": 5.0, **apart}, sync=True, ranks=2)
    with pytest.raises(PSError, match="the compute-bound ranks ended with the same weights"):
        rank_rate({"images_per_second": 5.0, **same}, sync=False, ranks=2)
    with pytest.raises(PSError, match="did not measure what it should"):
        rank_rate({"images_per_second": 5.0}, sync=True, ranks=2)  # a rank that did not check
    # One rank has no other to compare with: nothing to check, nothing refused.
    assert rank_rate({"images_per_second": 3.0}, sync=False, ranks=1) == 3.0


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_one_rank_runs_ddp_and_its_compute_bound() -> None:
    """With --workers 1 the bound's one rank has nobody to differ from: it used to be refused
    as "ended with the same weights", after every other phase had run."""
    bench = TrainBench(workers=1, model="lenet", batch_size=8, steps=4, threads=1)
    assert run_ddp(bench, ["cpu"], sync=True) > 0
    assert run_ddp(bench, ["cpu"], sync=False) > 0


def test_a_one_worker_run_is_described_in_the_singular() -> None:
    # Seen on a GPU host, where one GPU means --workers 1: "1 ps-workers", "1 ranks".
    one = TrainBench(workers=1, model="resnet18", batch_size=256, steps=4, threads=1)
    lines = [describe(phase, one, ["cuda:0"]) for phase in PHASES]
    assert (
        "ps sync: ps-server + 1 ps-worker on cuda:0, 4 updates of batch 256, 1 thread each" in lines
    )
    assert "pytorch ddp: 1 rank of batch 256 on cuda:0, 1 thread each" in lines
    two = TrainBench(workers=2, model="resnet18", batch_size=64, steps=4, threads=2)
    assert (
        describe("ddp", two, ["cpu", "cpu"])
        == "pytorch ddp: 2 ranks of batch 64 on cpu, 2 threads each"
    )


def test_summary_ratios_are_over_ddp() -> None:
    bench = TrainBench(workers=2, model="lenet", batch_size=16, steps=10, threads=1, bucket_mb=0.05)
    rates = {
        "sync": 50.0, "sync_no_overlap": 40.0, "async": 75.0, "single_process": 25.0, "ddp": 100.0
    }  # fmt: skip
    results = summarize(bench, ["cpu", "cpu"], {phase: [rate] for phase, rate in rates.items()})
    assert results["images_per_second"] == rates
    assert (results["sync_over_ddp"], results["async_over_ddp"]) == (0.5, 0.75)
    assert results["overlap_gain"] == 1.25 and results["notes"] == []
    assert results["images_per_second_runs"]["sync"] == [50.0]
    assert results["single_process_over_ddp"] == 0.25


def test_a_subset_of_phases_reports_only_the_ratios_it_can() -> None:
    only = parse_phases("ddp, async,sync_sharded", (*PHASES, *SHARDED_PHASES))
    bench = TrainBench(2, "lenet", 16, 10, 1, num_shards=2, only=only)
    assert bench.phases() == ("async", "ddp", "sync_sharded")  # in the order of all phases
    rates = {"async": 60.0, "ddp": 50.0, "sync_sharded": 40.0}
    results = summarize(bench, ["cpu", "cpu"], {phase: [rate] for phase, rate in rates.items()})
    assert results["phases"] == ["async", "ddp", "sync_sharded"]
    assert (results["async_over_ddp"], results["sync_sharded_over_ddp"]) == (1.2, 0.8)
    for missing in ("sync_over_ddp", "overlap_gain", "sharded_overlap_gain"):
        assert missing not in results, missing


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--phases", "sync,ddp,warp"), "must be a comma-separated list of sync, "),
        (("--phases", "sync,async"), "must include ddp"),
        (("--phases", "sync_sharded,ddp"), "names sharded phases (sync_sharded): they need "
                                           "--num-shards 2 or more"),
    ],
)  # fmt: skip
def test_train_phases_are_checked_before_anything_runs(args: tuple[str, ...], message: str) -> None:
    result = CliRunner().invoke(command, ["train", "--steps", "4", *args])
    assert result.exit_code == 2, result.output  # a usage error
    message = f"Error: Invalid value for '--phases': {message}"
    assert result.output.strip().splitlines()[-1].startswith(message), result.output


def test_too_few_steps_is_a_usage_error() -> None:
    result = CliRunner().invoke(command, ["train", "--steps", "2"])
    assert result.exit_code == 2
    assert "--steps" in result.output


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this machine has the GPUs")
def test_cuda_without_gpus_is_one_clear_error() -> None:
    result = CliRunner().invoke(command, ["train", "--device", "cuda", "--workers", "2"])
    assert result.exit_code == 1
    assert result.output.strip().splitlines()[-1].startswith("Error: --device cuda needs 2 GPUs")
    assert "Traceback" not in result.output


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_link_runs_every_phase_on_shaped_links_and_cleans_up(tmp_path: Path) -> None:
    from psserver.bench.link import LINK_PHASES
    from psserver.bench.netns import LinkLab
    from tests.test_multihost import netns_names, skip_without_link_lab

    skip_without_link_lab()
    json_path = tmp_path / "link.json"
    result = invoke(
        "link",
        # Steps enough for every run to keep its links busy over several meter samples.
        *("--workers", "2", "--model", "lenet", "--batch-size", "16", "--steps", "8"),
        *("--mbit", "200", "--bucket-mb", "0.05", "--server-hosts", "3"),
        *("--json", str(json_path)),
    )
    results = json.loads(json_path.read_text())
    rates = results["images_per_second"]
    assert set(rates) == set(LINK_PHASES) and all(rate > 0 for rate in rates.values())
    assert results["overlap_gain"] == pytest.approx(rates["sync"] / rates["sync_no_overlap"])
    assert results["streaming_gain"] == pytest.approx(rates["sync"] / rates["sync_no_stream"])
    assert results["sharding_gain"] == pytest.approx(rates["sync_sharded"] / rates["sync"])
    assert results["link_mbit"] == 200 and results["bucket_mb"] == 0.05
    assert results["server_hosts"] == 3
    # cubic by default, or reno where the kernel keeps cubic from namespaces (and says so)
    assert results["congestion_control"] in ("cubic", "reno")
    assert f"TCP congestion control on every host: {results['congestion_control']}" in (
        result.output
    )
    assert "overlap gain:" in result.output and "streaming gain:" in result.output
    assert "| ps sync, overlap, 3 server hosts |" in result.output
    assert "link use out" in result.output
    for phase in LINK_PHASES:  # no link carries more than its rate
        assert 0 < results["link_use"][phase]["sent"] <= MAX_LINK_USE, results["link_use"]
        assert 0 < results["link_use"][phase]["received"] <= MAX_LINK_USE
    # The benchmark's lab is this process's (its names begin with LinkLab.prefix): other test
    # runs on the machine may build labs of their own meanwhile.
    prefix = LinkLab(1, 1).prefix  # built by `with` only: this one creates nothing
    left = {name for name in netns_names() if name.startswith(f"{prefix}-")}
    assert not left, f"the benchmark left network namespaces behind: {sorted(left)}"


def test_link_use_averages_the_hosts_that_took_part_over_the_busy_window() -> None:
    from psserver.bench.linkuse import Sample, link_use

    # 8 Mbit/s links carry 1 MB/s each way. Host 0 sends 3 MB to host 1 between 1 and 4 s;
    # host 1 answers with 0.75 MB; host 2 only sends 100 bytes (below 1 % of the busiest).
    def at(seconds: float, sent: tuple[int, ...], received: tuple[int, ...]) -> Sample:
        return Sample(seconds, sent, received)

    samples = [
        at(0.0, (0, 0, 0), (0, 0, 0)),
        at(1.0, (1_000, 0, 100), (0, 1_000, 0)),  # start-up chatter: not busy
        at(2.0, (1_001_000, 250_000, 100), (250_000, 1_001_000, 0)),
        at(3.0, (2_001_000, 500_000, 100), (500_000, 2_001_000, 0)),
        at(4.0, (3_001_000, 750_000, 100), (750_000, 3_001_000, 0)),
        at(5.0, (3_001_000, 750_000, 100), (750_000, 3_001_000, 0)),  # idle again
    ]
    use = link_use(samples, mbit=8)
    assert use == {
        "sent": (3_000_000 + 750_000) / (2 * 1e6 * 3),
        "received": (750_000 + 3_000_000) / (2 * 1e6 * 3),
        "busy_seconds": 3.0,
        "hosts": 2,
    }
    nothing_busy = link_use(samples[:2], mbit=8)
    assert nothing_busy["sent"] is None and nothing_busy["hosts"] == 0  # not "0 %"
    one_busy_second = link_use(samples[:3], mbit=8)  # too short a window to say
    assert one_busy_second["received"] is None and one_busy_second["busy_seconds"] == 1.0


@pytest.mark.integration
def test_a_link_meter_that_cannot_read_the_counters_does_not_fail_the_run() -> None:
    from psserver.bench.linkuse import LinkMeter, link_use
    from psserver.bench.netns import LinkLab

    lab = LinkLab(2, mbit=100)  # never entered: its bridge namespace does not exist
    with LinkMeter(lab, interval=0.01) as meter:
        pass
    assert meter.failure is not None and "could not read the link counters" in meter.failure
    assert meter.samples == [] and link_use(meter.samples, 100)["sent"] is None


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_link_meter_counts_the_bytes_a_host_sends_over_its_link() -> None:
    from psserver.bench.linkuse import LinkMeter, link_use
    from psserver.bench.netns import LinkLab
    from tests.test_multihost import skip_without_link_lab

    skip_without_link_lab()
    payload = 4 * 2**20
    receive = (
        "import socket\n"
        "server = socket.create_server(('0.0.0.0', 7000))\n"
        "print('listening', flush=True)\n"
        "connection, _ = server.accept()\n"
        f"left = {payload}\n"
        "while left:\n"
        "    left -= len(connection.recv(min(left, 1 << 20)))\n"
    )
    with LinkLab(2, mbit=100) as lab:
        receiver = subprocess.Popen(
            [*lab.prefix_for(1), sys.executable, "-c", receive], stdout=subprocess.PIPE, text=True
        )
        try:
            assert receiver.stdout is not None and receiver.stdout.readline() == "listening\n"
            send = (
                "import socket\n"
                f"socket.create_connection(('{lab.address(1)}', 7000)).sendall(bytes({payload}))\n"
            )
            with LinkMeter(lab, interval=0.05) as meter:
                subprocess.run([*lab.prefix_for(0), sys.executable, "-c", send], timeout=60)
                assert receiver.wait(timeout=60) == 0
        finally:
            receiver.kill()
    first, last = meter.samples[0], meter.samples[-1]
    sent = [b - a for a, b in zip(first.sent, last.sent, strict=True)]
    received = [b - a for a, b in zip(first.received, last.received, strict=True)]
    # The payload plus Ethernet, IP and TCP headers (about 66 bytes a 1448-byte segment).
    assert payload <= sent[0] <= payload * 1.06 and payload <= received[1] <= payload * 1.06
    assert sent[1] < payload * 0.05  # host 1 sent acknowledgements only
    use = link_use(meter.samples, mbit=100)
    # One link of the two carried the payload: on average over both, at most half a rate.
    assert use["hosts"] == 2 and 0 < use["received"] <= MAX_LINK_USE / 2, use


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_a_terminated_link_lab_still_tears_its_network_down() -> None:
    from tests.test_multihost import netns_names, skip_without_link_lab

    skip_without_link_lab()
    script = (
        "import time\n"
        "from psserver.bench.netns import LinkLab\n"
        "with LinkLab(2, 100) as lab:\n"
        "    print(lab.prefix, flush=True)\n"
        "    time.sleep(60)\n"
    )
    lab = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    left, prefix = set(), ""
    try:
        assert lab.stdout is not None
        prefix = lab.stdout.readline().strip()
        assert prefix and any(name.startswith(f"{prefix}-") for name in netns_names())
        lab.send_signal(signal.SIGTERM)
        assert lab.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        lab.kill()
        lab.wait()
        # Its own only: other test runs on the machine may build labs of their own meanwhile.
        left = {name for name in netns_names() if name.startswith(f"{prefix}-")}
        for name in left:  # so that a failure here does not leak into other tests
            subprocess.run(["ip", "netns", "del", name], check=False)
    assert not left, f"SIGTERM left network namespaces behind: {sorted(left)}"


@pytest.mark.integration
@pytest.mark.timeout(120)
@pytest.mark.parametrize("asked", ["reno", "cubic", "host"])
def test_every_lab_host_runs_the_congestion_control_asked_for(asked: str) -> None:
    from psserver.bench.netns import CONGESTION_SYSCTL, LinkLab
    from tests.test_multihost import skip_without_link_lab

    skip_without_link_lab()
    machine = subprocess.run(
        ["sysctl", "-n", CONGESTION_SYSCTL], capture_output=True, text=True, check=True
    ).stdout.strip()
    with LinkLab(3, mbit=100, congestion_control=asked) as lab:
        expected = {"reno": "reno", "cubic": lab.congestion_control, "host": machine}[asked]
        assert lab.congestion_control == expected
        if asked == "cubic":  # its fallback where this kernel keeps cubic from namespaces
            assert expected in ("cubic", "reno")
        for host in range(3):
            command = [*lab.prefix_for(host), "sysctl", "-n", CONGESTION_SYSCTL]
            output = subprocess.run(command, capture_output=True, text=True, check=True).stdout
            assert output.strip() == expected
    after = subprocess.run(
        ["sysctl", "-n", CONGESTION_SYSCTL], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert after == machine  # the machine's own setting is left as it was


def test_a_refused_congestion_control_falls_back_or_says_what_to_do(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from psserver.bench import netns

    allowed = {"reno"}  # as on this project's machine: cubic and bbr are refused
    settings: list[tuple[str, str]] = []

    def fake_run(*args: str) -> str:
        name = args[-1].split("=")[-1]
        if name not in allowed:
            raise PSError(f"`{' '.join(args)}` failed (255): Operation not permitted")
        settings.append((args[3], name))
        return ""

    monkeypatch.setattr(netns, "run_command", fake_run)
    lab = netns.LinkLab(2, mbit=100)  # cubic by default
    lab._configure_congestion_control()
    assert lab.congestion_control == "reno"
    assert settings == [(lab.hosts[0], "reno"), (lab.hosts[1], "reno")]
    assert "does not allow cubic in a network namespace; the lab's hosts run reno" in (
        capsys.readouterr().err
    )
    lab = netns.LinkLab(2, mbit=100, congestion_control="bbr")  # no fallback for bbr
    with pytest.raises(PSError, match="could not set TCP congestion control bbr on the lab's"):
        lab._configure_congestion_control()


def test_an_unknown_congestion_control_is_one_clear_error() -> None:
    from psserver.bench.netns import LinkLab

    result = CliRunner().invoke(command, ["link", "--congestion-control", "vegas"])
    assert result.exit_code == 2 and "'vegas' is not one of" in result.output
    with pytest.raises(PSError, match="unknown TCP congestion control 'vegas'; use one of"):
        LinkLab(2, mbit=100, congestion_control="vegas")


def test_link_reports_only_the_phases_it_ran() -> None:
    from psserver.bench.link import LINK_PHASES, LinkBench, link_report, summarize_link
    from psserver.bench.trainbench import TrainBench

    train = TrainBench(4, "lenet", 16, 4, 1, "cpu", 60.0, 1, 8.0)
    bench = LinkBench(train, 100.0, 4, parse_phases("ddp, sync_sharded,sync", LINK_PHASES))
    assert bench.phases == ("sync", "sync_sharded", "ddp") and bench.hosts == 8
    runs = {"sync": [30.0, 40.0], "sync_sharded": [60.0], "ddp": [50.0]}
    results = summarize_link(bench, runs, congestion_control="reno")
    assert results["congestion_control"] == "reno"
    assert results["images_per_second"] == {"sync": 35.0, "sync_sharded": 60.0, "ddp": 50.0}
    assert (results["sync_over_ddp"], results["sync_sharded_over_ddp"]) == (0.7, 1.2)
    assert results["sharding_gain"] == 60.0 / 35.0
    assert "overlap_gain" not in results and "streaming_gain" not in results
    report = link_report(bench, results)
    assert "| ps sync, overlap, 4 server hosts | 60.00 | 1.20 |" in report
    assert report.splitlines()[-1] == "sharding gain: 1.71"


@pytest.mark.parametrize(
    ("phases", "message"),
    [
        ("sync,ddp,warp", "must be a comma-separated list of sync, "),
        ("sync,sync_sharded", "must include ddp"),
    ],
)
def test_link_phases_are_checked_before_anything_runs(phases: str, message: str) -> None:
    result = CliRunner().invoke(command, ["link", "--steps", "4", "--phases", phases])
    assert result.exit_code == 2
    last = result.output.strip().splitlines()[-1]
    assert last.startswith(f"Error: Invalid value for '--phases': {message}"), result.output


def test_link_without_root_is_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    result = CliRunner().invoke(command, ["link", "--steps", "4"])
    assert result.exit_code == 1
    assert result.output.strip().splitlines()[-1] == (
        "Error: ps-bench link needs root: it creates network namespaces and shapes links"
    )


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_the_floor_server_waits_for_its_last_replies_to_arrive(tmp_path: Path) -> None:
    """Over a slow link the floor's last reply is still on its way when the server's rounds
    are done; it must not be dropped by the server closing (the client would never finish)."""
    from common.roles import command_args
    from psserver.bench import floor
    from psserver.bench.netns import LinkLab
    from tests.test_multihost import skip_without_link_lab

    skip_without_link_lab()
    python = (sys.executable, "-m", floor.SERVER.module)
    size = {"nbytes": 10_000_000, "rounds": 3}  # 0.8 s a reply at 100 Mbit/s
    with LinkLab(2, mbit=100) as lab:
        endpoint = f"tcp://{lab.address(0)}:5555"
        told = {"bind": endpoint, "clients": 1, "endpoint_file": tmp_path / "ep"}
        server = subprocess.Popen(
            [*lab.prefix_for(0), *python, *command_args(floor.SERVER, told, size,
             {"out": tmp_path / "server.json"})],
        )  # fmt: skip
        client = subprocess.run(
            [*lab.prefix_for(1), *python, *command_args(floor.CLIENT, {"endpoint": endpoint},
             size, {"out": tmp_path / "client.json"})],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert server.wait(timeout=60) == 0
    assert client.returncode == 0, client.stderr
    rounds = json.loads((tmp_path / "client.json").read_text())["round_seconds"]
    assert len(rounds) == 3 and min(rounds) > 0.8  # 10 MB each way over 100 Mbit/s


@pytest.mark.integration
def test_a_process_group_wait_ends_when_its_watch_reports_a_failure_elsewhere() -> None:
    calls: list[float] = []

    def watch() -> None:  # as a group's `finished` raises for a failed process
        calls.append(time.monotonic())
        if len(calls) == 3:
            raise PSError("ps sync: shard 1 died")

    with ProcessGroup() as group:
        sleeper = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True
        )
        group.children.append(("server", sleeper))  # a server that would run on for minutes
        with pytest.raises(PSError, match="shard 1 died"):
            group.wait(600, "ps sync", watch=watch)
        # The third watch ended the wait, while the server still ran.
        assert len(calls) == 3 and sleeper.poll() is None
    assert sleeper.poll() is not None  # killed on the way out


@pytest.mark.integration
def test_local_clients_stop_at_once_when_their_server_dies() -> None:
    """The clients of a phase wait up to minutes for a silent server; a server that died
    ends the phase at once, with its own exit code (it used to end 2 minutes later, with
    the clients' "no reply")."""
    with ProcessGroup() as group:
        dying = subprocess.Popen(
            [sys.executable, "-c", "import sys, time; time.sleep(0.5); sys.exit(3)"],
            start_new_session=True,
        )
        group.children.append(("server", dying))
        job = ClientJob("floor", f"tcp://127.0.0.1:{free_port()}", 3, 1000)  # nobody there
        with pytest.raises(PSError, match="floor: server exited with code 3"):
            run_clients(group, "floor", job, 2)
        # The phase ended on the server's exit, while its clients still waited for it.
        assert group.running() == [job.process_name(0), job.process_name(1)], group.running()


@pytest.mark.integration
def test_a_server_that_exits_before_listening_is_named_with_its_own_log() -> None:
    """The floor's server on a busy --port: the error said "server exited with code 1: (no
    output)", read from server.log; its output is in floor-server.log."""
    with ProcessGroup() as group:
        server = group.start("floor-server", "psserver.bench.floor", "server", "--no-such-option")
        with pytest.raises(PSError) as failed:
            group.endpoint("floor.endpoint", server, "floor")
    message = str(failed.value)
    assert message.startswith("floor: floor-server exited with code 2: "), message
    assert "No such option '--no-such-option'" in message, message


@pytest.mark.integration
@pytest.mark.timeout(120)
@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads children from /proc")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_signal_stops_ps_bench_and_every_process_it_started(
    tmp_path: Path, sig: signal.Signals
) -> None:
    """kill (or a CI timeout, or a closed SSH session) must not leave the floor's server and
    clients running: they are in sessions of their own, so only ps-bench can stop them; and
    after a SIGKILL, which ps-bench cannot handle, the kernel tells them (PR_SET_PDEATHSIG)."""
    bench = subprocess.Popen(
        [sys.executable, "-m", "psserver.bench.cli", "comm", "--workers", "2", "--model",
         "lenet", "--rounds", "100000"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp_path,
    )  # fmt: skip
    children: list[int] = []
    try:
        children_file = Path(f"/proc/{bench.pid}/task/{bench.pid}/children")
        deadline = time.monotonic() + 60
        while len(children) < 3 and time.monotonic() < deadline:  # a server and 2 clients
            children = [int(pid) for pid in children_file.read_text().split()]
            time.sleep(0.2)
        assert len(children) >= 3, children
        bench.send_signal(sig)
        assert bench.wait(timeout=30) == (128 + sig if sig == signal.SIGTERM else -sig)
        assert all_exit(children, timeout=10)
    finally:
        bench.kill()
        bench.wait()
        for pid in children:  # what a failed run left behind
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("subcommand", ["comm", "train", "straggler"])
@pytest.mark.parametrize("flag", ["--json", "--plot"])
def test_an_output_path_that_cannot_be_written_is_refused_before_any_run(
    tmp_path: Path, subcommand: str, flag: str
) -> None:
    """It used to fail after every run, with a traceback, and the results were lost."""
    (tmp_path / "afile").write_text("")
    result = CliRunner().invoke(command, [subcommand, flag, str(tmp_path / "afile" / "out")])
    assert result.exit_code == 2, result.output
    assert f"Invalid value for '{flag}'" in result.output
    assert "cannot write a file there" in result.output
    assert "[1/" not in result.output  # nothing ran


@pytest.mark.parametrize("subcommand", ["comm", "train", "straggler"])
def test_a_plot_in_a_format_matplotlib_cannot_write_is_refused_before_any_run(
    tmp_path: Path, subcommand: str
) -> None:
    """`--plot same.out` ended every run in a traceback (Format 'out' is not supported), and
    `--plot plot` wrote plot.png unasked."""
    for name in ("same.out", "plot"):
        result = CliRunner().invoke(command, [subcommand, "--plot", str(tmp_path / name)])
        assert result.exit_code == 2, result.output
        assert "does not end in a picture format; name a .png file" in result.output
        assert "[1/" not in result.output  # nothing ran


@pytest.mark.parametrize("phases", ["", ","])
def test_train_phases_of_nothing_are_refused_not_taken_for_every_phase(phases: str) -> None:
    result = CliRunner().invoke(command, ["train", "--phases", phases])
    assert result.exit_code == 2, result.output
    assert "'--phases': must be a comma-separated list of" in result.output
    assert result.output.strip().endswith("got nothing"), result.output


def test_results_that_cannot_be_written_at_the_end_are_shown_in_one_error(
    tmp_path: Path,
) -> None:
    from common.errors import PSError
    from psserver.bench.report import write_json

    (tmp_path / "afile").write_text("")
    with pytest.raises(PSError, match=r"(?s)could not write the results to .*\"rounds\": 3"):
        write_json(tmp_path / "afile" / "out.json", {"rounds": 3})


def test_a_follower_shard_starts_without_the_users_ps_variables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A follower refuses job options given as PS_ variables (it takes the job from the
    leader): one a user exported for the bench's server must not reach the followers."""
    monkeypatch.setenv("PS_LR", "0.3")
    seen: dict[str, str | None] = {}

    class Recorded:
        def __init__(self, argv: list[str], env: dict[str, str], **_: object) -> None:
            seen[argv[-1]] = env.get("PS_LR")

        def poll(self) -> int:
            return 0

    monkeypatch.setattr(subprocess, "Popen", Recorded)
    with ProcessGroup() as group:
        group.start("server", "psserver.cli.server", "leader")
        group.start("shard1", "psserver.cli.server", "follower", follower=True)
    assert seen == {"leader": "0.3", "follower": None}


def test_train_runs_take_turns_each_starting_one_phase_later() -> None:
    """ps-bench train ran its phases in one fixed order every turn, so DDP always ran right
    after the single process; comm already rotated. Both now share this order."""
    assert in_turns(["sync", "async", "ddp"], 3) == [
        *("sync", "async", "ddp"),
        *("async", "ddp", "sync"),
        *("ddp", "sync", "async"),
    ]
    assert in_turns(list(PHASES), 1) == list(PHASES)


def test_a_client_that_timed_fewer_rounds_is_not_quietly_cut() -> None:
    assert _per_round([[0.1, 0.3], [0.2, 0.2]]) == [0.2, 0.3]
    with pytest.raises(PSError, match=r"timed \[2, 1\] rounds"):
        _per_round([[0.1, 0.3], [0.2]])


def test_train_warns_when_an_epoch_ends_inside_the_timed_steps() -> None:
    """The server evaluates at an epoch's end while its workers wait; DDP has no such pause."""
    bench = TrainBench(workers=2, model="lenet", batch_size=64, steps=47, threads=1)
    # The embedded set's 6000 images / 2 / 64: 47 steps an epoch.
    assert bench.epoch_steps() == 47 and bench.epoch_end_inside() is None
    longer = TrainBench(workers=2, model="lenet", batch_size=64, steps=48, threads=1)
    warning = longer.epoch_end_inside()
    assert warning is not None and "--steps 47 avoids it" in warning
    # An epoch of 2 steps: --steps 2 is refused, so the advice is a smaller batch.
    huge = TrainBench(workers=2, model="lenet", batch_size=2000, steps=3, threads=1)
    warning = huge.epoch_end_inside()
    assert warning is not None and warning.endswith("; a smaller --batch-size avoids it")


def test_a_plot_of_repeated_runs_shows_their_spread(tmp_path: Path) -> None:
    labels, values = ["ps sync", "pytorch ddp"], [65.8, 66.3]
    plain, spread = tmp_path / "plain.png", tmp_path / "spread.png"
    bar_plot(plain, "t", labels, values, "images per second")
    bar_plot(spread, "t", labels, values, "images per second", [(64.7, 67.9), (63.9, 67.8)])
    assert spread.read_bytes().startswith(PNG_MAGIC)
    assert spread.read_bytes() != plain.read_bytes()  # the whiskers are drawn
    with pytest.raises(ValueError):  # one span per bar, or none
        bar_plot(spread, "t", labels, values, "images per second", [(64.7, 67.9)])
