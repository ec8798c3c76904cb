"""Who may join a job: the REGISTERs of workers and of follower shards, and heartbeats.

A worker needs every shard's endpoint, so with `--num-shards K` its registration is held
until all K - 1 followers have registered, and answered then. The job spec sent in WELCOME
is the server's, completed with those endpoints once they are known. A follower's REGISTER
(one with `shard`) is taken only from a shard of this job (psserver.shards.auth: the shard
secret, or the server's CURVE key, `sender_key` here). Heartbeats come on a worker's second
socket: they prove life but never redirect its replies. The followers hear who the job's
workers are whenever that changes (psserver.shards.roster): a new worker's id before its
WELCOME goes out.

A REGISTER is answered once per worker process: a process (REGISTER.process, which only it
and the server know) that asks again before it has pulled never got its WELCOME, and gets
the same one again, rather than a second record that would hold a --max-workers place until
declared dead (a worker asks again on a new socket after --timeout, so the first WELCOME of
a registration held for late shards often went to a socket it had already given up).
"""

import dataclasses
import logging
import reprlib
from collections.abc import Callable

from common.errors import RequestRejected
from common.job import JobSpec
from common.logs import printable
from common.wire.protocol import (
    SHARD,
    Error,
    Heartbeat,
    HeartbeatAck,
    Message,
    Register,
    Welcome,
)
from psserver.config import ServerConfig
from psserver.coordinator.membership import MAX_LABEL, Membership
from psserver.shards.leader import ShardGroup
from psserver.store.parameters import ParameterStore

log = logging.getLogger("ps.server")
# REGISTER.process: ps-worker sends 16 hex digits. A longer one is refused rather than cut
# short (every worker's record keeps it for the job's summary), as that could make two
# processes one; an empty one would make every client that sends it one process.
MAX_PROCESS_CHARS = 64


class Admission:
    def __init__(
        self,
        config: ServerConfig,
        store: ParameterStore,
        job: JobSpec,
        membership: Membership,
        shards: ShardGroup | None,
        send: Callable[[bytes, Message], None],
    ) -> None:
        self.config, self.store, self.job = config, store, job
        self.membership, self.shards, self.send = membership, shards, send
        # Registrations held until the shards have joined: (identity, request, CURVE key).
        self.deferred: list[tuple[bytes, Register, str]] = []
        if shards is not None:
            membership.on_change = self.tell_shards

    def tell_shards(self) -> None:
        """Send the followers the job's workers now (ROSTER)."""
        assert self.shards is not None
        ids = [record.worker_id for record in self.membership.active()]
        self.shards.send_roster(ids, self.membership.next_id)

    def on_register(self, identity: bytes, request: Register, key: str = "") -> None:
        if request.form == SHARD:
            self._admit_shard(identity, request, key)
            return
        check_process(request.process)
        if self.shards is not None and not self.shards.ready:
            # A worker that waited long enough asks again on a new socket: the same process
            # (REGISTER.process) replaces its first request rather than joining twice.
            before = len(self.deferred)
            self.deferred = [
                (waiting, held, held_key)
                for waiting, held, held_key in self.deferred
                if held.process != request.process or held_key != key
            ]
            if len(self.deferred) >= self.config.worker_limit:
                raise RequestRejected("busy", "too many workers wait for the shards")
            if len(self.deferred) == before:  # said once per process, not per retry
                log.info(
                    "worker %s (pid %d) waits: it is welcomed once shards %s have joined",
                    printable(request.worker_name, MAX_LABEL), request.pid,
                    self.shards.waiting_for(),
                )  # fmt: skip
            self.deferred.append((identity, request, key))
            return
        self._welcome(identity, request, key)

    def _admit_shard(self, identity: bytes, request: Register, sender_key: str) -> None:
        """A follower shard's REGISTER: its WELCOME, and the held workers' once all joined."""
        if self.shards is None:
            raise RequestRejected(
                "bad-shard", "this server runs without shards (--num-shards 1); start it with "
                f"--num-shards {request.num_shards} to take shard {request.shard}",
            )  # fmt: skip
        config = self.config
        welcome = self.shards.welcome(
            request, sender_key, self.job, self.store, config.worker_timeout, config.worker_limit,
            config.stream_weights, self.membership.token_key,
        )  # fmt: skip
        self.send(identity, welcome)
        if not self.shards.ready:
            log.info("waiting for shards %s", self.shards.waiting_for())
            return
        self.job = dataclasses.replace(self.job, shard_endpoints=self.shards.endpoints())
        log.info("all %d shards have joined", self.shards.num_shards)
        deferred, self.deferred = self.deferred, []
        for waiting, request, key in deferred:
            try:
                self._welcome(waiting, request, key)
            except RequestRejected as exc:
                self.send(waiting, Error(code=exc.code, message=str(exc)))

    def refuse_waiting(self, reason: str) -> int:
        """Answer every registration held for the shards with an ERROR (the job will not
        start), rather than leave those workers to time out; returns how many there were."""
        deferred, self.deferred = self.deferred, []
        for waiting, _, _ in deferred:
            self.send(waiting, Error(code="job-lost", message=reason))
        return len(deferred)

    def on_heartbeat(self, identity: bytes, beat: Heartbeat, key: str = "") -> None:
        try:
            self.membership.authenticate(beat.worker_id, beat.token, identity, key, redirect=False)
        except RequestRejected as exc:
            # A worker cut off for a while sends its queued beats at once; one warning is
            # logged when its main socket asks, the beats themselves only at debug level.
            log.debug("heartbeat refused (%s): %s", exc.code, exc)
            self.send(identity, Error(code=exc.code, message=str(exc)))
            return
        self.send(identity, HeartbeatAck(self.store.version))

    def _welcome(self, identity: bytes, request: Register, key: str) -> None:
        model = self.config.model
        theirs = request.fingerprints.get(model)
        if theirs != self.store.fingerprint:
            raise RequestRejected(
                "model-mismatch",
                f"the worker builds {model} with fingerprint {reprlib.repr(theirs)}, the server "
                f"with {self.store.fingerprint}; install the same release on both",
            )
        record = self.membership.unheard(request.process, key)
        if record is None:
            record = self.membership.register(identity, request, key)
        else:  # its WELCOME was lost (see the module doc): the same one again
            record.identity = identity
            log.info(
                "worker %d (%s) registered again before it pulled: its WELCOME was lost, "
                "sent it again", record.worker_id, record.name,
            )  # fmt: skip
        welcome = Welcome(
            record.worker_id, record.token, self.config.heartbeat_interval, self.job.to_dict()
        )
        self.send(identity, welcome)


def check_process(process: str) -> None:
    """REGISTER.process names one worker process (see MAX_PROCESS_CHARS), or is refused."""
    if not 0 < len(process) <= MAX_PROCESS_CHARS:
        raise RequestRejected(
            "bad-message",
            f"REGISTER.process is {len(process)} characters, not 1 to {MAX_PROCESS_CHARS}: "
            "it is the random identity the worker process drew at start (ps-worker sends 16 "
            "hex digits); run the same release of ps-server and ps-worker",
        )
