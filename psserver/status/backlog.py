"""STATUS replies not yet sent: a cap on the memory that askers who never read can pin.

Anyone may ask for the status, without registering, and each reply is built afresh (a few KB,
up to some 45 KB with many workers). ZeroMQ queues up to SNDHWM (1,000) messages for a peer
that does not read them, past what the kernel's socket buffers take, so 100 connections that
each asked 1,000 times and never read took a server from 0.5 to 3 GB.

Each STATUS reply is therefore sent with a tracker, which says when ZeroMQ has handed it to
the kernel. A request that finds too many of its own connection's replies, or too many of
everyone's, still queued is refused as busy (an ERROR of some 200 bytes) rather than answered.
An asker that reads its replies, such as ps-status, has at most one waiting at a time.

What it is not: a rate limit. A client that reads may ask as often as it likes.
"""

from typing import Protocol

from common.errors import RequestRejected

PER_PEER = 4  # unsent replies one connection may hold
TOTAL = 64  # and all connections together: about 3 MB at the largest status


class Tracker(Protocol):
    """What is used of a zmq.MessageTracker."""

    @property
    def done(self) -> bool: ...


class StatusBacklog:
    def __init__(self, per_peer: int = PER_PEER, total: int = TOTAL) -> None:
        self.per_peer, self.total = per_peer, total
        self._unsent: dict[bytes, list[Tracker]] = {}  # peer identity: its replies' trackers

    def admit(self, identity: bytes) -> None:
        """Raise RequestRejected("busy") when this peer, or everyone, has too many replies
        waiting to leave; otherwise return, and the caller sends one and calls `sent`."""
        self._forget_sent()
        if len(self._unsent.get(identity, ())) >= self.per_peer:
            raise RequestRejected(
                "busy",
                f"{self.per_peer} status replies to this connection have not been read yet; "
                "read them before asking again",
            )
        if self.unsent() >= self.total:
            raise RequestRejected(
                "busy",
                f"{self.total} status replies wait for askers that do not read them; "
                "ask again later",
            )

    def sent(self, identity: bytes, tracker: Tracker) -> None:
        if not tracker.done:
            self._unsent.setdefault(identity, []).append(tracker)

    def unsent(self) -> int:
        return sum(len(trackers) for trackers in self._unsent.values())

    def _forget_sent(self) -> None:
        # At most `total` trackers are kept, so this pass stays short.
        for identity, trackers in list(self._unsent.items()):
            left = [tracker for tracker in trackers if not tracker.done]
            if left:
                self._unsent[identity] = left
            else:
                del self._unsent[identity]
