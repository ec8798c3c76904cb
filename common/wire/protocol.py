"""The wire protocol: one header frame (msgpack) followed by one raw frame per tensor.

A message on the wire is a ZeroMQ multipart message:

    frame 0      msgpack map {"v": PROTOCOL_VERSION, "type": MessageType, "body": {...},
                              "tensors": [[name, dtype, numel], ...]}
    frame 1..k   the raw little-endian bytes of each tensor named in "tensors", in order

Tensors travel zero-copy: `encode` returns memoryviews of the tensors' own storage, and
`decode` returns tensors that are read-only views of the received frames. There is no pickle
anywhere: a header is plain msgpack and a tensor is bytes plus a dtype from an allow-list.

One kind per verb. A gradient is a PUSH and weights are WEIGHTS whatever the sharding, the
buckets or the overlap: a message says which part of the flat parameter vector it carries
with two fields, `shard` (whose slice: 0 is the leader's) and `bucket` (-1: the whole slice,
else one bucket of it, JobSpec.shard_buckets). The same PULL asks any shard for its slice,
and the leader asks its followers with it too (worker id LEADER_ID, its own token). A follower
shard joins the job as a worker does, with a REGISTER answered by a WELCOME, each in a
follower's form: a `shard` field and the follower's fields instead of the worker's (FORMS).

This module is pure (no sockets). `decode` validates the version, the message type, every body
field's name and type, the frame count, the dtype and the byte count of every tensor, and raises
`ProtocolError` saying what it expected. What a PUSH must satisfy beyond its form (its shapes,
its values, its batch) is the server's to check: psserver.serving.validation. docs/protocol.md
describes the whole protocol for someone writing a client.
"""

import dataclasses
import enum
import reprlib
import sys
import typing
import warnings
from typing import Any, ClassVar

import msgpack
import torch

from common.errors import ProtocolError
from common.logs import counted

# 9: one PUSH, PULL and WEIGHTS kind for every shard and bucket (`shard`, `bucket` fields):
#    PUSH_PART and SLICE_PUSH are PUSHes, SLICE_PULL and FETCH are PULLs, WEIGHTS_PART and
#    SLICE_WEIGHTS are WEIGHTS, SLICE_ACK is a PUSH_ACK; a follower's slice sent in buckets
#    is completed by a PUSH as the leader's is. Kinds renumbered from 14 on.
# 10: the leader's answer to PUSH_READY is a PUSH_ACK with `go` (no PUSH_GO kind); STEP_PLAN
#    is a COMMIT that carries the plan of the open sync step (`epoch`, `batch`, `plan`)
#    instead of an update (no `entries`). Kinds 15 and 19 are no longer used.
# 11: a follower shard joins with a REGISTER and is answered with a WELCOME, each in a
#    follower's form (`shard` 1..K-1; no SHARD_HELLO or SHARD_WELCOME kind); kinds
#    renumbered 1..N without gaps.
PROTOCOL_VERSION = 11

# Only these dtypes may cross the wire; anything else is refused by `decode`.
WIRE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
}
_DTYPE_NAMES = {dtype: name for name, dtype in WIRE_DTYPES.items()}

# A header is small; anything bigger is garbage or an attack.
MAX_HEADER_BYTES = 1 << 20
# Unpacking costs about a microsecond per list or map, whatever their size: a megabyte of
# empty lists ([[]] * 1_000_000) held the server's loop for most of a second. The largest
# real headers (a STATUS_REPLY or a COMMIT for thousands of workers) hold a few thousand.
MAX_HEADER_CONTAINERS = 1 << 16
MAX_MAP_ENTRIES = 4096  # a body has a dozen fields; a job, a status or fingerprints few more

WHOLE = -1  # `bucket` of a message that carries a whole slice
# The worker id the leader uses in its own PULLs to a follower shard (with its leader token):
# worker ids start at 1.
LEADER_ID = 0


def _empty() -> torch.Tensor:
    return torch.empty(0)


class MessageType(enum.IntEnum):
    # worker -> leader: join the job; follower shard -> leader: join as the shard `shard`
    REGISTER = 1
    # leader -> worker: your id, your token and the job; leader -> follower: the job, the
    # optimizer and the slice's state
    WELCOME = 2
    PULL = 3  # worker -> shard: send me your slice (shard 0: and my next batch)
    WEIGHTS = 4  # shard -> worker: a slice, or one updated bucket of it (no reply)
    PUSH = 5  # worker -> shard: a gradient's slice, or one bucket of it (no reply)
    PUSH_ACK = 6  # shard -> worker: the push was taken (shard 0: applied, or dropped)
    STOP = 7  # leader -> worker (or follower): training is over, exit
    ERROR = 8  # any server -> sender: the request was refused, and why
    LEAVE = 9  # worker -> leader: I am leaving the job (bad data, or shutting down)
    HEARTBEAT = 10  # worker -> leader, on its own socket: I am alive
    HEARTBEAT_ACK = 11  # leader -> worker: so am I
    STATUS = 12  # anyone -> leader: how is the job going? (read-only, needs no registration)
    STATUS_REPLY = 13  # leader -> asker: the live status, see `StatusReply`
    # Flow control: a worker asks before it sends a big PUSH, so that the leader never holds
    # more than a few gradients in memory however many workers push at once. The leader's
    # answer is a PUSH_ACK with `go` (send it now), or STOP.
    PUSH_READY = 14  # worker -> leader: my gradient is ready; may I send it?
    # Server sharding (see psserver.shards.leader and psserver.shards.follower): shard 0, the
    # leader, runs the job; shards 1..K-1 each own one slice of the flat parameter vector and
    # join it with REGISTER.
    ROSTER = 15  # leader -> follower: the job's workers, whenever they change; no reply
    # leader -> follower: apply update `version` from these staged slices, or (sync) step
    # `version` is open and takes these workers' slices; no reply
    COMMIT = 16


# REGISTER and WELCOME each have two forms, a worker's and a follower shard's, with a field
# set each (the class's FORMS); the fields of the other form keep their defaults and do not
# travel. A body that holds `shard` is a follower's, and its `shard` is 1 or more.
WORKER, SHARD = "worker", "shard"
_SENDERS = {WORKER: "worker", SHARD: "follower shard"}  # who sends each form, for errors


@dataclasses.dataclass(frozen=True)
class Register:
    """Join the job: as a worker, or as the follower shard that owns slice `shard`."""

    TYPE: ClassVar[MessageType] = MessageType.REGISTER
    FORMS: ClassVar[dict[str, frozenset[str]]] = {
        WORKER: frozenset({"worker_name", "hostname", "device", "pid", "process", "fingerprints"}),
        SHARD: frozenset({"shard", "num_shards", "endpoint", "fingerprints", "proof"}),
    }
    # A worker's:
    worker_name: str = ""  # a label for logs, e.g. "host:gpu0"
    hostname: str = ""
    device: str = ""  # where the worker computes, e.g. "cuda:0" or "cpu"
    pid: int = 0
    # Random hex the worker process draws once at start and sends in each of its REGISTERs
    # (also after the server forgot it): the server knows a process by it
    # (psserver.coordinator.admission, the summary's workers_trained). Host and pid cannot tell
    # apart containers on the host's network that each run their worker as pid 1.
    process: str = ""
    # Both: model name -> architecture fingerprint, for every model the sender can build.
    fingerprints: dict[str, str] = dataclasses.field(default_factory=dict)
    # A follower shard's:
    shard: int = 0  # its slice index, 1..num_shards-1; 0: a worker's REGISTER (not sent)
    num_shards: int = 0  # K, which must match the leader's
    endpoint: str = ""  # where workers and the leader reach this shard
    # HMAC-SHA256 (hex) of the job's shard secret over shard|num_shards|endpoint, or "" from a
    # follower without one (psserver.shards.auth): the WELCOME holds every worker's key.
    proof: str = ""

    @property
    def form(self) -> str:
        return SHARD if self.shard else WORKER


@dataclasses.dataclass(frozen=True)
class Welcome:
    """The leader's answer to a REGISTER, in the same form: a worker's (its id, its token and
    the job) or a follower shard's (the job, the optimizer and its slice's state)."""

    TYPE: ClassVar[MessageType] = MessageType.WELCOME
    FORMS: ClassVar[dict[str, frozenset[str]]] = {
        WORKER: frozenset({"worker_id", "token", "heartbeat_interval", "job"}),
        SHARD: frozenset({
            "job", "shard", "optimizer", "leader_token", "version", "slice_wait", "max_staged",
            "params", "momentum", "stream_weights", "worker_key",
        }),
    }  # fmt: skip
    # A worker's:
    worker_id: int = 0  # the id the worker puts in every later request ...
    token: str = ""  # ... with this secret, which proves the request comes from that worker
    heartbeat_interval: float = 0.0  # seconds between heartbeats the server expects
    # Both: a JobSpec as a plain dict (see common.job), to a follower with the shard bounds.
    job: dict[str, Any] = dataclasses.field(default_factory=dict)
    # A follower shard's:
    shard: int = 0  # the shard welcomed, as its REGISTER said; 0: a worker's WELCOME (not sent)
    # The server's optimizer: {lr, momentum, weight_decay, name} (psserver.store.optimizer).
    optimizer: dict[str, Any] = dataclasses.field(default_factory=dict)
    leader_token: str = ""  # proves later COMMIT, ROSTER and PULLs come from the leader
    version: int = 0  # updates applied to the slice below (not 0 after --resume)
    slice_wait: float = 0.0  # seconds a COMMIT may wait for a worker's slice before skipping it
    max_staged: int = 0  # staged slices kept at once (one per admitted worker)
    # (hi - lo,) the slice's starting values, and its SGD momentum (empty before the first
    # step). Left out of ==, which a tensor cannot answer, so that a worker's WELCOMEs compare.
    params: torch.Tensor = dataclasses.field(default_factory=_empty, compare=False)
    momentum: torch.Tensor = dataclasses.field(default_factory=_empty, compare=False)
    # Sync: send each applied bucket straight back to the workers that pushed it in parts
    # (ps-server --stream-weights), as the leader does.
    stream_weights: bool = False
    # The secret a worker's token is derived from (psserver.shards.roster.worker_token), so the
    # shard can check the token of a worker registered after the last ROSTER it read.
    worker_key: str = ""

    @property
    def form(self) -> str:
        return SHARD if self.shard else WORKER


@dataclasses.dataclass(frozen=True)
class Pull:
    TYPE: ClassVar[MessageType] = MessageType.PULL
    worker_id: int  # LEADER_ID: the leader asks a follower (token: its leader token)
    token: str
    # The version of the slice whose every bucket this puller has received as WEIGHTS with a
    # bucket, or will have once it reads the reply (they come before it on the connection).
    # The shard leaves the parameters out of its reply if it is at that version and sent
    # every bucket of it to this puller. -1: send them.
    have_version: int = -1
    shard: int = 0  # whose slice: the shard this is sent to
    # Shards 1..K-1: hold the reply until the slice has at least this many updates. -1 from
    # the leader: a liveness ping, answered at once without tensors. Shard 0 ignores it: it
    # holds a pull until it has a batch for the worker.
    min_version: int = 0
    with_momentum: bool = False  # the leader's PULL only: the optimizer's momentum too


@dataclasses.dataclass(frozen=True)
class Weights:
    TYPE: ClassVar[MessageType] = MessageType.WEIGHTS
    version: int  # number of updates applied to these weights (of a bucket: once the step closes)
    epoch: int  # shard 0's reply to a PULL: the batch to compute next: epoch ...
    batch: int  # ... and batch index within this worker's data shard
    rank: int  # the data shard to draw it from ...
    world_size: int  # ... out of this many (fixed for a whole epoch); -1, -1, -1, 0 otherwise
    push_granted: bool  # flow control: the next PUSH may go without asking (PUSH_READY)
    params: torch.Tensor  # (S,) float32: the slice, or (bucket size,) one bucket; empty if ...
    buffers: torch.Tensor  # (F,) shard 0's reply to a PULL: BatchNorm statistics; else empty
    streamed: bool = False  # ... True: the puller has them already (Pull.have_version)
    shard: int = 0  # whose slice
    # -1: the reply to a PULL. Otherwise one updated bucket of the slice, sent unasked (sync,
    # --stream-weights) to the workers whose parts it summed, before the replies that follow.
    bucket: int = WHOLE
    # (S,) the slice's momentum, for the leader's PULL with_momentum; empty otherwise.
    momentum: torch.Tensor = dataclasses.field(default_factory=_empty)
    # To the leader only (0 to workers): the gradient bytes this shard has applied and the
    # updated-bucket bytes it has streamed since it joined, so the summary counts every shard.
    pushed_bytes: int = 0
    streamed_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class Push:
    TYPE: ClassVar[MessageType] = MessageType.PUSH
    worker_id: int
    token: str
    version: int  # the (leader's) weights version the gradient was computed on
    epoch: int
    batch: int
    samples: int  # batch size the gradient is the mean over
    loss_sum: float  # summed training loss over the batch, for logging
    correct: int  # correct training predictions in the batch, for logging
    # The shard's slice of the flat gradient (bucket -1), or one bucket of it (bucket b):
    # dense float32 (or the job's --compress fp16/bf16 type). With top-k compression: (K,)
    # float32 values at ...
    grads: torch.Tensor
    grad_indices: torch.Tensor  # ... these (K,) int32 positions in the slice; empty if dense
    buffers: torch.Tensor  # (F,) shard 0, bucket -1: the BatchNorm statistics; else empty
    # Bucket -1 only. 0: `grads` holds the whole slice. N > 0: the slice came before this PUSH
    # as N PUSHes, one per bucket of the shard (bucket 0..N-1), and `grads` is empty.
    parts: int = 0
    shard: int = 0  # whose slice: the shard this is sent to
    # -1: a whole slice (or the PUSH that completes one sent in buckets), answered with
    # PUSH_ACK. b >= 0: bucket b, dense; never answered (the completing PUSH's reply says
    # whether every bucket was taken).
    bucket: int = WHOLE


@dataclasses.dataclass(frozen=True)
class PushAck:
    TYPE: ClassVar[MessageType] = MessageType.PUSH_ACK
    version: int  # shard 0: the version after the update; a follower: its version now
    staleness: int  # shard 0: its version at apply time minus Push.version (0 in sync mode)
    # Shard 0: False when the gradient arrived too late for its step and was dropped. A
    # follower: always True (the slice is staged; shard 0's answer says whether it counts).
    applied: bool
    shard: int = 0  # who answers
    # True: the leader's answer to PUSH_READY, not to a PUSH: the push may go now (flow
    # control). It acknowledges nothing: `version` is the leader's now, `staleness` 0,
    # `applied` False.
    go: bool = False


@dataclasses.dataclass(frozen=True)
class Stop:
    TYPE: ClassVar[MessageType] = MessageType.STOP
    reason: str  # ends with JOB_FAILED when the job failed rather than ended


# The end of a STOP's reason when the server stopped the job on a failure (a shard lost, a
# checkpoint it cannot write) and exits 1: the worker then exits 1 too, so that a supervisor
# starts it again with the server. Any other STOP (the job is over) ends a worker with 0.
JOB_FAILED = "; the job stopped"


@dataclasses.dataclass(frozen=True)
class Error:
    TYPE: ClassVar[MessageType] = MessageType.ERROR
    code: str  # machine-readable, e.g. "bad-message", "unknown-worker", "wrong-shape"
    message: str  # what went wrong and what to do


@dataclasses.dataclass(frozen=True)
class Leave:
    TYPE: ClassVar[MessageType] = MessageType.LEAVE
    worker_id: int
    token: str
    reason: str


@dataclasses.dataclass(frozen=True)
class Heartbeat:
    TYPE: ClassVar[MessageType] = MessageType.HEARTBEAT
    worker_id: int
    token: str


@dataclasses.dataclass(frozen=True)
class HeartbeatAck:
    TYPE: ClassVar[MessageType] = MessageType.HEARTBEAT_ACK
    version: int


@dataclasses.dataclass(frozen=True)
class Status:
    TYPE: ClassVar[MessageType] = MessageType.STATUS
    # No fields: any client may ask, and the answer carries no token and changes nothing.


@dataclasses.dataclass(frozen=True)
class StatusReply:
    TYPE: ClassVar[MessageType] = MessageType.STATUS_REPLY
    # Plain msgpack data (string keys, no tensors), built by psserver.status.live.build_status:
    #   phase        "waiting" (for --workers to be ready), "training" or "stopping"
    #   mode, model, dataset, step (the weights version), max_steps, uptime_s, training_s
    #   waiting_for  what training waits for while it cannot go on (workers, follower
    #                shards), in words, or None
    #   shards_joining  the follower shards yet to join (registrations are held until
    #                then; a worker whose REGISTER went unanswered waits on while it is
    #                not empty), [] when none
    #   epoch        {completed (trained to the end), abandoned, total, current: {epoch,
    #                roster (worker ids by rank), steps_per_shard} or None between epochs}
    #   workers_expected, min_workers, rejected_requests (every request answered with ERROR),
    #   late_gradients (sync gradients dropped because their step had closed)
    #   throughput   {images_per_second (over the last window_s), window_s,
    #                overall_images_per_second, samples, gradients}
    #   server_cpu   {seconds (CPU time of the server process so far, all threads),
    #                busy (CPU seconds per second over the last window_s: 1.0 is one core),
    #                followers_seconds (the same for the follower shards this ps-server
    #                started itself, all together; None without any, or off Linux)}
    #   staleness    async and ssp: {count, mean, max, histogram, steps_ahead_bound}; sync: None
    #   last_evaluation  {epoch (the epochs ended before it), step, accuracy, loss} or None
    #   checkpoints  {dir, every (--checkpoint-every), step (of latest.pt, None before the
    #                first), age_s (since this run wrote it; None for one it resumed from),
    #                kept (step-N.pt files)}; None without --checkpoint-dir. Missing in the
    #                replies of servers from before it
    #   worker_states    {state: number of workers}, over every worker ever registered
    #   workers      [{id, name, device, state, pushes, samples, late_dropped, rejected,
    #                last_seen_s}], the active ones first, at most MAX_LISTED_WORKERS
    #   workers_omitted  workers left out of that list
    status: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class PushReady:
    TYPE: ClassVar[MessageType] = MessageType.PUSH_READY
    worker_id: int
    token: str


@dataclasses.dataclass(frozen=True)
class Commit:
    """What a follower applies, as the leader decided it: an update (`entries`), or the plan
    of the sync step now open (`plan`, and no entries), never both."""

    TYPE: ClassVar[MessageType] = MessageType.COMMIT
    leader_token: str
    # With entries: the update to apply, and the shard must be at exactly this version.
    # Without: the version of the open step the plan is for.
    version: int
    # One entry per gradient, in the order the leader added them up:
    # [worker_id, token, version, epoch, batch, samples] naming a staged slice. Empty: no
    # update, only the plan below.
    entries: list[Any]
    # Sync: the step's expected sample count; each slice is weighted samples / expected, and
    # the sum rescaled when some are missing (as psserver.policies.SyncPolicy does).
    # 0 means async: apply the one entry as it is.
    expected: int
    lr_scale: float  # the staleness-aware learning-rate factor for this update
    # The plan of the sync step open at `version` (entries empty): the batch every worker
    # computes in it (epoch, and batch index within each worker's shard) ...
    epoch: int = -1
    batch: int = -1
    # ... and one entry per worker the step waits for, by rank: [worker_id, token, samples].
    # A bucket all of them sent (and the shard accepted) is applied with exactly the
    # update's arithmetic; the rest wait for the update. Empty, with no entries either: no
    # step is open at `version` any more (its epoch was abandoned), and buckets applied
    # early keep their update, as the leader's do.
    plan: list[Any] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class Roster:
    TYPE: ClassVar[MessageType] = MessageType.ROSTER
    leader_token: str
    # The ids of the workers registered and neither gone nor dead, as the leader's membership
    # has them now; a shard refuses a slice push or pull from any other worker. Tokens are not
    # sent: the shard derives them (its WELCOME's worker_key).
    workers: list[int]
    # The id the leader gives the next worker that registers. A worker with this id or a
    # higher one registered after this roster was sent, and is taken on its token alone.
    next_id: int


Message = (
    Register
    | Welcome
    | Pull
    | Weights
    | Push
    | PushAck
    | Stop
    | Error
    | Leave
    | Heartbeat
    | HeartbeatAck
    | Status
    | StatusReply
    | PushReady
    | Roster
    | Commit
)
_CLASSES: dict[MessageType, type] = {
    cls.TYPE: cls
    for cls in (
        Register,
        Welcome,
        Pull,
        Weights,
        Push,
        PushAck,
        Stop,
        Error,
        Leave,
        Heartbeat,
        HeartbeatAck,
        Status,
        StatusReply,
        PushReady,
        Roster,
        Commit,
    )
}


def describe(message: Message) -> str:
    """A message's kind for a log line or an error, with the shard whose slice it carries when
    that is not the leader's: "Push", "Push (shard 1)". Never a field that holds a secret."""
    name = type(message).__name__
    if isinstance(message, (Register, Welcome, Pull, Push, Weights, PushAck)) and message.shard:
        return f"{name} (shard {message.shard})"
    return name


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls, globalns=vars(sys.modules[__name__]))
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


_FIELDS: dict[type, dict[str, Any]] = {cls: _field_types(cls) for cls in _CLASSES.values()}


def _tensor_fields(cls: type) -> list[str]:
    return [name for name, tp in _FIELDS[cls].items() if tp is torch.Tensor]


def _forms(cls: type) -> dict[str, frozenset[str]]:
    """The forms of a kind sent by two roles (REGISTER, WELCOME): form -> its fields."""
    forms: dict[str, frozenset[str]] = getattr(cls, "FORMS", {})
    return forms


def _form_fields(cls: type, form: str | None) -> dict[str, Any]:
    """The fields that travel in a message of this kind and form, in the class's order."""
    if form is None:
        return _FIELDS[cls]
    return {n: tp for n, tp in _FIELDS[cls].items() if n in _forms(cls)[form]}


def _is_default(field: dataclasses.Field[Any], value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.numel() == 0
    if field.default_factory is not dataclasses.MISSING:
        return bool(value == field.default_factory())
    return bool(value == field.default)


def _wire_fields(message: Any) -> dict[str, Any]:
    """The fields `message` sends: all of them, or those of its form. A field of the other
    form that does not hold its default is a bug in the sender, not something to drop."""
    cls = type(message)
    if not _forms(cls):
        return _FIELDS[cls]
    fields = _form_fields(cls, message.form)
    for field in dataclasses.fields(cls):
        if field.name not in fields and not _is_default(field, getattr(message, field.name)):
            raise ValueError(
                f"{cls.__name__}.{field.name} is not a field of a {_SENDERS[message.form]}'s "
                f"{cls.TYPE.name}"
            )
    return fields


# The most frames a message has: its header and one per tensor field.
MAX_FRAMES = 1 + max(len(_tensor_fields(cls)) for cls in _CLASSES.values())


def encode(message: Message) -> list[bytes | memoryview]:
    """Turn a message into frames. Tensor frames share memory with the tensors: do not modify
    a tensor until ZeroMQ has sent it (send a snapshot, or track the send)."""
    cls = type(message)
    body: dict[str, Any] = {}
    tensors: list[list[Any]] = []
    frames: list[bytes | memoryview] = []
    for name, tp in _wire_fields(message).items():
        value = getattr(message, name)
        if tp is torch.Tensor:
            tensor = value.detach()
            if tensor.device.type != "cpu":
                raise ValueError(f"tensor {name!r} must be on the CPU to be sent")
            if tensor.dtype not in _DTYPE_NAMES:
                raise ValueError(f"tensor {name!r} has dtype {tensor.dtype}, not a wire dtype")
            tensor = tensor.reshape(-1).contiguous()
            tensors.append([name, _DTYPE_NAMES[tensor.dtype], tensor.numel()])
            # A uint8 view works for every dtype (numpy has no bfloat16) and keeps the
            # tensor alive for as long as ZeroMQ holds the memoryview.
            frames.append(memoryview(tensor.view(torch.uint8).numpy()) if tensor.numel() else b"")
        else:
            body[name] = value
    header = {"v": PROTOCOL_VERSION, "type": int(cls.TYPE), "body": body, "tensors": tensors}
    return [msgpack.packb(header, use_bin_type=True), *frames]


def _check_value(cls: type, name: str, expected: Any, value: Any) -> Any:
    origin = typing.get_origin(expected) or expected
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    ok = isinstance(value, origin) and not (origin is int and isinstance(value, bool))
    if not ok:
        raise ProtocolError(
            f"{cls.__name__}.{name} must be {getattr(origin, '__name__', origin)}, "
            f"got {type(value).__name__}"
        )
    if expected == dict[str, str] and not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):  # a fingerprint map: anything else (a list nested 1000 deep, say) is not one
        raise ProtocolError(f"{cls.__name__}.{name} must map strings to strings")
    if expected == list[int] and not all(type(v) is int for v in value):
        raise ProtocolError(f"{cls.__name__}.{name} must be a list of integers")
    return value


# Received frames are read-only, and the tensors made from them are never written (a CPU
# worker's parameters are views of them: common.model.flat). torch warns about that once per
# process; this one filter says so for every thread, which warnings.catch_warnings() around
# each frombuffer could not: it swaps the process-wide filter list, so it is not thread-safe.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)


def _tensor_from_frame(frame: Any, dtype: torch.dtype, numel: int) -> torch.Tensor:
    if numel == 0:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(frame, dtype=dtype, count=numel)


def unpack_header(
    raw: bytes | memoryview, strict_map_key: bool = True, what: str = "header frame"
) -> Any:
    """Unpack a msgpack header, refusing (ProtocolError) one that would take long to build:
    more than MAX_HEADER_CONTAINERS lists and maps, or a map of more than MAX_MAP_ENTRIES."""
    containers = 0

    def count(container: Any) -> Any:
        nonlocal containers
        containers += 1
        if containers > MAX_HEADER_CONTAINERS:
            raise ProtocolError(
                f"header holds more than {MAX_HEADER_CONTAINERS} lists and maps; no message "
                "of this protocol has as many"
            )
        return container

    try:
        return msgpack.unpackb(
            raw, raw=False, strict_map_key=strict_map_key, list_hook=count, object_hook=count,
            max_map_len=MAX_MAP_ENTRIES,
        )  # fmt: skip
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises several unrelated types for garbage
        raise ProtocolError(f"{what} is not valid msgpack ({exc})") from None


def _form_of_body(cls: type, body: dict[Any, Any]) -> str | None:
    """Which form a body of a two-form kind is in, by its fields (None: a one-form kind).
    A body in neither, such as a worker's REGISTER with a follower's fields, is refused."""
    forms = _forms(cls)
    if not forms:
        return None
    for form, names in forms.items():
        scalars = {n for n in names if _FIELDS[cls][n] is not torch.Tensor}
        if set(body) == scalars:
            return form
    expected = "; ".join(
        f"a {_SENDERS[form]}'s {sorted(n for n in names if _FIELDS[cls][n] is not torch.Tensor)}"
        for form, names in forms.items()
    )
    raise ProtocolError(
        f"{cls.__name__} body must have the fields of one sender, {expected}; "
        f"got {reprlib.repr(sorted(body, key=str))}"
    )


def decode(frames: typing.Sequence[Any]) -> Message:
    """Validate and decode frames (bytes, memoryviews or zmq.Frame buffers) into a message."""
    if not frames:
        raise ProtocolError("empty message: expected a msgpack header frame")
    raw_header = bytes(frames[0])
    if len(raw_header) > MAX_HEADER_BYTES:
        raise ProtocolError(
            f"header is {counted(len(raw_header), 'byte')}, the limit is {MAX_HEADER_BYTES}"
        )
    header = unpack_header(raw_header)
    if not isinstance(header, dict) or set(header) != {"v", "type", "body", "tensors"}:
        raise ProtocolError("header must be a map with exactly the keys v, type, body, tensors")
    if type(header["v"]) is not int or header["v"] != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {reprlib.repr(header['v'])} is not supported; this side speaks "
            f"version {PROTOCOL_VERSION}: run the same release of ps-server and ps-worker"
        )
    try:
        if type(header["type"]) is not int:
            raise ValueError("a message type is an integer")
        cls = _CLASSES[MessageType(header["type"])]
    except (ValueError, TypeError):
        raise ProtocolError(f"unknown message type {reprlib.repr(header['type'])}") from None
    body, specs = header["body"], header["tensors"]
    if not isinstance(body, dict) or not isinstance(specs, list):
        raise ProtocolError("header body must be a map and tensors a list")

    form = _form_of_body(cls, body)
    fields = _form_fields(cls, form)
    scalar_names = [n for n, tp in fields.items() if tp is not torch.Tensor]
    if set(body) != set(scalar_names):
        raise ProtocolError(
            f"{cls.__name__} body must have fields {sorted(scalar_names)}, "
            f"got {reprlib.repr(sorted(body, key=str))}"  # keys may mix str and bytes
        )
    values = {n: _check_value(cls, n, fields[n], body[n]) for n in scalar_names}
    if form == SHARD and values["shard"] < 1:
        raise ProtocolError(
            f"a follower shard's {cls.__name__} has shard 1 or more, got {values['shard']}; "
            "a worker's has no shard field"
        )

    tensor_names = [n for n, tp in fields.items() if tp is torch.Tensor]
    if len(frames) != 1 + len(tensor_names):
        raise ProtocolError(
            f"{cls.__name__} needs {counted(1 + len(tensor_names), 'frame')}, got {len(frames)}"
        )
    if len(specs) != len(tensor_names):
        raise ProtocolError(
            f"{cls.__name__} carries tensors {tensor_names}, header lists {reprlib.repr(specs)}"
        )
    for expected_name, spec, frame in zip(tensor_names, specs, frames[1:], strict=True):
        if not (isinstance(spec, list) and len(spec) == 3):
            raise ProtocolError(
                f"tensor spec must be [name, dtype, numel], got {reprlib.repr(spec)}"
            )
        name, dtype_name, numel = spec
        if name != expected_name:
            raise ProtocolError(f"expected tensor {expected_name!r}, got {reprlib.repr(name)}")
        if not isinstance(dtype_name, str) or dtype_name not in WIRE_DTYPES:
            raise ProtocolError(
                f"tensor {name!r} has dtype {reprlib.repr(dtype_name)}; "
                f"allowed: {sorted(WIRE_DTYPES)}"
            )
        if not isinstance(numel, int) or isinstance(numel, bool) or numel < 0:
            raise ProtocolError(
                f"tensor {name!r} has an invalid element count {reprlib.repr(numel)}"
            )
        dtype = WIRE_DTYPES[dtype_name]
        expected_bytes = numel * dtype.itemsize
        actual_bytes = memoryview(frame).nbytes
        if actual_bytes != expected_bytes:
            raise ProtocolError(
                f"tensor {name!r}: {numel} x {dtype_name} needs {counted(expected_bytes, 'byte')}, "
                f"the frame has {actual_bytes}"
            )
        values[name] = _tensor_from_frame(frame, dtype, numel)
    message: Message = cls(**values)
    return message
