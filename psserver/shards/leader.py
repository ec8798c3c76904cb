"""The leader's side of server sharding: the follower shards it waits for, commits to and reads.

The leader (shard 0) owns the last range of the parameters and runs the job; each follower
(psserver.shards.follower) registers once, gets the job and its slice's starting state, and from
then on hears one COMMIT per update and, in sync mode, one COMMIT with the plan of each step
as it opens; and a ROSTER whenever the job's workers change, since it takes slices from them
only (psserver.shards.roster). The leader keeps a DEALER socket to each follower for COMMIT
and ROSTER (one way), its PULL (the slice back, for evaluation and checkpoints; worker id
LEADER_ID with the leader's token) and a periodic PULL ping (min_version -1) that proves the
follower is alive. A follower that stops answering ends the job
with a clear error: its slice cannot be rebuilt from anywhere else (restart with --resume
from the last checkpoint).

What it is not: the link to one follower. Connecting to it, reading its answers and waiting
for its slice are psserver.shards.follower_link's; this is the group: who may join, what they all
hear, and when one counts as lost.
"""

import logging
import secrets
import subprocess
import time
from collections.abc import Callable

import torch
import zmq

from common.errors import RequestRejected
from common.job import JobSpec
from common.logs import printable
from common.sharding import shard_range
from common.wire.protocol import (
    LEADER_ID,
    Commit,
    Message,
    Pull,
    Register,
    Roster,
    Stop,
    Welcome,
    encode,
)
from common.wire.security import ServerSecurity
from psserver.policies import CommitOrder, OpenStep
from psserver.shards.auth import ShardGate
from psserver.shards.follower_link import FollowerLink, ShardLost, connect_follower
from psserver.shards.launch import check_launched
from psserver.store.parameters import ParameterStore

log = logging.getLogger("ps.server")
EMPTY = torch.empty(0)
WAIT_LOG_S = 15.0  # how often the leader says whom it still waits for
MAX_ENDPOINT_CHARS = 200  # of a follower's endpoint, as its hello says it, in a log line


class ShardGroup:
    def __init__(
        self,
        context: zmq.Context,
        bounds: tuple[int, ...],
        security: ServerSecurity | None,
        timeout_s: float,
        ping_interval_s: float,
        shard_secret: bytes | None = None,
    ) -> None:
        self.context, self.bounds, self.security = context, bounds, security
        # Who may say hello: the followers prove the shard secret, or connect with the key
        # every shard of the job shares (psserver.shards.auth).
        self.gate = ShardGate(shard_secret, security.public_key() if security else None)
        self.num_shards = len(bounds) - 1
        self.timeout_s, self.ping_interval_s = timeout_s, ping_interval_s
        self.token = secrets.token_hex(16)  # proves COMMIT and PULL come from this leader
        self.links: dict[int, FollowerLink] = {}
        self.told_to_stop: set[int] = set()  # the shards `stop` sent STOP (see stop_followers)
        self._momentum: torch.Tensor | None = None  # the whole vector, from a resumed checkpoint
        self._announced: tuple[int, int, int] | None = None  # the step of the last plan sent
        self._roster = Roster(self.token, [], 1)  # the last one sent: a shard that joins gets it
        self._wait_logged = time.monotonic()  # when whom the leader waits for was last said

    @property
    def ready(self) -> bool:
        return len(self.links) == self.num_shards - 1

    def endpoints(self) -> tuple[str, ...]:
        return tuple(self.links[i].endpoint for i in range(1, self.num_shards))

    def waiting_for(self) -> list[int]:
        return [i for i in range(1, self.num_shards) if i not in self.links]

    def watch_joining(self, launched: dict[int, subprocess.Popen[bytes]]) -> None:
        """While followers have yet to join: stop if one this command started (`launched`,
        by shard) has exited (it never will), and say now and then whom the leader waits for."""
        if self.ready:
            return
        waiting = self.waiting_for()
        check_launched(launched, waiting)
        now = time.monotonic()
        if now - self._wait_logged >= WAIT_LOG_S:
            log.info("waiting for shards %s to join", waiting)
            self._wait_logged = now

    def resume_momentum(self, momentum: torch.Tensor | None) -> None:
        self._momentum = momentum

    # ---- joining ---------------------------------------------------------------------------

    def welcome(
        self, hello: Register, sender_key: str, job: JobSpec, store: ParameterStore,
        slice_wait: float, max_staged: int, stream_weights: bool, worker_key: str,
    ) -> Welcome:  # fmt: skip
        """Admit a follower (its REGISTER, `hello`): check it is one of this job's shards and
        fits the job, connect to it, hand it its slice in a follower's WELCOME. `sender_key`:
        the CURVE key the REGISTER came with, or ""."""
        self.gate.check(hello, sender_key)
        if hello.num_shards != self.num_shards or not 1 <= hello.shard < self.num_shards:
            raise RequestRejected(
                "bad-shard",
                f"this job has {self.num_shards} shards (followers 1..{self.num_shards - 1}); "
                f"got shard {hello.shard} of {hello.num_shards}: check --shard and --num-shards",
            )
        if (joined := self.links.get(hello.shard)) is not None:
            # Most likely that shard was restarted by hand: the leader still holds the old
            # one, which it gives up on only after timeout_s of silence, and stops the job.
            silent_s = time.monotonic() - joined.last_heard
            raise RequestRejected(
                "bad-shard",
                f"shard {hello.shard} already joined this job from {joined.endpoint} (last "
                f"heard {silent_s:.0f} s ago); a shard cannot rejoin a running job. If that "
                f"process is gone, the leader stops the job after {self.timeout_s:g} s of its "
                "silence: then restart every shard, with --resume",
            )
        if hello.fingerprints.get(job.model) != store.fingerprint:
            raise RequestRejected(
                "model-mismatch",
                f"shard {hello.shard} builds {job.model} differently from the leader; install "
                "the same release on every shard",
            )
        link = connect_follower(self.context, hello, self.security, self.timeout_s)
        self.links[hello.shard] = link
        # Read once the shard has joined: its first message on this connection.
        self._send(link, encode(self._roster))
        lo, hi = shard_range(self.bounds, hello.shard)
        momentum = self._momentum[lo:hi].clone() if self._momentum is not None else EMPTY
        log.info(
            "shard %d of %d joined from %s: parameters [%d, %d)",
            hello.shard, self.num_shards, printable(hello.endpoint, MAX_ENDPOINT_CHARS), lo, hi,
        )  # fmt: skip
        optimizer = store.optimizer.spec.to_dict()
        return Welcome(
            shard=hello.shard,
            job=job.to_dict(),
            optimizer=optimizer,
            leader_token=self.token,
            version=store.version,
            slice_wait=slice_wait,
            max_staged=max_staged,
            params=store.flat.params[lo:hi].clone(),
            momentum=momentum,
            stream_weights=stream_weights,
            worker_key=worker_key,
        )

    # ---- during the job --------------------------------------------------------------------

    def commit(self, order: CommitOrder) -> None:
        self._send_all(
            Commit(self.token, order.version, order.entries, order.expected, order.lr_scale)
        )

    def announce(self, step: OpenStep | None, version: int, token_of: Callable[[int], str]) -> None:
        """A COMMIT with the plan of the sync step, once per step: whose slices the open step
        takes, so each follower applies a bucket as soon as they are all in, without waiting
        for the update; or, when the step the followers last heard of ended without one,
        that it is over (a COMMIT with neither)."""
        if step is not None and step.key != self._announced:
            entries = [[w, token_of(w), step.share] for w in step.workers]
            plan = Commit(
                self.token, step.version, [], step.expected, 1.0, step.epoch, step.batch, entries
            )
            self._announced = step.key
        elif step is None and self._announced is not None and self._announced[0] == version:
            plan = Commit(self.token, version, [], 0, 1.0)  # abandoned, never committed
            self._announced = None
        else:
            return
        self._send_all(plan)

    def send_roster(self, workers: list[int], next_id: int) -> None:
        """ROSTER: the workers a follower may take slices from now (psserver.shards.roster)."""
        self._roster = Roster(self.token, sorted(workers), next_id)
        self._send_all(self._roster)

    def keep_alive(self, now: float) -> None:
        """Ping every follower now and then, read the answers, and give up on a silent one."""
        for link in self.links.values():
            link.drain()
            if now - link.last_heard > self.timeout_s:
                raise ShardLost(
                    f"shard {link.shard} at {link.endpoint} has not answered for "
                    f"{now - link.last_heard:.0f} s; the job cannot go on without its slice. "
                    "Restart every shard, with --resume to go on from the last checkpoint"
                )
            if now - link.pinged >= self.ping_interval_s:
                link.pinged = now
                self._send(link, encode(self._pull(link.shard, -1, False)))

    def follower_bytes(self) -> tuple[int, int]:
        """(pushed, streamed): the followers' traffic this session, as of their last answers
        (a gather's answers come once every update before it is applied)."""
        links = self.links.values()
        return sum(link.pushed_bytes for link in links), sum(link.streamed_bytes for link in links)

    def excuse_silence(self) -> None:
        """The leader was busy (evaluating); nobody could be heard meanwhile."""
        now = time.monotonic()
        for link in self.links.values():
            link.last_heard = max(link.last_heard, now)

    def gather(self, store: ParameterStore, with_momentum: bool) -> torch.Tensor | None:
        """Copy every follower's slice at the leader's version into the store's model.

        Returns the whole momentum vector when asked for it and the optimizer has one.

        A follower that has not joined yet (a resumed run that is already over ends before
        any does) has nothing to send: no step runs without it, so the store still holds its
        slice as the checkpoint or the seed made it, and its momentum is the resumed one."""
        for joined in self.links.values():  # each PULL names its shard
            self._send(joined, encode(self._pull(joined.shard, store.version, with_momentum)))
        leader_momentum = store.momentum()
        pieces: list[torch.Tensor | None] = [leader_momentum]
        for shard in range(1, self.num_shards):
            lo, hi = shard_range(self.bounds, shard)
            link = self.links.get(shard)
            if link is None:
                resumed = self._momentum
                pieces.append(resumed[lo:hi] if resumed is not None else None)
                continue
            # A follower may first wait up to timeout_s for a slice whose worker died (see
            # psserver.serving.staging), so it gets twice that before it counts as lost.
            reply = link.await_slice(store.version, 2 * self.timeout_s)
            if reply.params.numel() != hi - lo:
                raise ShardLost(f"shard {shard} sent {reply.params.numel()} values, not {hi - lo}")
            store.flat.params[lo:hi].copy_(reply.params)
            pieces.append(reply.momentum if reply.momentum.numel() else None)
        if not with_momentum or all(piece is None for piece in pieces):
            return None
        momentum = torch.zeros(store.num_params)  # (P,) a shard without one yet has zeros
        for shard, piece in enumerate(pieces):
            if piece is not None:
                lo, hi = shard_range(self.bounds, shard)
                momentum[lo:hi].copy_(piece)
        return momentum

    def stop(self) -> None:
        """Tell every follower the job is over, then let go of the sockets."""
        frames = encode(Stop("training is over"))
        for link in self.links.values():
            try:
                link.socket.send_multipart(frames, zmq.NOBLOCK)
            except zmq.ZMQError:
                log.warning("could not tell shard %d to stop", link.shard)
        self.told_to_stop |= set(self.links)
        for link in self.links.values():
            link.socket.close(linger=500)  # let the STOP leave
        self.links.clear()

    def _pull(self, shard: int, version: int, with_momentum: bool) -> Pull:
        """The leader's PULL of a follower's slice at `version`; -1: a ping (no tensors)."""
        return Pull(LEADER_ID, self.token, -1, shard, version, with_momentum)

    def _send_all(self, message: Message) -> None:
        """One message to every follower, encoded once."""
        frames = encode(message)
        for link in self.links.values():
            self._send(link, frames)

    def _send(self, link: FollowerLink, frames: list) -> None:
        try:
            link.socket.send_multipart(frames, copy=False)
        except zmq.Again:
            raise ShardLost(
                f"shard {link.shard} at {link.endpoint} takes no messages (send timed out "
                f"after {self.timeout_s:g} s); restart every shard, with --resume"
            ) from None
