"""`ps-status`: ask a running ps-server how the job is going, and print the answer.

One STATUS request with a timeout, no retries and no registration: the server answers from its
event loop, between two other requests, and changes nothing. The answer is a table for people,
or with --json the raw STATUS_REPLY body (fields documented at common.wire.protocol.StatusReply).
"""

import json
import time
from pathlib import Path
from typing import Any

import click
import zmq

from common.cli import ENV_PREFIX, EnvAwareCommand, explain_errors
from common.errors import ServerError
from common.logs import counted, printable
from common.options import STATUS_OPTIONS, options
from common.security_options import client_security_from_options
from common.startup import freeze_imported_objects
from common.wire.endpoints import check_endpoint
from common.wire.handshake import HandshakeWatch, await_answer, send_when_connected
from common.wire.protocol import Error, Status, StatusReply, decode, encode
from common.wire.security import ClientSecurity, secure_client_socket

COLUMNS = ("ID", "NAME", "DEVICE", "STATE", "PUSHES", "SAMPLES", "LATE", "REJECTED", "SEEN")
MAX_TEXT = 1000  # characters of any one text in the answer that the table shows


def request_status(
    endpoint: str, timeout_s: float, security: ClientSecurity | None = None
) -> dict[str, Any]:
    """The server's status, or a ServerError that says why there is none."""
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    watch: HandshakeWatch | None = None
    try:
        if security is not None:
            secure_client_socket(socket, security)
        watch = HandshakeWatch(socket, endpoint, security is not None)
        try:
            socket.connect(endpoint)
        except zmq.ZMQError as exc:
            raise ServerError(
                f"--server {endpoint!r} is not a valid endpoint ({exc}); use tcp://HOST:PORT"
            ) from None
        started = time.monotonic()
        sent = send_when_connected(socket, encode(Status()), watch, timeout_s)
        left_s = timeout_s - (time.monotonic() - started)
        answered = sent and await_answer(socket, watch, left_s)
        if not answered:
            raise ServerError(
                f"no answer from {endpoint} within {timeout_s:g} s; check that ps-server runs "
                "there and the port is reachable (or raise --timeout: the server does not "
                "answer while it evaluates or checkpoints)"
            )
        reply = decode(socket.recv_multipart())
    finally:
        if watch is not None:
            watch.close()  # before the context ends: term() would wait for its socket
        socket.close(linger=0)
        context.term()
    if isinstance(reply, Error):
        code, message = printable(reply.code, MAX_TEXT), printable(reply.message, MAX_TEXT)
        raise ServerError(f"the server refused STATUS ({code}): {message}")
    if not isinstance(reply, StatusReply):
        raise ServerError(
            f"the server answered STATUS with {type(reply).__name__}; it may be an older "
            "release of ps-server"
        )
    return reply.status


def _headline(status: dict[str, Any]) -> list[str]:
    epoch = status["epoch"]
    current = epoch["current"]
    if status.get("waiting_for"):
        plan = f"waiting for {status['waiting_for']}"
    elif current is None:
        plan = "between epochs"
    else:
        steps = counted(current["steps_per_shard"], "step")
        plan = f"roster {current['roster']}, {steps} per shard"
    abandoned = f", {epoch['abandoned']} abandoned" if epoch.get("abandoned") else ""
    steps = f"step {status['step']}" + (
        f" of {status['max_steps']}" if status["max_steps"] is not None else ""
    )
    lines = [
        f"{status['phase']}: {status['mode']} {status['model']} on {status['dataset']}, "
        f"{steps}, epoch {epoch['completed']} of {epoch['total']} done{abandoned} ({plan})",
    ]
    ready = status["worker_states"]
    lines.append(
        f"workers: {ready['training']} training, {ready['waiting']} waiting, "
        f"{ready['registered']} registered (the job wants {status['workers_expected']}, "
        f"at least {status['min_workers']})"
    )
    rate = status["throughput"]
    lines.append(
        f"throughput: {rate['images_per_second']:.1f} img/s over the last "
        f"{rate['window_s']:g} s, {rate['overall_images_per_second']:.1f} img/s overall; "
        f"{counted(rate['samples'], 'image')}, {counted(rate['gradients'], 'gradient')}; "
        f"up {status['uptime_s']:.0f} s"
    )
    cpu = status["server_cpu"]
    lines.append(
        f"server CPU: {cpu['busy']:.2f} cores busy over the last {rate['window_s']:g} s, "
        f"{cpu['seconds']:.1f} s in all"
        + (
            f"; its follower shards {cpu['followers_seconds']:.1f} s"
            if cpu.get("followers_seconds") is not None
            else ""
        )
    )
    staleness = status["staleness"]
    if staleness is not None:
        # The SSP bound limits steps ahead of the slowest worker, not versions behind: "max 2
        # ..., bound 1" read as a bound broken, though 2 workers at bound 1 may reach 2.
        bound = staleness.get("steps_ahead_bound")
        ahead = "" if bound is None else f"; steps ahead bound {bound}"
        lines.append(
            f"staleness (versions behind): mean {staleness['mean']:.2f}, max "
            f"{staleness['max']} over {counted(staleness['count'], 'gradient')}{ahead}"
        )
    evaluation = status["last_evaluation"]
    if evaluation is None:
        lines.append("last evaluation: none yet")
    else:
        lines.append(
            f"last evaluation: accuracy {evaluation['accuracy']:.4f}, loss "
            f"{evaluation['loss']:.4f} at step {evaluation['step']} "
            # The epochs ended before it: the log numbers epochs from 0, so "epoch 1" would
            # name the one after it.
            f"({counted(evaluation['epoch'], 'epoch')} ended)"
        )
    lines.append(checkpoints_line(status.get("checkpoints")))
    lines.append(
        f"refused requests: {status['rejected_requests']}, late gradients dropped: "
        f"{status['late_gradients']}"
    )
    return lines


def checkpoints_line(checkpoints: dict[str, Any] | None) -> str:
    if checkpoints is None:
        return "checkpoints: none (no --checkpoint-dir)"
    every = checkpoints["every"]
    when = f"every {counted(every, 'step')} and at the end" if every else "at the end"
    if checkpoints["step"] is None:
        return f"checkpoints: none yet ({when}, to {checkpoints['dir']})"
    age = checkpoints["age_s"]
    written = "which this run resumed from" if age is None else f"written {age:.0f} s ago"
    kept = f", {checkpoints['kept']} kept as step-N.pt" if checkpoints["kept"] else ""
    return (
        f"checkpoints: latest.pt at step {checkpoints['step']}, {written}{kept} ({when}, in "
        f"{checkpoints['dir']})"
    )


def escaped(value: Any) -> Any:
    """`value` (the answer's plain data) with every text in it made printable: this release's
    server escapes what workers said, but an older one, or one that is not ps-server at all,
    may send newlines or terminal escapes that would rewrite the screen."""
    if isinstance(value, str):
        return printable(value, MAX_TEXT)
    if isinstance(value, list):
        return [escaped(item) for item in value]
    if isinstance(value, dict):
        return {key: escaped(item) for key, item in value.items()}
    return value


def format_status(status: dict[str, Any]) -> str:
    """A readable report: the job's headline, then one row per worker."""
    status = escaped(status)
    rows = [
        [
            str(w["id"]),
            w["name"],
            w["device"],
            w["state"],
            str(w["pushes"]),
            str(w["samples"]),
            str(w["late_dropped"]),
            str(w["rejected"]),
            f"{w['last_seen_s']:.1f} s ago",
        ]
        for w in status["workers"]
    ]
    widths = [max([len(c), *(len(r[i]) for r in rows)]) for i, c in enumerate(COLUMNS)]
    numeric = {0, 4, 5, 6, 7, 8}

    def line(cells: tuple[str, ...] | list[str]) -> str:
        return "  ".join(
            cell.rjust(w) if i in numeric else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    out = [*_headline(status), "", line(COLUMNS)]
    out += [line(row) for row in rows] or ["(no workers have registered)"]
    if status["workers_omitted"]:
        # Finished ones, and active ones past the first MAX_LISTED_WORKERS (the counts by
        # state above cover every worker).
        out.append(f"... and {status['workers_omitted']} more workers not listed")
    return "\n".join(out)


@click.command(
    cls=EnvAwareCommand, context_settings={"show_default": True, "max_content_width": 100}
)
@options(STATUS_OPTIONS)
@explain_errors
def command(
    server: str,
    as_json: bool,
    timeout: float,
    curve_secret_key: Path | None,
    curve_server_key: Path | None,
) -> None:
    """Show a running ps-server's live status: workers, step, epoch, throughput, evaluation."""
    check_endpoint(server, "--server")
    security = client_security_from_options(curve_secret_key, curve_server_key)
    status = request_status(server, timeout, security)
    click.echo(json.dumps(status, indent=2) if as_json else format_status(status))


def main() -> None:
    freeze_imported_objects()
    command(auto_envvar_prefix=ENV_PREFIX)


if __name__ == "__main__":
    main()
