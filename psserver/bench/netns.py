"""A small network of hosts on one machine, for `ps-bench link`: Linux network namespaces on a
bridge, each host's link shaped to a given rate in both directions (tc tbf).

    <prefix>-h0  eth0 10.213.11.1   ─┐
    <prefix>-h1  eth0 10.213.11.2   ─┼─ br0 in <prefix>-br
    ...                              ─┘

Nothing is attached to the root namespace's network and there are no routes out, so no packet
leaves these namespaces. Needs root, `ip` and `tc`; `LinkLab.why_not` says what is missing.
This is what a rack of machines with one NIC each looks like, minus their CPUs: every host
here shares this machine's cores.

Every host also gets its own TCP congestion control (a per-namespace setting), by default
cubic, Linux's default and what most clusters run. Left alone, the hosts would inherit this
machine's, and that may be something else, such as BBR. It matters for
a parameter server, whose 4 x 4 workers-to-shards exchange puts 4 flows into every link.
Over these shaped links BBR shared them so unevenly that the same bytes took 5.3 to 6.3 s
a step instead of 4.7 s with reno (see BENCHMARKS.md). A kernel that refuses cubic to a
namespace gets reno, its predecessor, which cubic equals at these short round trips.
"""

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
from types import TracebackType
from typing import Any

from common.cli import exit_on_signal
from common.errors import PSError

SUBNET = "10.213.11"
COMMAND_TIMEOUT_S = 30
CONGESTION_CONTROLS = ("cubic", "reno", "bbr", "host")  # host: keep this machine's
CONGESTION_FALLBACK = {"cubic": "reno"}  # for a kernel that does not allow the first
CONGESTION_SYSCTL = "net.ipv4.tcp_congestion_control"


def run_command(*args: str) -> str:
    """Run one setup command; a failure names the command and shows its stderr."""
    result = subprocess.run(args, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    if result.returncode != 0:
        raise PSError(f"`{' '.join(args)}` failed ({result.returncode}): {result.stderr.strip()}")
    return result.stdout


class LinkLab:
    """`with LinkLab(hosts, mbit) as lab:` builds the network and always tears it down."""

    def __init__(self, hosts: int, mbit: float, congestion_control: str = "cubic") -> None:
        if congestion_control not in CONGESTION_CONTROLS:
            raise PSError(
                f"unknown TCP congestion control {congestion_control!r}; use one of "
                f"{', '.join(CONGESTION_CONTROLS)}"
            )
        self.prefix = f"psb{os.getpid()}"
        self.hosts = [f"{self.prefix}-h{i}" for i in range(hosts)]
        self.bridge = f"{self.prefix}-br"
        self.mbit = mbit
        self.requested_congestion_control = congestion_control
        self.congestion_control = ""  # what the hosts run, known once the lab is built
        self._created: list[str] = []
        self._previous_sigterm: Any = None

    @staticmethod
    def why_not() -> str | None:
        """None when this machine can build the lab, else why not (and what to do)."""
        if os.geteuid() != 0:
            return "ps-bench link needs root: it creates network namespaces and shapes links"
        missing = [tool for tool in ("ip", "tc", "sysctl") if shutil.which(tool) is None]
        if missing:
            return (
                f"ps-bench link needs {' and '.join(missing)} on PATH (install iproute2 and procps)"
            )
        return None

    def address(self, host: int) -> str:
        return f"{SUBNET}.{host + 1}"

    def prefix_for(self, host: int) -> tuple[str, ...]:
        """The command prefix that runs a program on host `host`."""
        return ("ip", "netns", "exec", self.hosts[host])

    def __enter__(self) -> "LinkLab":
        reason = self.why_not()
        if reason is not None:
            raise PSError(reason)
        # SIGTERM (kill, a CI timeout) would end Python without unwinding, and leave the
        # namespaces and what runs in them behind: make it unwind through __exit__ instead.
        if threading.current_thread() is threading.main_thread():
            self._previous_sigterm = signal.signal(signal.SIGTERM, exit_on_signal)
        try:
            self._build()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.teardown()

    def _build(self) -> None:
        for namespace in [self.bridge, *self.hosts]:
            run_command("ip", "netns", "add", namespace)
            self._created.append(namespace)
        run_command("ip", "-n", self.bridge, "link", "add", "br0", "type", "bridge")
        run_command("ip", "-n", self.bridge, "link", "set", "br0", "up")
        # tbf: the rate, a burst of 1 ms at that rate (at least 64 KB), and a queue that
        # holds 400 ms of traffic before dropping.
        rate = f"{self.mbit}mbit"
        burst = f"{max(64, int(self.mbit * 1000 / 8 / 1000))}kb"
        shape = ("root", "tbf", "rate", rate, "burst", burst, "latency", "400ms")
        for index, namespace in enumerate(self.hosts):
            port = f"port{index}"
            # Both ends are created straight inside their namespaces: never in the root one.
            run_command(
                "ip", "-n", self.bridge, "link", "add", port, "type", "veth",
                "peer", "name", "eth0", "netns", namespace,
            )  # fmt: skip
            run_command("ip", "-n", self.bridge, "link", "set", port, "master", "br0", "up")
            run_command("ip", "-n", namespace, "link", "set", "lo", "up")
            run_command(
                "ip", "-n", namespace, "addr", "add", f"{self.address(index)}/24", "dev", "eth0"
            )
            run_command("ip", "-n", namespace, "link", "set", "eth0", "up")
            # Out of the host, and into it (the bridge's egress towards the host).
            run_command(
                "ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", "eth0", *shape
            )
            run_command(
                "ip", "netns", "exec", self.bridge, "tc", "qdisc", "add", "dev", port, *shape
            )
        self._configure_congestion_control()

    def _configure_congestion_control(self) -> None:
        """Decide on the first host, then give every other host the same."""
        self.congestion_control = self._choose_congestion_control(self.hosts[0])
        if self.requested_congestion_control != "host":
            for namespace in self.hosts[1:]:
                self._set_congestion_control(namespace, self.congestion_control)

    def _choose_congestion_control(self, namespace: str) -> str:
        """What the hosts run: the machine's (read on the first host) for `host`, else the
        congestion control asked for or its fallback, whichever the first host accepts."""
        wanted = self.requested_congestion_control
        if wanted == "host":
            return run_command(
                "ip", "netns", "exec", namespace, "sysctl", "-n", CONGESTION_SYSCTL
            ).strip()
        candidates = [
            wanted,
            *([CONGESTION_FALLBACK[wanted]] if wanted in CONGESTION_FALLBACK else []),
        ]
        refusals = []
        for name in candidates:
            try:
                self._set_congestion_control(namespace, name)
            except PSError as exc:
                refusals.append(str(exc))
                continue
            if name != wanted:
                print(
                    f"ps-bench link: this kernel does not allow {wanted} in a network namespace; "
                    f"the lab's hosts run {name}",
                    file=sys.stderr,
                )
            return name
        raise PSError(
            f"could not set TCP congestion control {' or '.join(candidates)} on the lab's "
            f"hosts ({'; '.join(refusals)}); pick another with --congestion-control, or host "
            "to keep this machine's"
        )

    @staticmethod
    def _set_congestion_control(namespace: str, name: str) -> None:
        run_command("ip", "netns", "exec", namespace, "sysctl", "-w", f"{CONGESTION_SYSCTL}={name}")

    def teardown(self) -> None:
        """Kill what still runs inside, then delete the namespaces; best effort."""
        if self._previous_sigterm is not None:
            signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None
        for namespace in reversed(self._created):
            with contextlib.suppress(PSError, subprocess.TimeoutExpired):
                for pid in run_command("ip", "netns", "pids", namespace).split():
                    with contextlib.suppress(ProcessLookupError, ValueError):
                        os.kill(int(pid), 9)
            with contextlib.suppress(PSError, subprocess.TimeoutExpired):
                run_command("ip", "netns", "del", namespace)
        self._created = []
