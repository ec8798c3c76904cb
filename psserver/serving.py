"""Serving one request on a ROUTER socket, for the leader and the follower shards alike.

A request is decoded and handed to the caller's handler. What the handler or the decoder
refuses gets an ERROR reply with a code and is logged with its header (its fields, where it
decodes); a bug gets an `internal` ERROR and a logged traceback. Either way the server keeps
serving: a server never dies from what a client sends. Only `JobLost` (a lost shard, met
while handling a request) goes up to the server's loop, which stops the job.
"""

import logging
import re
from collections.abc import Callable

import msgpack
import zmq

from common.errors import JobLost, ProtocolError, RequestRejected
from common.protocol import MAX_HEADER_BYTES, Error, Message, MessageType, decode, encode

HEADER_PREVIEW_CHARS = 300
# Worker and leader tokens are 32 hex digits; a log must not hold them, not even a cut one
# at the preview's end. Any run of 12 or more hex digits in a header is masked: nothing a
# reader of the log needs looks like that.
SECRET_LIKE = re.compile(r"[0-9a-fA-F]{12,}")
TYPE_NAMES = {kind.value: kind.name for kind in MessageType}


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
        header = msgpack.unpackb(raw, raw=False, strict_map_key=False)
        if isinstance(header, dict) and isinstance(header.get("type"), int):
            header["type"] = TYPE_NAMES.get(header["type"], header["type"])
        text = repr(header)
    except Exception:  # garbage: msgpack raises several unrelated types for it
        text = repr(bytes(raw[:HEADER_PREVIEW_CHARS]))
    return SECRET_LIKE.sub("<redacted>", text[: HEADER_PREVIEW_CHARS + 40])[:HEADER_PREVIEW_CHARS]


def serve_one(
    socket: zmq.Socket,
    handle: Callable[[bytes, Message], None],
    log: logging.Logger,
    on_error: Callable[[], None] = lambda: None,
) -> None:
    """Receive one request (the caller has polled) and handle it or answer with an ERROR."""
    frames = socket.recv_multipart(copy=False)
    identity, payload = frames[0].bytes, frames[1:]
    try:
        handle(identity, decode([f.buffer for f in payload]))
        return
    except JobLost:
        raise  # not this client's error: the server's loop stops the job
    except (ProtocolError, RequestRejected) as exc:
        code = exc.code if isinstance(exc, RequestRejected) else "bad-message"
        if code == "unknown-worker":
            # The expected path after a server restart or a worker declared dead: the worker
            # registers again. Not a warning, and one short line each.
            log.info("told a worker to register again: %s", exc)
            log.debug("its request's header: %s", header_preview(payload))
        else:
            log.warning(
                "rejected a request (%s): %s; header %s", code, exc, header_preview(payload)
            )
        reply = Error(code=code, message=str(exc))
    except Exception as exc:  # a bug must not take the whole job down
        log.exception("internal error while handling a request; header %s", header_preview(payload))
        reply = Error(code="internal", message=f"server error: {exc}")
    on_error()
    socket.send_multipart([identity, *encode(reply)], copy=False)
