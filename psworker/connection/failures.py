"""How a worker's request to the server fails, and what the person reads about it.

psworker.connection.client and psworker.connection.waiting raise these: RequestFailed for an ERROR
reply, NoReply when every attempt of a request met silence, Interrupted when a shutdown signal ended
a wait. What a NoReply says depends on what the connection knew of the server before it fell silent:
one that answered this worker before has stopped (it finished the job while this worker was
paused or cut off, or it died), and one that never answered may not run there at all, or not be
reachable. The two call for different fixes, and the second's ("check that ps-server runs
there") misled the person who had just trained with that server. A first registration that
met only silence until its --join-timeout says how far its connection got (`nobody_answered`).

What it is not: the waits and retries that decide that a request failed
(psworker.connection.waiting, psworker.connection.client).
"""

from common.errors import PSError, ServerError
from common.logs import counted, printable
from common.wire.protocol import Message, describe

SERVER_TEXT_LIMIT = 1000  # characters of a server's words a worker prints (as its errors are cut)


def server_words(text: str) -> str:
    """What a server said (an ERROR's code or message, a STOP's reason), fit for a log line or
    an error: another release's server, or something that is not ps-server at all, may send
    newlines that forge log lines or escapes that rewrite the terminal (see common.logs)."""
    return printable(text, SERVER_TEXT_LIMIT)


class RequestFailed(ServerError):
    """The server answered with an ERROR reply."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class NoReply(ServerError):
    """Every attempt of a request met `timeout_s` of silence."""

    def __init__(self, message: str, waited_s: float) -> None:
        super().__init__(message)
        self.waited_s = waited_s  # from the first attempt to giving up, backoff included


class Interrupted(PSError):
    """A shutdown signal ended a wait for the server (see `ServerConnection.interrupt`)."""


def no_reply(
    endpoint: str, asked: Message, attempts: int, timeout_s: float, answered_before: bool,
    waited_s: float, forgotten: bool = False,
) -> NoReply:  # fmt: skip
    """The NoReply for `asked`, sent `attempts` times; `answered_before`: whether this server
    answered anything on this connection before (see the module doc); `forgotten`: its
    heartbeat said "unknown-worker", and `asked` (a push) got no answer when sent again."""
    waited = f"after {counted(attempts, 'attempt')} ({timeout_s:g} s of silence each)"
    if forgotten:
        return NoReply(
            f"the server at {endpoint} said it no longer knew this worker (unknown-worker), "
            f"then did not answer whether it had applied its push in {timeout_s:g} s; it has "
            "probably finished the job or died: see its log, and if the job is not over, "
            "restart it with --resume and start this worker again",
            waited_s,
        )
    if answered_before:
        return NoReply(
            f"the server at {endpoint} stopped answering ({describe(asked)} got no reply "
            f"{waited}); it answered this worker before, so it has probably finished the job "
            "or died: see its log, and if the job is not over, restart it with --resume and "
            "start this worker again",
            waited_s,
        )
    return NoReply(
        f"no reply from the server at {endpoint} {waited}; check that ps-server runs there "
        "and that the port is reachable from this host (a refused key would have been said)",
        waited_s,
    )


def nobody_answered(
    endpoint: str, asked: Message, waited_s: float, reach: str, join_timeout_s: float
) -> NoReply:
    """The NoReply of a first registration that nothing answered within `join_timeout_s`;
    `reach`: how far its connection got (common.wire.handshake.HandshakeWatch.reach)."""
    return NoReply(
        f"nothing answered at {endpoint} in {waited_s:.0f} s ({reach}; {describe(asked)} "
        "got no reply); check --server (the host, and the port of ps-server's --bind) and "
        "that ps-server runs there; a server that takes longer to start needs a longer "
        f"--join-timeout (or PS_JOIN_TIMEOUT) than {join_timeout_s:g} s",
        waited_s,
    )
