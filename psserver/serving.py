"""Serving one request on a ROUTER socket, for the leader and the follower shards alike.

A request is decoded and handed to the caller's handler. What the handler or the decoder
refuses gets an ERROR reply with a code and is logged (a malformed one with its header); a
bug gets an `internal` ERROR and a logged traceback. Either way the server keeps serving: a
server never dies from what a client sends. Only `JobLost` (a lost shard, met while handling
a request) goes up to the server's loop, which stops the job.
"""

import logging
import re
from collections.abc import Callable

import zmq

from common.errors import JobLost, ProtocolError, RequestRejected
from common.protocol import Error, Message, decode, encode

HEADER_PREVIEW_BYTES = 200
# Worker and leader tokens are 32 hex digits; a log must not hold them, not even a cut one
# at the preview's end. Any run of 12 or more hex digits in a header is masked: nothing a
# reader of the log needs looks like that.
SECRET_LIKE = re.compile(rb"[0-9a-fA-F]{12,}")


def header_preview(payload: list[zmq.Frame]) -> bytes:
    """The start of a request's header for the log, with anything token-like masked."""
    if not payload:
        return b""
    return SECRET_LIKE.sub(b"<redacted>", bytes(payload[0].buffer[:HEADER_PREVIEW_BYTES]))


def serve_one(
    socket: zmq.Socket,
    handle: Callable[[bytes, Message], None],
    log: logging.Logger,
    on_error: Callable[[], None] = lambda: None,
) -> None:
    """Receive one request (the caller has polled) and handle it or answer with an ERROR."""
    frames = socket.recv_multipart(copy=False)
    identity, payload = frames[0].bytes, frames[1:]
    header = header_preview(payload)
    try:
        handle(identity, decode([f.buffer for f in payload]))
        return
    except JobLost:
        raise  # not this client's error: the server's loop stops the job
    except RequestRejected as exc:  # well formed, so the reason says whose and what
        log.warning("rejected a request (%s): %s", exc.code, exc)
        reply = Error(code=exc.code, message=str(exc))
    except ProtocolError as exc:  # malformed: the header's start may tell from what
        log.warning("rejected a request (bad-message): %s; header %r", exc, header)
        reply = Error(code="bad-message", message=str(exc))
    except Exception as exc:  # a bug must not take the whole job down
        log.exception("internal error while handling a request; header %r", header)
        reply = Error(code="internal", message=f"server error: {exc}")
    on_error()
    socket.send_multipart([identity, *encode(reply)], copy=False)
