"""How busy the links of a `LinkLab` were during a run: `ps-bench link`'s link-use columns.

Images per second say which system is faster; they do not say whether it was the links. A
`LinkMeter` reads every host's byte counters a few times a second while a run goes on (one
`ip -s link` in the bridge's namespace: a bridge port's received bytes are what its host
sent), and `link_use` turns them into the fraction of each link's rate that was used, each
way, over the run's busy window. A system that moves fewer bytes at the same speed shows
lower use; one that waits between transfers shows idle time. The counters see whole
frames, so Ethernet, IP and TCP headers (about 4 % of a full 1500-byte packet) and the
acknowledgements count as use too, as they take the link's time.

This is a diagnostic of the benchmark, not of the system: on a real cluster, read the
NICs' counters instead.
"""

import dataclasses
import json
import subprocess
import threading
import time
from typing import Any

from common.errors import PSError
from psserver.bench.netns import LinkLab, run_command

# One sample costs an `ip` command (about 2 ms of CPU): 10 a second take 2 % of a core.
SAMPLE_INTERVAL_S = 0.1
# A busy window of fewer sample intervals says little: its traffic may have taken any part of
# its first and last interval. A short run (DDP's few steps of LeNet) moved its bytes within
# one or two, or below the threshold in every one, and was reported as 0 % used; it is now
# reported as not measured (None: "n/a" in the table).
MIN_BUSY_INTERVALS = 3
# The busy window runs from the first to the last sample in which the busiest host moved at
# least this fraction of its link's rate: it leaves out process start-up and shut-down.
BUSY_THRESHOLD = 0.05
# Hosts that moved less than this fraction of the busiest host's bytes did not take part
# (DDP leaves the server hosts idle) and are not averaged in.
IDLE_HOST_FRACTION = 0.01


@dataclasses.dataclass(frozen=True)
class Sample:
    seconds: float  # time.monotonic()
    sent: tuple[int, ...]  # bytes each host sent so far, host 0 first
    received: tuple[int, ...]  # bytes each host received so far


def read_counters(lab: LinkLab) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Every host's (sent, received) byte counters, from its bridge port."""
    ports = json.loads(run_command("ip", "-n", lab.bridge, "-s", "-j", "link", "show"))
    by_name = {port["ifname"]: port.get("stats64", {}) for port in ports}
    sent, received = [], []
    for host in range(len(lab.hosts)):
        stats = by_name.get(f"port{host}")
        if stats is None:
            raise PSError(f"the link lab has no port{host} on its bridge; was it torn down?")
        sent.append(int(stats["rx"]["bytes"]))  # the port receives what its host sends
        received.append(int(stats["tx"]["bytes"]))
    return tuple(sent), tuple(received)


class LinkMeter:
    """`with LinkMeter(lab) as meter:` samples the counters on a thread until the block ends;
    then `meter.samples` holds them, and `link_use(meter.samples, lab.mbit)` sums them up.

    A meter never fails the run it watches: if the counters cannot be read, it stops
    sampling and `failure` says why."""

    def __init__(self, lab: LinkLab, interval: float = SAMPLE_INTERVAL_S) -> None:
        self.lab, self.interval = lab, interval
        self.samples: list[Sample] = []
        self.failure: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="link-meter", daemon=True)

    def _sample(self) -> None:
        if self.failure is not None:
            return
        try:
            sent, received = read_counters(self.lab)
        except (PSError, OSError, subprocess.TimeoutExpired, ValueError, KeyError) as exc:
            self.failure = f"could not read the link counters: {exc}"
            return
        self.samples.append(Sample(time.monotonic(), sent, received))

    def _run(self) -> None:
        while not self._stop.wait(self.interval) and self.failure is None:
            self._sample()

    def __enter__(self) -> "LinkMeter":
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._sample()


def link_use(samples: list[Sample], mbit: float) -> dict[str, Any]:
    """The fraction of the link rate the taking-part hosts used, each way, on average over the
    busy window: {"sent", "received", "busy_seconds", "hosts"}; sent and received are None
    when the window is shorter than MIN_BUSY_INTERVALS samples (the run was too short)."""
    rate = mbit * 1e6 / 8  # bytes per second, each way
    busy = [
        i
        for i in range(1, len(samples))
        if _moved(samples[i - 1], samples[i]) >= BUSY_THRESHOLD * rate * _gap(samples, i)
    ]
    if not busy or busy[-1] - busy[0] + 1 < MIN_BUSY_INTERVALS:
        seconds = samples[busy[-1]].seconds - samples[busy[0] - 1].seconds if busy else 0.0
        return {"sent": None, "received": None, "busy_seconds": seconds, "hosts": 0}
    first, last = samples[busy[0] - 1], samples[busy[-1]]
    seconds = last.seconds - first.seconds
    sent = [b - a for a, b in zip(first.sent, last.sent, strict=True)]
    received = [b - a for a, b in zip(first.received, last.received, strict=True)]
    moved = [s + r for s, r in zip(sent, received, strict=True)]
    hosts = [h for h, total in enumerate(moved) if total >= IDLE_HOST_FRACTION * max(moved)]
    return {
        "sent": sum(sent[h] for h in hosts) / (len(hosts) * rate * seconds),
        "received": sum(received[h] for h in hosts) / (len(hosts) * rate * seconds),
        "busy_seconds": seconds,
        "hosts": len(hosts),
    }


def _moved(before: Sample, after: Sample) -> int:
    """Bytes the busiest host sent or received between two samples."""
    return max(
        max(b - a for a, b in zip(before.sent, after.sent, strict=True)),
        max(b - a for a, b in zip(before.received, after.received, strict=True)),
    )


def _gap(samples: list[Sample], i: int) -> float:
    return samples[i].seconds - samples[i - 1].seconds
