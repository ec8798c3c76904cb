"""Who a follower shard takes slices from: the job's workers, as the leader's membership has them.

The leader derives each worker's token from its id and a per-job secret (`worker_token`), and
hands that secret to every follower in its WELCOME. After each change of membership (a
worker registers, leaves or is declared dead) it sends every follower a ROSTER: the ids of
the workers in the job now, and the id the next worker will get. A follower takes a slice
push or pull only from a worker whose token is right for its id and which

- the last ROSTER lists, or
- registered after that ROSTER was sent: its id is at least the roster's `next_id`.

Why the second rule, and not just "send the ROSTER before the WELCOME": the leader does send
it first, and ZeroMQ keeps the order on the leader's own connection, but the follower reads
its ROUTER socket fairly across connections. When the leader's connection has commits queued
(a busy shard), a worker's first pull on its own connection can be read before the ROSTER
that lists it. Refusing it then would send a real worker back to register, and waiting for
the ROSTER would need a buffer of unknown senders' requests. The token proves the leader
issued this id, and an id at or past `next_id` has not left yet (ids are never reused), so
the follower can take it at once, and only gone workers are refused.

What this is not: a limit on what a registered worker sends. Anyone the leader admits gets a
token; CURVE (common.wire.security) decides who may connect at all.
"""

import hashlib
import hmac
import secrets

from common.errors import ProtocolError, RequestRejected
from common.wire.protocol import Roster

TOKEN_HEX = 32  # 128 bits, as many as the random tokens before


def new_worker_key() -> str:
    """A job's secret for worker tokens: only the leader and its followers know it."""
    return secrets.token_hex(32)


def worker_token(key: str, worker_id: int) -> str:
    """The token of worker `worker_id` in the job whose secret is `key`."""
    digest = hmac.new(key.encode(), str(worker_id).encode(), hashlib.sha256).hexdigest()
    return digest[:TOKEN_HEX]


class WorkerRoster:
    """A follower's view of the job's workers (see the module docstring)."""

    def __init__(self, key: str, shard: int) -> None:
        if not key:
            raise ProtocolError(
                "the leader sent no worker key; run the same release on every shard"
            )
        self.key, self.shard = key, shard
        self.workers: frozenset[int] = frozenset()
        # Until the first ROSTER (sent right after the follower's WELCOME) every id is newer than
        # the last one heard of; no worker registers before all shards joined anyway.
        self.next_id = 0

    def update(self, roster: Roster) -> None:
        if roster.next_id < self.next_id or any(w >= roster.next_id for w in roster.workers):
            raise RequestRejected(
                "bad-message",
                f"a ROSTER lists workers {sorted(roster.workers)} with next id "
                f"{roster.next_id}, after one with next id {self.next_id}",
            )
        self.workers, self.next_id = frozenset(roster.workers), roster.next_id

    def authenticate(self, worker_id: int, token: str, identity: bytes = b"", key: str = "") -> int:
        """The worker's id, or a refusal of a request that is not from a worker of the job, as
        the leader would refuse it. The connection and the CURVE key do not matter here: the
        token proves the leader admitted this id (psserver.serving.pushes.Senders)."""
        expected = worker_token(self.key, worker_id).encode()
        if not secrets.compare_digest(token.encode("utf-8", "replace"), expected):
            raise RequestRejected(
                "unknown-worker",
                f"worker {worker_id} is not registered with this job (shard {self.shard}); "
                "register again",
            )
        if worker_id not in self.workers and worker_id < self.next_id:
            raise RequestRejected(
                "unknown-worker",
                f"worker {worker_id} has left the job or was declared dead (shard "
                f"{self.shard}); register again to rejoin",
            )
        return worker_id
