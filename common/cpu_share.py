"""How many torch CPU threads a role takes when it was not given --threads: its share of this
host's cores, among the ps-server and ps-worker processes running on the host.

torch's own choice is every core for every process. A server and two workers started by hand
on one 2-core host then ran six compute threads on two cores, and OpenMP threads spin while
they wait for each other: LeNet trained at about 150 img/s, against 2000 with one thread
each. A role without --threads takes `usable_cores() // roles` threads, at least one, where
`roles` counts the ps-server and ps-worker processes of this host, itself included. It counts
again every RECOUNT_S while it trains, and gives threads back (or takes them) as roles come
and go: a server started before its workers first sees only itself.

Cores are the ones this process may run on (its CPU affinity), and no more than a cgroup v2
CPU limit allows (a container's `cpu: 2` on a 64-core node: torch took 64 threads). Without
/proc (not Linux) a role counts only itself.

What it is not: a scheduler. A role given --threads keeps its number, and counts for the
others like any role; processes that are not ps-train's are not counted. ps-local gives every
child --threads itself, the same share.
"""

import itertools
import logging
import math
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from common.logs import counted

log = logging.getLogger("ps")
ROLES = ("ps-server/ps-worker process", "ps-server/ps-worker processes")  # for counted()
RECOUNT_S = 2.0  # a count reads /proc/*/cmdline: 1.5 ms on a host of 100 processes
ROLE_SCRIPTS = ("ps-server", "ps-worker")  # console scripts; ps-local only supervises
ROLE_MODULES = ("psserver.cli.server", "psworker.cli")
PROC = Path("/proc")
CGROUP = Path("/sys/fs/cgroup")


def usable_cores() -> int:
    """The cores this process may run on (its affinity), within its cgroup's CPU limit."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    limit = cgroup_cpu_limit()
    return max(1, min(cores, limit)) if limit is not None else cores


def cgroup_cpu_limit(proc: Path = PROC, cgroup: Path = CGROUP) -> int | None:
    """The CPU limit of this process's cgroup (v2 `cpu.max`), rounded up to whole cores; None
    without one (no limit, cgroup v1, not Linux)."""
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None
    own = next((line[3:] for line in lines if line.startswith("0::")), "/")
    # The process's own group, else the root one (a container sees its group as the root).
    for folder in (cgroup / own.lstrip("/"), cgroup):
        try:
            quota, period = (folder / "cpu.max").read_text().split()[:2]
        except (OSError, ValueError):
            continue
        if quota == "max":
            return None
        try:
            return max(1, math.ceil(int(quota) / int(period)))
        except (ValueError, ZeroDivisionError):
            return None
    return None


def is_role(argv: list[str]) -> bool:
    """Whether a command line runs ps-server or ps-worker: as its console script, as
    `python -m`, or as a leader starts its followers (common.startup.command_line)."""
    if any(Path(arg).name in ROLE_SCRIPTS for arg in argv[:2]):
        return True
    for option, value in itertools.pairwise(argv[1:]):  # interpreter options, up to -m or -c
        if option == "-m":
            return value in ROLE_MODULES
        if option == "-c":
            return any(f"run_command({module!r}" in value for module in ROLE_MODULES)
        if not option.startswith("-"):  # a script: what follows are its arguments
            return False
    return False


def command_lines(proc: Path = PROC) -> Iterable[tuple[int, list[str]]]:
    """(pid, argv) of every process of this host that can be read; none without /proc."""
    try:
        entries = list(proc.iterdir())
    except OSError:
        return
    for entry in entries:
        if not entry.name.isdigit():
            continue
        try:
            raw = (entry / "cmdline").read_bytes()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        yield int(entry.name), raw.decode(errors="replace").split("\0")[:-1]


def count_roles(proc: Path = PROC) -> int:
    """ps-server and ps-worker processes on this host: this one and the others."""
    own = os.getpid()
    return 1 + sum(1 for pid, argv in command_lines(proc) if pid != own and is_role(argv))


def share_of(cores: int, roles: int) -> int:
    """Threads for one of `roles` processes on `cores` cores: together no more than the cores
    (at least one each: with more roles than cores, single-threaded ones take turns)."""
    return max(1, cores // max(1, roles))


class CpuShare:
    """A role's torch CPU threads: `given` (--threads), or its share of the host (the module
    doc), set now and counted again by `recount` from the thread that computes (torch sets
    the threads of the thread that calls it)."""

    def __init__(
        self,
        given: int | None,
        count: Callable[[], int] = count_roles,
        cores: Callable[[], int] = usable_cores,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.given, self._count, self._cores, self._clock = given, count, cores, clock
        self._counted_at = clock()
        self.roles: int | None = None  # counted, without --threads
        if given is not None:
            self.threads = given
            torch.set_num_threads(given)
            return
        self.roles, cores_now = count(), cores()
        self.threads = share_of(cores_now, self.roles)
        torch.set_num_threads(self.threads)
        log.info(
            "using %s: %s shared by %s on this host (--threads to choose)",
            counted(self.threads, "CPU thread"), counted(cores_now, "core"),
            counted(self.roles, *ROLES),
        )  # fmt: skip

    def recount(self) -> None:
        """Count the roles again if RECOUNT_S has passed, and take the new share."""
        if self.given is not None or self._clock() - self._counted_at < RECOUNT_S:
            return
        self._counted_at = self._clock()
        roles = self._count()
        threads = share_of(self._cores(), roles)
        if threads != self.threads:
            log.info(
                "%s on this host now: using %s instead of %d",
                counted(roles, *ROLES),
                counted(threads, "CPU thread"), self.threads,
            )  # fmt: skip
            torch.set_num_threads(threads)
            self.threads = threads
        self.roles = roles
