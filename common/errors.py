"""The error hierarchy. Every error says what went wrong and what to do about it.

The CLIs turn a `PSError` into one `Error: ...` line and a non-zero exit; the server turns a
`ProtocolError` or `RequestRejected` into an ERROR reply and keeps serving.
"""


class PSError(Exception):
    """Base class for errors a person should read (never shown as a traceback)."""


class ConfigError(PSError):
    """An option or a combination of options is invalid."""


class DataError(PSError):
    """A data set is missing, corrupt or inconsistent between roles."""


class DeviceError(PSError):
    """The requested device is not available on this machine."""


class CheckpointError(PSError):
    """A checkpoint cannot be written, read, or does not match the job."""


class TrainingDiverged(PSError):
    """The loss or the gradient is no longer finite: the weights have diverged, and training
    them further is pointless (a worker stops; the server, seeing it too, stops the job)."""


class JobLost(PSError):
    """The job cannot go on (a server shard was lost). Raised while a request is handled, it
    ends the server's loop instead of becoming that client's ERROR reply."""


class ProtocolError(PSError):
    """A message could not be decoded: malformed, wrong version, wrong sizes or dtypes."""


class RequestRejected(PSError):
    """A well-formed request that the server refuses (unknown worker, wrong shapes, job full)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class ServerError(PSError):
    """The server answered a worker's request with an error, or did not answer in time."""


def first_line(exc: BaseException, limit: int = 160) -> str:
    """An exception's first line, short enough for a one-line error (torch's load errors run
    to many lines of advice that does not apply here)."""
    lines = str(exc).strip().splitlines()
    if not lines:
        return type(exc).__name__
    line = lines[0]
    if len(line) <= limit:
        return line
    # Too long: whole sentences, where the first one fits (torch's miniz errors go on, in
    # one line, to say the error is internal, which is not the person's concern).
    end = line.rfind(". ", 0, limit)
    return line[: end + 1] if end > 0 else line[: limit - 3] + "..."
