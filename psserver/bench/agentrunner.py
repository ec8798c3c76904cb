"""A `ps-bench agent`'s one job at a time: started from a checked request, watched until its
processes end (or its deadline passes), answered with their results or their failure, and
ended, its processes stopped.

What this is not: the agent's socket and which request does what (psserver.bench.agent), nor
the job's processes and command lines (psserver.bench.agentjob), nor the checks of a request
(psserver.bench.agentwire).
"""

import logging
import time
from collections.abc import Callable
from typing import Any

from common.errors import PSError
from psserver.bench.agentjob import Job, describe_shards, follower_args, shard_threads, work_for
from psserver.bench.agentwire import BadRequest, check_target
from psserver.bench.procs import ProcessGroup
from psserver.bench.trainjob import TrainJob
from psserver.shards.auth import write_secret_file

log = logging.getLogger("ps.bench.agent")
# Answers a peer's request: (its identity, the request's id, the reply's fields).
Reply = Callable[..., None]


class JobRunner:
    def __init__(self, host: str, reply: Reply) -> None:
        self.host = host  # named in a failure's reply, beside where its logs are
        self.reply = reply
        self.job: Job | None = None

    def start(self, identity: bytes, request: dict[str, Any], peer: str | None) -> None:
        """Start the job a checked `run` or `serve` request asks for; BadRequest if it cannot
        be (busy, a target that is not the peer, no scratch folder, a process that fails to
        start)."""
        if self.job is not None:
            raise BadRequest(f"busy with {self.job.description}; one job at a time")
        serve = request["op"] == "serve"
        work = None if serve else work_for(request)
        target = request["leader"] if serve else work.target if work else None
        if target is not None:
            check_target(target, peer)
        indices: list[int] = request["shards"] if serve else request["indices"]
        # Training processes and follower shards get their threads (OpenMP's too); clients
        # one each.
        if serve:
            threads = shard_threads(request)
        else:
            threads = work.threads if isinstance(work, TrainJob) else 1
        try:
            group = ProcessGroup(threads)
        except OSError as exc:
            raise BadRequest(f"could not make a scratch folder here: {exc}") from None
        roles = [f"shard{i}" if work is None else work.process_name(i) for i in indices]
        description = describe_shards(indices) if work is None else work.describe(len(indices))
        now = time.monotonic()
        self.job = Job(identity, request["id"], group, roles, description,
                       now + request["timeout_s"], now, work, indices)  # fmt: skip
        against = f" against {target}" if target else ""
        log.info("running %s%s for %s", description, against, peer or "a local peer")
        try:
            if work is None:
                secret = request.get("shard_secret")
                secret_file = (  # the scratch folder is this user's alone (mkdtemp)
                    write_secret_file(group.scratch / "shard.secret", secret.encode())
                    if secret is not None
                    else None
                )
                for shard in indices:
                    group.start(
                        f"shard{shard}",
                        "psserver.cli.server",
                        *follower_args(request, shard, secret_file),
                        follower=True,
                    )
            else:
                work.start(group, indices)
        except Exception as exc:  # half started: end it, or nothing would ever answer it
            self.end()
            if isinstance(exc, OSError):
                raise BadRequest(f"could not start {description}: {exc}") from None
            raise

    def cancel(self, identity: bytes) -> bool:
        """End the job if `identity`'s request started it; whether it did."""
        cancelled = self.job is not None and self.job.peer_identity == identity
        if cancelled:
            log.info("cancelled: %s", self.job.description if self.job else "")
            self.end()
        return cancelled

    def check(self) -> None:
        """Answer and end the job if it is over: done, failed or past its deadline."""
        job = self.job
        if job is None:
            return
        try:
            finished = job.group.finished(job.description, job.roles)  # raises for a failure
            if finished and job.work is None:
                # Follower shards exit cleanly only when their leader stops them, as a
                # `ps-bench train` leader does at the end of its steps: the run is over.
                log.info("done: %s, stopped by their leader", job.description)
                self.reply(job.peer_identity, job.request_id, ok=True, results=[])
                self.end()
                return
            if not finished:
                if time.monotonic() < job.deadline:
                    return
                raise PSError(
                    f"{job.description}: still running after {job.deadline - job.started:.0f} s "
                    f"(logs in {job.group.scratch} on {self.host})"
                )
            assert job.work is not None
            results = [job.work.read(job.group, index) for index in job.indices]
        except (PSError, OSError, ValueError) as exc:
            log.warning("failed: %s", exc)
            self.reply(job.peer_identity, job.request_id, ok=False, error=f"on {self.host}: {exc}")
            self.end(keep_logs=True)
            return
        log.info("done: %s in %.1f s", job.description, time.monotonic() - job.started)
        self.reply(job.peer_identity, job.request_id, ok=True, results=results)
        self.end()

    def end(self, keep_logs: bool = False) -> None:
        job, self.job = self.job, None
        if job is None:
            return
        job.group.close(keep_logs)
