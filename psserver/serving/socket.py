"""A shard's ROUTER socket, the leader's and every follower's: bound with its limits (and
CURVE), the requests served on it, and the ways to send on it.

One request served: received, decoded, and routed by its kind (`Dispatch`, a table each shard
fills: the leader's in psserver.server, a follower's in psserver.shards.follower) to its
handler, with the sender's identity and the CURVE key it connected with. A kind the table
lacks (a reply, or a request for another role) is refused. What the handler or the decoder
refuses gets an ERROR reply with a code and is logged with its header (its fields, where it
decodes); a bug gets an `internal` ERROR and a logged traceback. Either way the server keeps
serving: a server never dies from what a client sends. Only `JobLost` (a lost shard, met
while handling a request) goes up to the server's loop, which stops the job.

Replies go out zero-copy. Tensors the server keeps changing (the live weights in sync mode, a
snapshot slot in async mode) are sent tracked, so that the store knows when ZeroMQ is done
with their memory (ParameterStore.track_send) before it writes there again.

What it is not: the request loop (the server polls, and `serve` serves one request), nor the
work each request does (the handlers in the shard's table).
"""

import logging
import re
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TypeVar, cast

import zmq

from common.errors import JobLost, ProtocolError, PSError, RequestRejected
from common.logs import printable
from common.wire.endpoint_file import write_endpoint_file
from common.wire.handshake import HandshakeLogger
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
from common.wire.security import (
    ClientKeyAuthenticator,
    ServerSecurity,
    secure_server_socket,
    warn_if_public_without_curve,
)

log = logging.getLogger("ps.server")
HEADER_PREVIEW_CHARS = 300
MAX_ERROR_CHARS = 1000
# The sockets one waiting request is answered on at most, the newest kept: a worker sends it
# again --retries times (5 by default), each time on a new socket.
MAX_SOCKETS_ASKED = 8
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


def asked_on(sockets: list[bytes], identity: bytes) -> list[bytes]:
    """The sockets to answer a request that waits (a push for its step, a held pull, a wait
    for push credit) once `identity` has sent it, or sent it again. A worker sends a request
    that got no answer within --timeout again on a new socket and waits there, and a server
    that was stopped meanwhile (SIGSTOP, a paused VM) reads the two in either order, since
    ZeroMQ takes turns between sockets: answered only on the one read last, a worker whose
    old socket came last would wait for ever. So each is answered."""
    return [*(known for known in sockets if known != identity), identity][-MAX_SOCKETS_ASKED:]


class SocketsAsked:
    """The sockets each waiting request came on (`asked_on`), by its asker: a worker's id."""

    def __init__(self) -> None:
        self.by_asker: dict[int, list[bytes]] = {}

    def first(self, asker: int, identity: bytes) -> None:
        """A new request, on this socket."""
        self.by_asker[asker] = [identity]

    def again(self, asker: int, identity: bytes) -> None:
        """The waiting request once more, on this socket (a new one, or the first read late)."""
        self.by_asker[asker] = asked_on(self.by_asker.get(asker, []), identity)

    def take(self, asker: int, fallback: bytes) -> list[bytes]:
        """The sockets to answer on, forgotten now; `fallback` where none is known."""
        return self.by_asker.pop(asker, None) or [fallback]

    def forget(self, asker: int) -> None:
        self.by_asker.pop(asker, None)


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


def send_tracked(
    socket: zmq.Socket, identities: Sequence[bytes], message: Message
) -> list[zmq.MessageTracker]:
    """Send one message zero-copy to each of these ROUTER peers; what comes back tells when
    ZeroMQ is done with the tensors, for every peer at once.

    The message is encoded once and its tensor frames are shared: each send takes a reference
    to the same ZeroMQ message, and a frame's tracker fires only once every send of it is
    done. A bucket streamed to N workers costs one encoding and one tracker, not N."""
    header, *tensors = encode(message)
    # Only frames with bytes in them are tracked: an empty one reads no tensor's memory.
    frames = [zmq.Frame(t, track=memoryview(t).nbytes > 0) for t in tensors]
    for identity in identities:
        socket.send_multipart([identity, header, *frames], copy=False)
    return [f.tracker for f in frames if f.tracker is not None]


class ServerSocket:
    def __init__(
        self,
        context: zmq.Context,
        bind: str,
        security: ServerSecurity | None,
        max_message_bytes: int,
        endpoint_file: Path | None = None,
        logger: logging.Logger = log,
        who: str = "",  # what a bind error names first: "shard 1: " on a follower
    ) -> None:
        self.socket = context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        # How long closing waits for queued replies to leave: none, unless the last ones
        # matter (see linger_for_last_replies).
        self.linger_ms = 0
        self.refusals = RefusalLog(logger)
        warn_if_public_without_curve(bind, security is not None, logger)
        self.curve = security is not None  # its requests carry the sender's CURVE key
        self.authenticator: ClientKeyAuthenticator | None = None
        if security is not None:
            self.authenticator = secure_server_socket(context, self.socket, security)
        # Clients with the wrong keys (or none) never get a message through: say so.
        self.handshakes: HandshakeLogger | None = HandshakeLogger.started(
            self.socket, security is not None, logger
        )
        # ZeroMQ drops a frame bigger than this before it is read into memory. The limit is
        # per frame: a message of many frames, each under it, is still taken in whole (and
        # then refused for its frame count). Only CURVE keeps strangers from sending those.
        self.socket.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        try:
            self.socket.bind(bind)
        except zmq.ZMQError as exc:
            self.close()
            raise PSError(
                f"{who}cannot bind {bind}: {exc}; pick a free port or another address"
            ) from None
        self.endpoint = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        if endpoint_file is not None:
            try:
                write_endpoint_file(endpoint_file, self.endpoint)
            except PSError:
                self.close()
                raise

    def poll(self, timeout_ms: int) -> bool:
        return bool(self.socket.poll(timeout_ms))

    def serve(self, handle: Handler, on_error: Callable[[], None]) -> None:
        """One request (the caller has polled), handled or answered with an ERROR."""
        serve_one(self.socket, handle, self.refusals, on_error, curve=self.curve)

    def receive(self) -> tuple[bytes, Message | None]:
        """One request as it is, or None for one that does not decode (while shutting down)."""
        identity, *payload = self.socket.recv_multipart()
        try:
            return identity, decode(payload)
        except ProtocolError:
            return identity, None

    def send(self, identity: bytes, message: Message) -> None:
        self.socket.send_multipart([identity, *encode(message)], copy=False)

    def send_watched(self, identity: bytes, message: Message) -> zmq.MessageTracker:
        """Send a message built for this reply alone; what comes back tells when ZeroMQ has
        handed it to the kernel (psserver.status.backlog counts the ones that have not left)."""
        # copy=False even for small frames: a copied frame's tracker is done at once.
        frames = [zmq.Frame(frame, copy=False, track=True) for frame in encode(message)]
        self.socket.send_multipart([identity, *frames], copy=False)
        tracker = frames[0].tracker
        assert tracker is not None  # track=True
        return tracker

    def send_tracked(
        self, identities: Sequence[bytes], message: Message
    ) -> list[zmq.MessageTracker]:
        """Send zero-copy to each peer; what comes back tells when ZeroMQ is done with the
        tensors (see `send_tracked`)."""
        return send_tracked(self.socket, identities, message)

    def linger_for_last_replies(self, linger_ms: int) -> None:
        """Let replies sent just before closing leave: the context's end waits for them, up
        to `linger_ms`, and not at all once they are gone."""
        self.linger_ms = linger_ms

    def close(self) -> None:
        """Close the socket, then CURVE's authenticator: its thread holds a socket too, and
        the context cannot end before it does (so can the handshake log's monitor)."""
        if self.handshakes is not None:
            self.handshakes.close()
            self.handshakes = None
        self.refusals.flush()
        self.socket.close(linger=self.linger_ms)
        if self.authenticator is not None:
            self.authenticator.stop()
            self.authenticator = None
