"""Logging setup shared by every role: one line per record, prefixed with the role; and
`printable`, which makes a text that came from elsewhere (a client's request, a server's
answer) safe to put in a log line or on a terminal.

What this is not: a place for log messages themselves, or for rate limits on them (those live
with the code that logs, e.g. psserver.serving.socket.RefusalLog)."""

import logging
import sys

LEVELS = ("debug", "info", "warning", "error")


def setup_logging(level: str, role: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter(f"%(asctime)s {role} %(levelname)s %(message)s", datefmt="%H:%M:%S")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def counted(count: int, noun: str, plural: str | None = None) -> str:
    """`1 worker`, `2 workers`: log lines and errors count things in words that agree."""
    return f"{count} {noun if count == 1 else plural or noun + 's'}"


def printable(text: str, limit: int) -> str:
    """`text` with every character that is not printable escaped as Python writes it in a
    string literal (`\\n`, `\\x1b`, `\\x00`, `\\u2028`), cut to at most `limit` characters with
    the original length said at the end.

    A client chooses its worker name, device, LEAVE reason ...: unescaped, a newline in one
    forges a log line that looks like the server's own, and an ESC sequence recolours or
    rewrites a terminal. Escaping C0, C1, DEL, line and paragraph separators, bidirectional
    overrides and the like (what str.isprintable refuses) leaves one line of visible text."""
    head = text[:limit]  # the escaping below never reads more than `limit` characters
    if not head.isprintable():
        head = "".join(c if c.isprintable() else repr(c)[1:-1] for c in head)
    if len(text) <= limit and len(head) <= limit:
        return head
    note = f"... ({len(text)} characters)"
    return head[: max(0, limit - len(note))] + note
