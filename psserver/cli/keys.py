"""`ps-keys`: write the CURVE key files for one server and N workers, and say who gets which.

Layout of DIR:
    server.key_secret             the server's key pair (stays on the server host, mode 0600)
    server.key                    the server's public key (copied to every worker host)
    client-<i>.key_secret         worker i's key pair (copied only to worker i's host, mode 0600)
    authorized_clients/client-<i>.key   worker i's public key (the server admits these)

This tool only writes files; it does not distribute them, and it never replaces existing keys
without --force, because a server with new keys rejects every worker that still has old ones.
--force replaces every key it wrote before: the worker key pairs past the new --clients are
removed too, since the new server key is public and an old worker key would still be admitted.
Keys put in authorized_clients by hand stay, with a warning.
"""

import os
import shlex
import shutil
import tempfile
from pathlib import Path
from typing import Any

import click
from tqdm import tqdm
from zmq.auth import create_certificates

from common.cli import ENV_PREFIX, EnvAwareCommand, explain_errors
from common.errors import ConfigError
from common.options import Option, options
from common.startup import freeze_imported_objects
from common.wire.security import require_curve

SECRET_MODE = 0o600
PUBLIC_MODE = 0o644
AUTHORIZED = "authorized_clients"
# Worker key pairs one run writes: about 5 s of work. --clients 100000000 printed nothing while
# it grew to gigabytes (every path was listed before the first key was made).
MAX_CLIENTS = 10_000
PROGRESS_AFTER_S = 1.0  # a bar on a terminal once writing keys has taken this long


class ClientCount(click.IntRange):
    """--clients: 1 to MAX_CLIENTS, and past that, what to do instead."""

    def __init__(self) -> None:
        super().__init__(1, MAX_CLIENTS)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = click.INT.convert(value, param, ctx)
        if number > MAX_CLIENTS:
            self.fail(
                f"{number} is more than {MAX_CLIENTS}, the most one run writes (a second run "
                "into the same DIR replaces its keys, with --force). For more workers, run "
                f"ps-keys again into another DIR, copy its {AUTHORIZED}/client-<i>.key into "
                "the first DIR's under new names, and give those workers the first DIR's "
                "server.key",
                param,
                ctx,
            )
        return super().convert(number, param, ctx)


def key_files(directory: Path, clients: int) -> dict[str, Path]:
    """Where each file that pyzmq writes into a scratch folder goes (scratch name -> target)."""
    targets = {
        "server.key_secret": directory / "server.key_secret",
        "server.key": directory / "server.key",
    }
    for i in range(1, clients + 1):
        targets[f"client-{i}.key_secret"] = directory / f"client-{i}.key_secret"
        targets[f"client-{i}.key"] = directory / AUTHORIZED / f"client-{i}.key"
    return targets


def write_keys(directory: Path, clients: int, force: bool) -> dict[str, Path]:
    """Create the key files; returns the same mapping as `key_files`."""
    require_curve()
    targets = key_files(directory, clients)
    existing = [path for path in targets.values() if path.exists()]
    if existing and not force:
        names = ", ".join(str(path.relative_to(directory)) for path in existing[:4])
        more = f" and {len(existing) - 4} more" if len(existing) > 4 else ""
        raise ConfigError(
            f"{directory} already holds keys ({names}{more}); pass --force to replace them "
            "(workers and servers still using the old keys will then be rejected)"
        )
    try:
        (directory / AUTHORIZED).mkdir(parents=True, exist_ok=True)
        # pyzmq writes with the default umask; a 0700 scratch folder keeps the secrets private
        # until they are 0600, and os.replace moves each file into place in one step.
        scratch = Path(tempfile.mkdtemp(prefix=".ps-keys-", dir=directory))
        try:
            create_certificates(scratch, "server")
            # tqdm's own checks: no bar when stderr is not a terminal, none for a short run.
            with tqdm(
                total=clients, desc="worker key pairs", delay=PROGRESS_AFTER_S, disable=None
            ) as progress:
                for i in range(1, clients + 1):
                    create_certificates(scratch, f"client-{i}")
                    progress.update()
            for name, target in targets.items():
                (scratch / name).chmod(SECRET_MODE if name.endswith("_secret") else PUBLIC_MODE)
                os.replace(scratch / name, target)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    except OSError as exc:
        raise ConfigError(f"cannot write keys into {directory}: {exc}") from None
    return targets


def remove_older_client_keys(directory: Path, targets: dict[str, Path]) -> list[str]:
    """Delete the client-<i> key files an earlier run wrote and this one did not (a larger
    --clients); the names of the key pairs removed."""
    written = set(targets.values())
    older = [
        *directory.glob("client-*.key_secret"),
        *(directory / AUTHORIZED).glob("client-*.key"),
    ]
    removed = set()
    try:
        for path in older:
            if path not in written:
                path.unlink()
                removed.add(path.name.split(".")[0])
    except OSError as exc:
        raise ConfigError(f"cannot remove the older key {path}: {exc}") from None
    return sorted(removed)


def stale_authorized_keys(directory: Path, targets: dict[str, Path]) -> list[Path]:
    """Public keys in authorized_clients that this run did not write (still admitted)."""
    written = set(targets.values())
    return [p for p in sorted((directory / AUTHORIZED).glob("*.key")) if p not in written]


@click.command(
    cls=EnvAwareCommand, context_settings={"show_default": True, "max_content_width": 100}
)
@click.argument("directory", metavar="DIR", type=click.Path(file_okay=False, path_type=Path))
@options(
    Option(
        "--clients",
        type=ClientCount(),
        default=1,
        help="Number of worker key pairs to create (client-1 ... client-N).",
    ),
    Option("--force", is_flag=True, default=False, help="Replace keys already in DIR."),
)
@explain_errors
def command(directory: Path, clients: int, force: bool) -> None:
    """Create CURVE keys in DIR for one ps-server and --clients workers."""
    targets = write_keys(directory, clients, force)
    q = shlex.quote
    click.echo(f"wrote a server key pair and {clients} worker key pair(s) into {directory}")
    removed = remove_older_client_keys(directory, targets) if force else []
    if removed:
        click.echo(f"removed the older worker key pair(s) {', '.join(removed)}")
    click.echo(
        f"server:   ps-server --curve-secret-key {q(str(targets['server.key_secret']))} "
        f"--curve-authorized-clients {q(str(directory / AUTHORIZED))}"
    )
    for i in range(1, clients + 1):
        click.echo(
            f"worker {i}: ps-worker --curve-secret-key {q(str(targets[f'client-{i}.key_secret']))}"
            f" --curve-server-key {q(str(targets['server.key']))}"
        )
    click.echo(
        "Copy server.key_secret only to the server host and client-<i>.key_secret only to "
        "worker i's host; server.key is public."
    )
    stale = stale_authorized_keys(directory, targets)
    if stale:
        click.echo(
            f"Warning: {len(stale)} older key(s) in {directory / AUTHORIZED} are still "
            f"authorized ({', '.join(p.name for p in stale)}); delete them to lock those "
            "workers out.",
            err=True,
        )


def main() -> None:
    freeze_imported_objects()
    command(auto_envvar_prefix=ENV_PREFIX)


if __name__ == "__main__":
    main()
