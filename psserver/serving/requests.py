"""Serving one request on a ROUTER socket, for the leader and the follower shards alike: decoded,
routed to its handler, or refused.

A request is decoded and routed by its kind (`Dispatch`, a table each shard fills: the
leader's in psserver.server, a follower's in psserver.shards.follower) to its handler, with
the sender's identity and the CURVE key it connected with. A kind the table lacks (a reply, or
a request for another role) is refused. What the handler or the decoder refuses gets an ERROR reply
with a code and is logged with its header (its fields, where it decodes); a bug gets an
`internal` ERROR and a logged traceback. Either way the server keeps serving: a server never
dies from what a client sends. Only `JobLost` (a lost shard, met while handling a request)
goes up to the server's loop, which stops the job.
"""

import logging
import re
import time
from collections.abc import Callable, Iterable
from typing import TypeVar, cast

import zmq

from common.errors import JobLost, ProtocolError, RequestRejected
from common.logs import printable
from common.wire.protocol import (
    MAX_FRAMES,
    MAX_HEADER_BYTES,
    Error,
    Message,
    MessageType,
    decode,
    encode,
    unpack_header,
)

HEADER_PREVIEW_CHARS = 300
MAX_ERROR_CHARS = 1000
# Worker and leader tokens are 32 hex digits; a log must not hold them, not even a cut one
# at the preview's end. Any run of 12 or more hex digits in a header is masked: nothing a
# reader of the log needs looks like that.
SECRET_LIKE = re.compile(r"[0-9a-fA-F]{12,}")
TYPE_NAMES = {kind.value: kind.name for kind in MessageType}
# What handles a request: (the sender's ROUTER identity, its message, its CURVE key).
Handler = Callable[[bytes, Message, str], None]
M = TypeVar("M")  # one kind of message


def header_preview(payload: list[zmq.Frame]) -> str:
    """A refused request's header for the log, with anything token-like masked: its fields
    where it is msgpack (a well-formed request refused for what it says), else the start of
    its bytes."""
    if not payload:
        return "(no frames)"
    raw = payload[0].buffer
    try:
        if len(raw) > MAX_HEADER_BYTES:
            raise ValueError("too long to unpack")
        header = unpack_header(raw, strict_map_key=False)
        if isinstance(header, dict) and isinstance(header.get("type"), int):
            header["type"] = TYPE_NAMES.get(header["type"], header["type"])
        text = repr(header)
    except Exception:  # garbage: msgpack raises several unrelated types for it
        text = repr(bytes(raw[:HEADER_PREVIEW_CHARS]))
    return SECRET_LIKE.sub("<redacted>", text[: HEADER_PREVIEW_CHARS + 40])[:HEADER_PREVIEW_CHARS]


def receive_request(socket: zmq.Socket) -> tuple[bytes, list[zmq.Frame], int]:
    """The sender's identity, at most MAX_FRAMES frames of its message, and how many frames
    the message had. The frames past the most any message has are read and dropped one by one:
    a million empty frames, about 2 MB on the wire, took 620 MB as a list of zmq.Frames."""
    identity = socket.recv(copy=True)
    payload: list[zmq.Frame] = []
    count = 0
    while socket.getsockopt(zmq.RCVMORE):
        count += 1
        if len(payload) < MAX_FRAMES:
            payload.append(socket.recv(copy=False))
        else:
            socket.recv(copy=True)  # dropped at once
    return identity, payload, count


def sender_key(frame: zmq.Frame) -> str:
    """The z85 public key the sender proved it holds in the CURVE handshake, or "" without
    CURVE. The ZAP handler sets it as the connection's User-Id (common.wire.security); libzmq has
    no User-Id for a connection without ZAP, and pyzmq raises EINVAL for it then."""
    try:
        user_id = frame.get("User-Id")
    except zmq.ZMQError:
        return ""
    return user_id if isinstance(user_id, str) else ""


class RefusalLog:
    """The log lines of refused requests: at most BURST of each code every WINDOW_S seconds,
    then one line that counts the rest. A client flooding a shard with bad pushes wrote
    960,000 lines (330 MB) in two and a half minutes, one per request."""

    BURST = 20
    WINDOW_S = 10.0

    def __init__(self, log: logging.Logger, clock: Callable[[], float] = time.monotonic) -> None:
        self.log, self.clock = log, clock
        self._windows: dict[str, tuple[float, int, int]] = {}  # code: (start, logged, held back)

    def refused(self, code: str, level: int, text: str, *args: object) -> None:
        now = self.clock()
        self.flush(now)
        start, logged, held_back = self._windows.get(code, (now, 0, 0))
        if logged < self.BURST:
            self.log.log(level, text, *args)
            self._windows[code] = (start, logged + 1, held_back)
        else:
            self._windows[code] = (start, logged, held_back + 1)

    def flush(self, now: float | None = None) -> None:
        """Count the requests held back in every window that is over (all, at `now` None)."""
        for code, (start, _, held_back) in list(self._windows.items()):
            if now is not None and now - start < self.WINDOW_S:
                continue
            del self._windows[code]
            if held_back:
                self.log.warning(
                    "%s more requests refused (%s) in %.0f s, not logged one by one",
                    held_back, code, (now if now is not None else self.clock()) - start,
                )  # fmt: skip


def route(kind: type[M], handler: Callable[[bytes, M, str], None]) -> tuple[type, Handler]:
    """One row of a `Dispatch`: requests of this kind go to `handler`."""
    return kind, cast(Handler, handler)  # the table looks the handler up by this very kind


class Dispatch:
    """Which handler answers each kind of request on this shard. Every other kind is refused
    with "unexpected-message" and `unexpected`, where "{kind}" stands for the message's name."""

    def __init__(self, routes: Iterable[tuple[type, Handler]], unexpected: str) -> None:
        self.routes, self.unexpected = dict(routes), unexpected

    def __call__(self, identity: bytes, message: Message, sender_key: str) -> None:
        route = self.routes.get(type(message))
        if route is None:
            raise self.refusal(message)
        route(identity, message, sender_key)

    def refusal(self, message: Message) -> RequestRejected:
        kind = type(message).__name__
        return RequestRejected("unexpected-message", self.unexpected.format(kind=kind))


def serve_one(
    socket: zmq.Socket,
    handle: Handler,
    refusals: RefusalLog,
    on_error: Callable[[], None] = lambda: None,
    curve: bool = False,
) -> None:
    """Receive one request (the caller has polled) and handle it or answer with an ERROR.
    `curve`: the socket is a CURVE server, so its requests carry the sender's key; without
    CURVE the key is "" and not read (reading it raises, a cost on every request)."""
    identity, payload, count = receive_request(socket)
    log = refusals.log
    try:
        if count > MAX_FRAMES:
            raise ProtocolError(f"a message has at most {MAX_FRAMES} frames, this one {count}")
        message = decode([f.buffer for f in payload])
        handle(identity, message, sender_key(payload[0]) if curve else "")
        return
    except JobLost:
        raise  # not this client's error: the server's loop stops the job
    except (ProtocolError, RequestRejected) as exc:
        code = exc.code if isinstance(exc, RequestRejected) else "bad-message"
        # Built from what the client sent, which can be as long as it likes, and hold a
        # newline that would forge a log line: cut and escaped for the log and the reply.
        what = printable(str(exc), MAX_ERROR_CHARS)
        if code == "unknown-worker":
            # The expected path after a server restart or a worker declared dead: the worker
            # registers again. Not a warning, and one short line each.
            refusals.refused(code, logging.INFO, "told a worker to register again: %s", what)
            log.debug("its request's header: %s", header_preview(payload))
        else:
            refusals.refused(
                code, logging.WARNING, "rejected a request (%s): %s; header %s", code, what,
                header_preview(payload),
            )  # fmt: skip
        reply = Error(code=code, message=what)
    except Exception as exc:  # a bug must not take the whole job down
        log.exception("internal error while handling a request; header %s", header_preview(payload))
        reply = Error(code="internal", message=printable(f"server error: {exc}", MAX_ERROR_CHARS))
    on_error()
    socket.send_multipart([identity, *encode(reply)], copy=False)
