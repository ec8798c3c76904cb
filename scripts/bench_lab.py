"""`ps-bench comm --agent` or `ps-bench train --agent` across the link lab: the servers and
each worker on hosts of their own.

It builds `ps-bench link`'s lab (a network namespace per host on a bridge, every link shaped
to --mbit each way; needs root), starts `ps-bench agent` on hosts 1..N (and on
--shard-agents more, for the follower shards of --num-shards) and runs
`ps-bench comm --agent ...` (or `train`, with --bench train) on host 0, so that everything
is measured over real (shaped) links, as on a cluster. The hosts still share this machine's
cores. Every argument after the options goes to `ps-bench comm` or `train`:

    sudo python scripts/bench_lab.py --bench comm --mbit 1000 -- --workers 2 \\
        --model resnet18 --rounds 10 --repeat 2 --json benchmarks/comm-resnet18-2w-1gbit-lab.json
    sudo python scripts/bench_lab.py --bench comm --mbit 1000 --shard-agents 1 -- --num-shards 2 ...
    sudo python scripts/bench_lab.py --bench train --mbit 100 -- --workers 2 --model resnet18 ...
    sudo python scripts/bench_lab.py --bench train --mbit 100 --shard-agents 1 -- --num-shards 2 ...
"""

import argparse
import subprocess
import sys
import time

from common.logs import counted
from psserver.bench.agentwire import DEFAULT_AGENT_PORT
from psserver.bench.netns import LinkLab

AGENT_START_S = 30.0


def wait_for_port(lab: LinkLab, host: int) -> None:
    """Until the agent on `host` listens (checked from inside its namespace)."""
    deadline = time.monotonic() + AGENT_START_S
    address = f"{lab.address(host)}:{DEFAULT_AGENT_PORT}"
    while time.monotonic() < deadline:
        listening = subprocess.run(
            [*lab.prefix_for(host), "ss", "-Hltn", f"src {address}"], capture_output=True, text=True
        ).stdout
        if listening.strip():
            return
        time.sleep(0.2)
    sys.exit(f"the agent on lab host {host} did not listen on {address}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--bench", choices=("comm", "train"), default="comm", help="what to run")
    parser.add_argument("--mbit", type=float, default=1000.0, help="every link's rate each way")
    parser.add_argument("--agents", type=int, default=2, help="worker hosts, one agent each")
    parser.add_argument(
        "--shard-agents",
        type=int,
        default=0,
        help="server hosts beside the leader's, one agent each, for --num-shards' followers",
    )
    parser.add_argument("bench_args", nargs=argparse.REMAINDER, help="-- then the benchmark's")
    args = parser.parse_args()
    bench_args = [a for a in args.bench_args if a != "--"]
    workers = range(1, 1 + args.agents)  # lab hosts: 0 the leader's, then workers, then shards
    shards = range(1 + args.agents, 1 + args.agents + args.shard_agents)
    with LinkLab(1 + args.agents + args.shard_agents, mbit=args.mbit) as lab:
        print(f"lab: {counted(len(lab.hosts), 'host')}, {args.mbit:g} Mbit/s links, "
              f"TCP {lab.congestion_control}", file=sys.stderr)  # fmt: skip
        agents = []
        for host in [*workers, *shards]:
            bind = f"tcp://{lab.address(host)}:{DEFAULT_AGENT_PORT}"
            agent = [sys.executable, "-m", "psserver.bench.cli", "agent", "--bind", bind]
            agents.append(subprocess.Popen([*lab.prefix_for(host), *agent, "--log-level", "error"]))
        try:
            for host in [*workers, *shards]:
                wait_for_port(lab, host)
            agent_args = [f"--agent={lab.address(host)}" for host in workers]
            agent_args += [f"--shard-agent={lab.address(host)}" for host in shards]
            bench = [sys.executable, "-m", "psserver.bench.cli", args.bench, *agent_args]
            code = subprocess.run([*lab.prefix_for(0), *bench, *bench_args]).returncode
        finally:
            for agent in agents:
                agent.terminate()
                agent.wait()
    sys.exit(code)


if __name__ == "__main__":
    main()
