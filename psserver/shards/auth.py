"""Who may join a sharded job as a follower: the shard secret, its proof, and the leader's gate.

A follower's WELCOME hands it the leader token and the key every worker's token is derived
from (psserver.shards.roster), so a stranger that reached the leader's port and registered as
shard I before the real follower would get all of that, and the real one would be refused.
The leader takes a follower's REGISTER (one with `shard`) only from a follower that shows it
belongs to the job:

- with CURVE, by its key: the shards of a job share the server's key pair, so a follower's
  REGISTER must come over a connection that authenticated with that key. A worker's key is
  authorized to connect, but not to join as a shard.
- with a shard secret, by a proof: HMAC-SHA256 of the secret over `shard|num_shards|endpoint`.
  The leader that starts its followers makes a secret and writes it to their standard input
  (`--shard-secret-file -`); followers started by hand read it from `--shard-secret-file`,
  as their leader does.

A leader with neither takes any follower's REGISTER, and says so once when it starts.

What it is not: encryption. Without CURVE the welcome itself crosses the network in the clear:
the secret keeps out whoever can reach the port, not whoever can read the traffic.
"""

import hashlib
import hmac
import logging
import os
import secrets
import sys
from dataclasses import dataclass, field
from pathlib import Path

from common.errors import ConfigError, RequestRejected
from common.logs import counted
from common.wire.protocol import Register
from common.wire.security import warn_if_anyone_can_read

log = logging.getLogger("ps.server")

OPTION = "--shard-secret-file"
FROM_STDIN = Path("-")  # --shard-secret-file -: the secret comes on standard input
MIN_SECRET_BYTES = 16  # a shorter one could be guessed, one REGISTER at a time
MAX_SECRET_FILE_BYTES = 4096  # a secret is a line of text; anything longer is the wrong file
MAKE_ONE = "(umask 077; openssl rand -hex 32 > FILE)"
# What a follower refused for its proof should do; the leader sends it in the ERROR.
PROOF_FIX = (
    f"start the follower with the same {OPTION} as the leader, or let the leader start its "
    "followers (ps-server --num-shards K without --shard)"
)


def new_shard_secret() -> bytes:
    """A secret for the followers a leader starts itself (64 hex digits, 256 bits)."""
    return secrets.token_hex(32).encode("ascii")


def read_shard_secret(path: Path) -> bytes:
    """The secret in a --shard-secret-file (surrounding white space dropped), or on standard
    input for `-`, or a ConfigError that says what is wrong with it and how to make one."""
    if path == FROM_STDIN:
        secret = _read_secret_from_stdin()
        where = f"{OPTION} -: standard input"
        if len(secret) > MAX_SECRET_FILE_BYTES:
            raise ConfigError(
                f"{where} holds more than {MAX_SECRET_FILE_BYTES} bytes, but a shard secret is "
                f"one line; make one with {MAKE_ONE}"
            )
    else:
        secret = _read_secret_file(path)
        where = f"{OPTION} {path}:"
    if len(secret) < MIN_SECRET_BYTES:
        what = "is empty" if not secret else f"holds only {counted(len(secret), 'byte')}"
        raise ConfigError(
            f"{where} {what}; a shard secret needs at least {MIN_SECRET_BYTES}, so that it "
            f"cannot be guessed: make one with {MAKE_ONE}"
        )
    if path != FROM_STDIN:
        warn_if_anyone_can_read(path, OPTION)
    return secret


def _read_secret_from_stdin() -> bytes:
    if sys.stdin is None:
        raise ConfigError(f"{OPTION} -: this process has no standard input to read it from")
    if sys.stdin.isatty():
        log.info("reading the shard secret from standard input: type it, then Ctrl-D")
    try:
        return sys.stdin.buffer.read(MAX_SECRET_FILE_BYTES + 1).strip()
    except OSError as exc:
        raise ConfigError(f"{OPTION} -: cannot read standard input ({exc.strerror})") from None


def _read_secret_file(path: Path) -> bytes:
    if not path.is_file():
        what = "a folder, not a file" if path.is_dir() else "no such file"
        raise ConfigError(f"{OPTION} {path}: {what}; make one with {MAKE_ONE}")
    try:
        size = path.stat().st_size
        if size > MAX_SECRET_FILE_BYTES:
            raise ConfigError(
                f"{OPTION} {path}: {size} bytes, but a shard secret is one line of at most "
                f"{MAX_SECRET_FILE_BYTES} bytes; is it the right file? Make one with {MAKE_ONE}"
            )
        return path.read_bytes().strip()
    except OSError as exc:
        raise ConfigError(
            f"{OPTION} {path}: cannot read it ({exc.strerror}); check its owner and mode"
        ) from None


def write_secret_file(path: Path, secret: bytes) -> Path:
    """Write a new file that only this user can read (0600 from the start, not after a
    chmod) and return its path."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as file:
        file.write(secret)
    return path


def shard_proof(secret: bytes, shard: int, num_shards: int, endpoint: str) -> str:
    """What a follower's REGISTER.proof holds. It covers the endpoint too, so a REGISTER cannot
    be passed off with another shard's number or with the endpoint changed to one a stranger
    listens on."""
    text = f"{shard}|{num_shards}|{endpoint}".encode()
    return hmac.new(secret, text, hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class ShardGate:
    """The leader's check of a follower's REGISTER, before it looks at anything else it says."""

    secret: bytes | None = field(default=None, repr=False)  # the job's shard secret
    server_key: str | None = None  # with CURVE: the z85 public key every shard uses

    @property
    def admits_anyone(self) -> bool:
        """Whether any host that reaches the leader can join as a shard."""
        return self.secret is None and self.server_key is None

    def warn_if_open(self, endpoint: str) -> None:
        if self.admits_anyone:
            log.warning(
                "any host that reaches %s can join this job as a follower shard, and would "
                "get the key to every worker's token: give the leader and every follower the "
                "same %s (make one with %s), or use CURVE (--curve-* options)",
                endpoint, OPTION, MAKE_ONE,
            )  # fmt: skip

    def check(self, hello: Register, sender_key: str) -> None:
        """Raise RequestRejected ("bad-shard") unless a follower's REGISTER comes from a shard
        of this job. `sender_key`: the z85 CURVE key the sender connected with ("" without
        CURVE)."""
        who = f"a REGISTER as shard {hello.shard}"
        if self.server_key is not None and sender_key != self.server_key:
            raise RequestRejected(
                "bad-shard",
                f"{who} came with the CURVE key {sender_key or '(none)'}, not the job's server "
                "key: a worker's key connects but cannot join as a shard. Start the follower "
                "with the leader's --curve-secret-key (server.key_secret) and "
                "--curve-authorized-clients",
            )
        if self.secret is None:
            return
        if not hello.proof:
            raise RequestRejected(
                "bad-shard", f"{who} proves no shard secret, and this leader has one: {PROOF_FIX}"
            )
        expected = shard_proof(self.secret, hello.shard, hello.num_shards, hello.endpoint)
        # Bytes, not str: compare_digest refuses a str that is not ASCII with a TypeError.
        if not hmac.compare_digest(hello.proof.encode("utf-8", "replace"), expected.encode()):
            raise RequestRejected(
                "bad-shard",
                f"{who} proves a shard secret that is not this leader's: {PROOF_FIX}",
            )
