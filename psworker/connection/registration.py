"""A worker's registration with the server: the REGISTER/WELCOME exchange, the checks on
what the server answers (a model this release has; the job must not change under a worker
that registers again), the heartbeat that keeps the registration alive, and the pauses
between registrations when a server forgets the worker again and again. It trains nothing
(see psworker.trainer).

A worker's first REGISTER, to a server that has not answered it yet, waits --join-timeout
(the connection's `join_timeout_s`) and says meanwhile that nothing answers
(psworker.connection.requests); a registration after the server forgot the worker (it
restarted) waits as every request does, --timeout and --retries.

A sharded job's leader holds registrations, unanswered, until its follower shards have
joined, which may be long after the worker's --join-timeout (or --timeout and --retries) has
run out (a follower started by hand on another host). A worker whose REGISTER got no reply
therefore asks for the server's STATUS, if something at the server's address completed a
ZeroMQ handshake: while the server is up and says it waits for follower shards, the worker
registers again and waits on; otherwise it gives up as before."""

import dataclasses
import logging
import os
import secrets
import socket
import threading

import torch
from torch import nn

from common.catalog import MODEL_NAMES, all_fingerprints, build_model
from common.errors import ServerError
from common.job import JobSpec
from common.model.flat import FlatModel
from common.wire.protocol import Message, Register, Status, StatusReply, Stop, Welcome
from psworker.connection.requests import Interrupted, NoReply, RequestFailed, ServerConnection

log = logging.getLogger("ps.worker")
MAX_HEARTBEAT_INTERVAL_S = 3600.0
# A server that forgets the worker again and again (each registration answered, each request
# after it "unknown-worker"): the worker gives up after this many in a row, with a pause
# that doubles between them, instead of registering in a busy loop for ever.
MAX_REREGISTRATIONS = 10
REREGISTRATION_PAUSE_MAX_S = 8.0
# Fields of the job that must not change when the worker re-registers after a server restart:
# its data, its model, its compressor (top-k's residual belongs to the old job).
STABLE_JOB_FIELDS = (
    "model", "dataset", "batch_size", "seed", "train_limit", "train_size", "compress",
)  # fmt: skip


def reregistration_pause_s(forgotten: int) -> float:
    """The pause before registering again after being forgotten `forgotten` times in a row:
    none the first time (a restarted server, the usual case), then 0.5 s doubling to 8 s."""
    if forgotten <= 1:
        return 0.0
    return min(REREGISTRATION_PAUSE_MAX_S, 0.25 * 2 ** (forgotten - 1))


def pause_before_registering_again(forgotten: int, shutdown: threading.Event) -> None:
    """The pause of `reregistration_pause_s`. A shutdown signal, before or during it, ends it
    with Interrupted: the server forgot this worker, so it has nothing to leave, and it
    leaves rather than sleeping out up to 8 s and then joining only to leave."""
    if shutdown.wait(reregistration_pause_s(forgotten)):
        raise Interrupted("a shutdown signal came before registering again")


def model_of(job: JobSpec, device: torch.device) -> tuple[nn.Module, FlatModel]:
    """The job's model on `device`, in training mode, and its flat view; ServerError if this
    release has no such model, or one of another size (the server's release differs)."""
    if job.model not in MODEL_NAMES:
        raise ServerError(
            f"the server trains {job.model!r}, a model this worker does not have "
            f"({', '.join(MODEL_NAMES)}); install the same release on both"
        )
    model = build_model(job.model).to(device)
    model.train()
    flat = FlatModel(model)
    if (flat.num_params, flat.num_buffers) != (job.num_params, job.num_buffers):
        raise ServerError(
            f"the server's {job.model} has {job.num_params} parameters and "
            f"{job.num_buffers} buffer values, this worker's {flat.num_params} and "
            f"{flat.num_buffers}; install the same release on both"
        )
    return model, flat


@dataclasses.dataclass
class Session:
    """This worker's current registration with the server."""

    worker_id: int
    token: str
    job: JobSpec


def new_process_identity() -> str:
    """REGISTER.process for this worker process: drawn once (psworker.trainer.Worker) and sent
    unchanged in each registration, so that the server knows the process again after it
    forgot it, and tells it from one alike in host, pid, name and device (containers)."""
    return secrets.token_hex(8)


def register(
    connection: ServerConnection,
    name: str,
    device: torch.device,
    process: str,
    previous: JobSpec | None,
) -> Session | Stop:
    """Register with the server (again, after it forgot this worker, when `previous` is the
    job it trained) as process `process` (new_process_identity), start the heartbeat, and
    return the new session; or the STOP of a job that is over."""
    # A new registration: what the last one's heartbeat heard ("unknown-worker") is over,
    # and so is any reply still on its way (a PUSH_ACK left unread when a follower's error
    # came first): on a new socket it cannot be read as the answer to REGISTER.
    connection.stop_heartbeat()
    connection.reset()
    welcome = ask_to_join(
        connection,
        Register(name, socket.gethostname(), str(device), os.getpid(), process, all_fingerprints()),
        first=previous is None,
    )
    if isinstance(welcome, Stop):
        return welcome
    if not isinstance(welcome, Welcome):
        raise ServerError(f"expected WELCOME after registering, got {type(welcome).__name__}")
    job = JobSpec.from_dict(welcome.job)
    if previous is not None:
        changed = [f for f in STABLE_JOB_FIELDS if getattr(job, f) != getattr(previous, f)]
        if changed:
            raise ServerError(
                f"the server's job changed after it restarted ({', '.join(changed)}); "
                "start this worker again to join the new job"
            )
    interval = welcome.heartbeat_interval
    if not 0 < interval <= MAX_HEARTBEAT_INTERVAL_S:  # NaN too: a spinning or silent beat
        raise ServerError(
            f"the server asked for a heartbeat every {interval} s, not within (0, "
            f"{MAX_HEARTBEAT_INTERVAL_S:g}]; run the same release of ps-server and ps-worker"
        )
    # Replies to the heartbeat are what a held pull hears: a timeout within one interval
    # would take a pull the server holds (SSP, a sync step waiting on others) for silence.
    if connection.timeout_s < 2 * interval:
        log.warning(
            "--timeout %g s is under twice the server's heartbeat interval (%g s): a pull "
            "the server holds would look like a dead server; waiting %g s instead",
            connection.timeout_s, interval, 2 * interval,
        )  # fmt: skip
        connection.timeout_s = 2 * interval
    connection.start_heartbeat(welcome.worker_id, welcome.token, interval)
    log.info(
        "registered as worker %d: %s %s, batch %d, %s on %s",
        welcome.worker_id,
        job.mode,
        job.model,
        job.batch_size,
        job.dataset,
        device,
    )
    return Session(welcome.worker_id, welcome.token, job)


def ask_to_join(connection: ServerConnection, request: Register, first: bool = True) -> Message:
    """REGISTER's answer, waiting on for as long as the server says it waits for its
    follower shards (see the module doc); `first`: this worker's first registration."""
    said = False
    while True:
        # Until the server first answers: --join-timeout, if the worker was given one.
        patience = connection.join_timeout_s if first and not connection.proven else None
        try:
            reply = connection.request(request, within_s=patience)
        except NoReply:
            if not (connection.proven or connection.met):  # nothing there to ask
                raise
            status = status_after_silence(connection)
            if isinstance(status, Welcome):  # the held REGISTER's answer came first
                connection.reset()  # the STATUS reply still on its way must not be read
                return status
            joining = status.status.get("shards_joining") if status is not None else None
            if not joining:
                raise
            log.log(
                logging.INFO if said else logging.WARNING,  # a warning once, not per round
                "the server at %s is up and waits for follower shards %s to join; it holds "
                "this registration until then, so this worker waits on",
                connection.endpoint, joining,
            )  # fmt: skip
            said = True
            continue
        if said:
            # Asked again on the socket that held the first REGISTER: a second WELCOME, the
            # same one (psserver.coordinator.admission), may follow this one, and must not be read
            # as the reply to the first PULL.
            connection.reset()
        return reply


def status_after_silence(connection: ServerConnection) -> StatusReply | Welcome | None:
    """One STATUS request, on the socket the REGISTER went on last (its WELCOME may come
    first); None if the server does not answer it either."""
    try:
        reply = connection.request(Status(), retries=0)
    except (NoReply, RequestFailed):
        return None
    return reply if isinstance(reply, (StatusReply, Welcome)) else None
