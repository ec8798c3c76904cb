"""Bounded staleness end to end: with a straggler, async lets the fast worker run far ahead,
SSP holds it within --staleness steps of the slowest."""

import json

import pytest

from tests.harness import Cluster


def run_with_straggler(cluster: Cluster, mode: str) -> dict:
    summary = cluster.workdir / f"{mode}.json"
    _, endpoint = cluster.start_server(
        "--mode",
        mode,
        "--staleness",
        "2",
        "--model",
        "lenet",
        "--workers",
        "2",
        "--train-limit",
        "640",
        "--batch-size",
        "32",
        "--test-limit",
        "100",
        "--summary",
        str(summary),
        name=f"{mode}-server",
    )
    cluster.start_worker(endpoint, name=f"{mode}-fast")
    cluster.start_worker(endpoint, "--step-delay", "0.15", name=f"{mode}-slow")
    cluster.wait_all(timeout=120)
    return json.loads(summary.read_text())


@pytest.mark.timeout(240)
def test_ssp_bounds_staleness_that_async_does_not(cluster: Cluster) -> None:
    free = run_with_straggler(cluster, "async")
    bounded = run_with_straggler(cluster, "ssp")
    for summary in (free, bounded):
        assert summary["global_steps"] == 20  # every batch of both shards, once
    # Two workers, bound 2: the slow one's gradient can be at most 3 updates old.
    assert bounded["staleness"]["max"] <= 3, bounded["staleness"]
    assert free["staleness"]["max"] > bounded["staleness"]["max"], free["staleness"]
