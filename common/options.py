"""Every option of the product's commands, declared once, in the groups the commands share.

An `Option` is read by click (`options(...)` decorates a command with some) and written back
by common.roles when one command starts another (ps-local its server and workers, a leader
its follower shards, ps-bench its runs, the tests their clusters): the flag, the type and the
default are said once for both. A command that needs its own default or help for a shared
option takes `OPTION.but(...)`; every option is also read from PS_<FLAG> (common.cli).

What this is not: what an option's value means to the job. The validated specs are
psserver.config.ServerConfig (the job and its leader), psserver.shards.joining.FollowerConfig
and common.roles.WorkerSpec; ps-bench's options are psserver.bench.options'.
"""

import dataclasses
import functools
import types
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import click

from common.catalog import DATASET_NAMES, MODEL_NAMES
from common.cli import (
    BucketMegabytes,
    CompressionName,
    DeviceName,
    FiniteFloatRange,
    timeout_seconds,
)
from common.job import MODES
from common.logs import LEVELS
from common.sharding import MAX_SHARDS

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")
PositiveInt = click.IntRange(min=1)
PROGRESS_MODES = ("auto", "bar", "log", "none")  # ps-worker --progress
UNCHANGED: Any = object()  # Option.but: this attribute stays as declared


@dataclasses.dataclass(frozen=True)
class Option:
    """One command-line option. `flag` is its name as typed; a switch names both sides
    ("--overlap/--no-overlap"). `name` is the value's name in the code, when it is not the
    flag's ("--json" read into `json_path`). `is_flag`: present or absent (--force)."""

    flag: str
    help: str | None = None
    type: Any = None
    default: Any = None
    show_default: bool | str | None = None
    name: str | None = None
    is_flag: bool = False
    multiple: bool = False
    required: bool = False
    metavar: str | None = None
    callback: Callable[[click.Context, click.Parameter, Any], Any] | None = None

    @property
    def dest(self) -> str:
        """The value's name: what click passes the command, and a spec's field."""
        return self.name or self.flag.split("/")[0].removeprefix("--").replace("-", "_")

    @property
    def is_switch(self) -> bool:
        return "/" in self.flag

    def but(
        self, *, help: Any = UNCHANGED, type: Any = UNCHANGED, default: Any = UNCHANGED,
        show_default: Any = UNCHANGED,
    ) -> "Option":  # fmt: skip
        """This option with a command's own help, type, default or shown default."""
        changes = {"help": help, "type": type, "default": default, "show_default": show_default}
        return dataclasses.replace(
            self, **{key: value for key, value in changes.items() if value is not UNCHANGED}
        )

    def decorate(self, func: F) -> F:
        settings: dict[str, Any] = {"default": self.default, "help": self.help}
        for key in ("type", "show_default", "metavar", "callback"):
            if getattr(self, key) is not None:
                settings[key] = getattr(self, key)
        for key in ("is_flag", "multiple", "required"):  # click reads False as "not a flag"
            if getattr(self, key):
                settings[key] = True
        names = [self.flag] if self.name is None else [self.flag, self.name]
        return click.option(*names, **settings)(func)

    def args(self, value: Any) -> list[str]:
        """`value` on a command line, as this option reads it back; [] for None."""
        if value is None:
            return []
        flag, _, negative = self.flag.partition("/")
        if self.is_switch or self.is_flag:
            if not isinstance(value, bool):
                raise TypeError(f"{flag} takes True or False, got {value!r}")
            if self.is_flag:
                return [flag] if value else []
            return [flag if value else negative]
        if self.multiple:
            return [text for item in value for text in (flag, str(item))]
        return [flag, str(value)]


def options(*declared: Option | Sequence[Option]) -> Callable[[F], F]:
    """Decorate a command with options and groups of options, in that order in --help."""
    flat = [one for item in declared for one in ([item] if isinstance(item, Option) else item)]

    def decorate(func: F) -> F:
        for option in reversed(flat):
            func = option.decorate(func)
        return func

    return decorate


# ---- what a job trains: ps-server's and ps-local's -----------------------------------------

MODE = Option(
    "--mode",
    type=click.Choice(MODES),
    default="sync",
    show_default=True,
    help="sync: one gradient from every worker per step; async: apply on arrival.",
)
WORKERS = Option(
    "--workers",
    type=PositiveInt,
    default=2,
    show_default=True,
    help="Number of workers (data shards) the job waits for.",
)
MODEL = Option(
    "--model",
    type=click.Choice(list(MODEL_NAMES)),
    default="resnet18",
    show_default=True,
    help="D2L ResNet-18, or the BatchNorm-free LeNet.",
)
DATASET = Option(
    "--dataset",
    type=click.Choice(DATASET_NAMES),
    default="embedded",
    show_default=True,
    help="embedded: the subset shipped in the package; fashion-mnist: --data-dir.",
)
DATA_DIR = Option(
    "--data-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Folder holding FashionMNIST/raw (for --dataset fashion-mnist).",
)
DOWNLOAD = Option(
    "--download/--no-download",
    default=False,
    show_default=True,
    help="Download Fashion-MNIST into --data-dir if it is not there.",
)
TRAIN_LIMIT = Option(
    "--train-limit", type=PositiveInt, default=None, help="Use only the first N training images."
)
TEST_LIMIT = Option(
    "--test-limit", type=PositiveInt, default=None, help="Use only the first N test images."
)
BATCH_SIZE = Option(
    "--batch-size",
    type=PositiveInt,
    default=128,
    show_default=True,
    help="Batch size per worker; the global batch is workers x this.",
)
LR = Option(
    "--lr",
    type=FiniteFloatRange(min=0, min_open=True),
    default=0.1,
    show_default=True,
    help="SGD learning rate.",
)
MOMENTUM = Option(
    "--momentum",
    type=FiniteFloatRange(0, 1, max_open=True),
    default=0.0,
    show_default=True,
    help="SGD momentum.",
)
WEIGHT_DECAY = Option(
    "--weight-decay",
    type=FiniteFloatRange(min=0),
    default=0.0,
    show_default=True,
    help="SGD weight decay.",
)
SEED = Option(
    "--seed",
    type=int,
    default=0,
    show_default=True,
    help="Seed for the initial weights and the data order.",
)
EPOCHS = Option(
    "--epochs",
    type=PositiveInt,
    default=1,
    show_default=True,
    help="Passes over the training set.",
)
MAX_STEPS = Option(
    "--max-steps",
    type=PositiveInt,
    default=None,
    help="Stop after this many updates, even mid-epoch.",
)
CHECKPOINT_DIR = Option(
    "--checkpoint-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Write DIR/latest.pt during and at the end of training.",
)
CHECKPOINT_EVERY = Option(
    "--checkpoint-every",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Also checkpoint every N steps (0: only at the end); needs --checkpoint-dir.",
)
RESUME = Option(
    "--resume/--no-resume",
    default=False,
    show_default=True,
    help="Continue from --checkpoint-dir/latest.pt.",
)
RESUME_FROM = Option(
    "--resume-from",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Continue from this checkpoint file instead (a DIR/step-N.pt, say); new "
    "checkpoints go to --checkpoint-dir as usual.",
)
KEEP_CHECKPOINTS = Option(
    "--keep-checkpoints",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Also keep the K most recent checkpoints as DIR/step-N.pt, to go back to with "
    "--resume-from (0: only latest.pt and previous.pt).",
)
MIN_WORKERS = Option(
    "--min-workers",
    type=PositiveInt,
    default=1,
    show_default=True,
    help="sync: a step closes with at least this many gradients, and with fewer live "
    "workers the epoch ends early and training pauses until this many are ready. async "
    "and ssp: an epoch after the first begins only once this many workers are ready (the "
    "first waits for --workers); an epoch under way goes on while any worker is left.",
)
MAX_WORKERS = Option(
    "--max-workers",
    type=PositiveInt,
    default=None,
    help="Most workers admitted at once (default: 2 x --workers).",
)
STEP_TIMEOUT = Option(
    "--step-timeout",
    type=timeout_seconds(),
    default=120.0,
    show_default=True,
    help="sync: close a step after this many seconds with the gradients that came "
    "(async and ssp have no step to close).",
)
WORKER_TIMEOUT = Option(
    "--worker-timeout",
    type=timeout_seconds(),
    default=30.0,
    show_default=True,
    help="Declare a worker dead after this many seconds without a heartbeat.",
)
COMPRESS = Option(
    "--compress",
    type=CompressionName(),
    default="none",
    show_default=True,
    help="Gradient compression on the wire: none, fp16, bf16 or topk:RATIO (e.g. "
    "topk:0.01; the worker keeps what it did not send and adds it to the next step).",
)
NUM_SHARDS = Option(
    "--num-shards",
    type=click.IntRange(1, MAX_SHARDS),
    default=1,
    show_default=True,
    help="Split the parameters over this many server processes (ps-lite style key "
    f"ranges, at most {MAX_SHARDS}); workers push and pull all slices in parallel. "
    "ps-server starts the other K-1 itself unless given --shard.",
)
PUSH_CREDITS = Option(
    "--push-credits",
    type=click.IntRange(min=0),
    default=2,
    show_default=True,
    help="Flow control: how many workers may send a gradient at once, which bounds the "
    "server's memory for any number of workers (with K shards, K times as many send "
    "the leader their 1/K slice); 0 turns it off.",
)
BUCKET_MB = Option(
    "--bucket-mb",
    type=BucketMegabytes(min=0),
    default=None,
    show_default="2 over --num-shards, at least 0.5",
    help="Gradient buckets, in MB of float32 (like DDP's bucket_cap_mb): workers send "
    "each bucket as soon as backward has it (ps-worker --overlap) and the server applies "
    "each as soon as every worker's has come; a tensor of twice this or more is cut into "
    "pieces. Small buckets pay over slow links; 0 makes the gradient one piece, and a "
    "positive size must hold one float32 value (4 bytes, 3.82e-06 MB). Every bucket is a "
    "message per worker and step: thousands of them make each step cost seconds. The "
    "default cuts every shard's slice of ResNet-18 into about 20.",
)
STREAM_WEIGHTS = Option(
    "--stream-weights/--no-stream-weights",
    default=True,
    show_default=True,
    help="Sync mode with buckets: send each updated bucket straight back to the workers "
    "whose parts it summed, so that their next pull carries no parameters.",
)
STALENESS = Option(
    "--staleness",
    type=click.IntRange(min=0),
    default=2,
    show_default=True,
    help="--mode ssp: a worker may be at most this many steps ahead of the slowest.",
)
STALENESS_LR = Option(
    "--staleness-lr/--no-staleness-lr",
    default=True,
    show_default=True,
    help="async and ssp: a gradient s versions old counts 1/s: it is scaled before it "
    "enters the momentum (without momentum: a step of lr/s).",
)
EVAL_DEVICE = Option(
    "--eval-device",
    type=DeviceName(),
    default="cpu",
    show_default=True,
    help="Where the server evaluates its weights on the test set.",
)
LOG_DIR = Option(
    "--log-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Write per-step metrics to DIR/server.jsonl and TensorBoard events to DIR/tb "
    "(ps-local: the workers' too); plot them with ps-plot DIR.",
)

JOB_OPTIONS = (
    MODE, WORKERS, MODEL, DATASET, DATA_DIR, DOWNLOAD, TRAIN_LIMIT, TEST_LIMIT, BATCH_SIZE, LR,
    MOMENTUM, WEIGHT_DECAY, SEED, EPOCHS, MAX_STEPS, CHECKPOINT_DIR, CHECKPOINT_EVERY, RESUME,
    RESUME_FROM, KEEP_CHECKPOINTS, MIN_WORKERS, MAX_WORKERS, STEP_TIMEOUT, WORKER_TIMEOUT,
    COMPRESS, NUM_SHARDS, PUSH_CREDITS, BUCKET_MB, STREAM_WEIGHTS, STALENESS, STALENESS_LR,
    EVAL_DEVICE, LOG_DIR,
)  # fmt: skip

# ---- every command --------------------------------------------------------------------------

LOG_LEVEL = Option("--log-level", type=click.Choice(LEVELS), default="info", help="Log verbosity.")
THREADS = Option(
    "--threads",
    type=click.IntRange(min=1),
    default=None,
    help="Torch CPU threads (default: this host's cores shared among the ps-server and "
    "ps-worker processes running on it, counted again as they come and go).",
)
ENDPOINT_FILE = Option(
    "--endpoint-file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write the bound endpoint (with the real port) to this file.",
)

# ---- CURVE: each role takes both of its two or neither (common.security_options) ------------


def _curve_secret_key(role: str, example: str) -> Option:
    return Option(
        "--curve-secret-key",
        type=click.Path(dir_okay=False, path_type=Path),
        default=None,
        help=f"This {role}'s CURVE secret key file ({example} from ps-keys); turns on "
        "encryption and authentication.",
    )


SERVER_SECURITY_OPTIONS = (
    _curve_secret_key("server", "DIR/server.key_secret"),
    Option(
        "--curve-authorized-clients",
        type=click.Path(file_okay=False, path_type=Path),
        default=None,
        help="Folder of the public key files of the workers allowed to connect "
        "(DIR/authorized_clients from ps-keys); needs --curve-secret-key.",
    ),
)
CLIENT_SECURITY_OPTIONS = (
    _curve_secret_key("client", "DIR/client-N.key_secret"),
    Option(
        "--curve-server-key",
        type=click.Path(dir_okay=False, path_type=Path),
        default=None,
        help="The server's public key file (DIR/server.key from ps-keys); needs "
        "--curve-secret-key.",
    ),
)

# ---- ps-server: the server process, and the shards of a sharded job ------------------------

BIND = Option(
    "--bind",
    default="tcp://127.0.0.1:5555",
    help="ZeroMQ endpoint to listen on; tcp://0.0.0.0:5555 for other hosts, "
    "tcp://127.0.0.1:* for a free port.",
)
SUMMARY = Option(
    "--summary",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write a JSON summary of the run here.",
)
SERVER_THREADS = THREADS.but(
    help="Torch CPU threads for updates and evaluation (default: this host's cores shared "
    "among the ps-server and ps-worker processes running on it, counted again as they come "
    "and go)."
)
STOP_GRACE = Option(
    "--stop-grace",
    type=FiniteFloatRange(min=0),
    default=10.0,
    help="Seconds to wait at the end for every worker to hear STOP.",
)
LINGER = Option(
    "--linger",
    type=FiniteFloatRange(min=0),
    default=0.0,
    help="After the summary, go on answering every worker that comes with STOP (and "
    "ps-status with the status) for this many seconds, or until SIGTERM: a worker that a "
    "supervisor restarts after the end (Kubernetes) then hears the job is over and exits 0.",
)
METRICS_PORT = Option(
    "--metrics-port",
    type=click.IntRange(1, 65535),
    default=None,
    help="Serve Prometheus metrics at http://HOST:PORT/metrics (plain HTTP, no auth); HOST is "
    "127.0.0.1, or every interface when --bind is not loopback.",
)
SHARD_OPTIONS = (
    Option(
        "--shard",
        type=click.IntRange(min=0),
        default=None,
        help="With --num-shards K, run only shard I: 0 is the leader (it waits for the "
        "others), 1..K-1 are followers that join --leader. Without it the leader starts the "
        "followers.",
    ),
    Option(
        "--leader",
        default=None,
        help="A follower shard's leader endpoint (shard 0), e.g. tcp://ps-0:5555.",
    ),
    Option(
        "--advertise-host",
        default=None,
        help="The host name workers use to reach a follower shard (default: the --bind host, "
        "or this machine's name when --bind is a wildcard).",
    ),
    Option(
        "--leader-timeout",
        type=timeout_seconds(),
        default=600.0,
        help="A follower gives up after this many seconds without word from the leader.",
    ),
    Option(
        "--shard-secret-file",
        type=click.Path(dir_okay=False, allow_dash=True, path_type=Path),
        default=None,
        help="A file holding the secret the shards of a job share: the leader admits only the "
        "followers that prove it. Give every shard started with --shard the same file (or `-` "
        "to read it from standard input); a leader makes one for the followers it starts. "
        "Make one with `(umask 077; openssl rand -hex 32 > FILE)`.",
    ),
)
SERVER_OPTIONS = (
    BIND, *JOB_OPTIONS, SUMMARY, SERVER_THREADS, STOP_GRACE, LINGER, ENDPOINT_FILE, METRICS_PORT,
    *SHARD_OPTIONS, *SERVER_SECURITY_OPTIONS, LOG_LEVEL,
)  # fmt: skip
# The options of ps-server's that a follower shard reads; every other one describes the job,
# which a follower takes from its leader.
FOLLOWER_READS = frozenset(
    {"bind", "num_shards", "threads", "endpoint_file", "log_level"}
    | {option.dest for option in SHARD_OPTIONS + SERVER_SECURITY_OPTIONS}
)

# ---- ps-local -------------------------------------------------------------------------------

LOCAL_DEVICE = Option(
    "--device",
    type=click.Choice(["auto", "cpu", "cuda"]),
    default="auto",
    help="auto: one GPU per worker if there are enough, else the CPU.",
)
LOCAL_OPTIONS = (
    *JOB_OPTIONS,
    LOCAL_DEVICE,
    THREADS.but(
        help="Torch threads per child (default: this machine's cores / (workers + server "
        "shards), at least 1)."
    ),
    SUMMARY.but(
        help="Write the server's JSON summary here (default: summary.json in a new ps-local-* "
        "folder in the temporary folder)."
    ),
    LOG_LEVEL,
)

# ---- ps-worker and ps-status: the clients ---------------------------------------------------

WORKER_OPTIONS = (
    Option("--server", default="tcp://127.0.0.1:5555", help="The ps-server endpoint."),
    Option("--gpu", type=click.IntRange(min=0), default=None, help="Compute on cuda:GPU."),
    Option(
        "--device",
        type=DeviceName(),
        default=None,
        help="Explicit device: cpu or cuda:N (default: cuda:0 if present, else cpu).",
    ),
    DATA_DIR.but(help="This host's folder holding FashionMNIST/raw (for --dataset fashion-mnist)."),
    DOWNLOAD.but(show_default=None),
    Option("--name", default=None, help="Label in the server's logs (default: host:device)."),
    Option(
        "--timeout",
        type=timeout_seconds(),
        default=60.0,
        help="Seconds of server silence (no reply, no heartbeat) before a retry.",
    ),
    Option(
        "--retries",
        type=click.IntRange(min=0),
        default=5,
        help="Retries of a request, with exponential backoff, before giving up.",
    ),
    Option(
        "--join-timeout",
        type=timeout_seconds(),
        default=60.0,
        help="Seconds the first registration waits for a server that has not answered yet (a "
        "wrong --server, or one not started yet), saying meanwhile that nothing answers; raise "
        "it where the server may start minutes after its workers. A server that stops "
        "answering once this worker has joined is waited for by --timeout and --retries.",
    ),
    Option(
        "--step-delay",
        type=FiniteFloatRange(min=0),
        default=0.0,
        help="Sleep this long before each push: fault injection, to play a straggler.",
    ),
    THREADS,
    Option(
        "--progress",
        type=click.Choice(PROGRESS_MODES),
        default="auto",
        help="A progress bar on a terminal, or log lines when piped.",
    ),
    LOG_DIR.but(
        help="Write per-step metrics to DIR/worker-ID.jsonl and TensorBoard events to DIR/tb."
    ),
    Option(
        "--overlap/--no-overlap",
        default=True,
        show_default=True,
        help="Send each gradient bucket (the server's --bucket-mb) and each server shard's "
        "slice as soon as backward has produced it, instead of the whole gradient after "
        "backward; in sync mode the server then streams each updated bucket back as soon as "
        "it is applied.",
    ),
    *CLIENT_SECURITY_OPTIONS,
    LOG_LEVEL,
)

STATUS_OPTIONS = (
    Option("--server", default="tcp://127.0.0.1:5555", help="The server's endpoint."),
    Option(
        "--json", name="as_json", is_flag=True, default=False, help="Print the raw status as JSON."
    ),
    Option(
        "--timeout",
        type=timeout_seconds(),
        default=10.0,
        help="Seconds to wait for the answer.",
    ),
    *CLIENT_SECURITY_OPTIONS,
)


# ---- from a command's options to its specs --------------------------------------------------


def with_params(func: Callable[[Mapping[str, Any]], None]) -> Callable[..., None]:
    """A click command's function that takes its option values as one read-only mapping,
    from which it builds its specs (`spec_of`), rather than one argument per option."""

    @functools.wraps(func)
    def command(**params: Any) -> None:  # click passes each option by its name
        func(types.MappingProxyType(params))

    return command


def spec_of(cls: type[T], params: Mapping[str, Any]) -> T:
    """A `cls` (a frozen, validated dataclass whose fields are options) from a command's
    option values; a field that no option of the command sets keeps its default."""
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    return cls(**{field.name: params[field.name] for field in fields if field.name in params})
