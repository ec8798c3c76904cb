"""ZeroMQ CURVE for the server and the workers: key files and socket setup (the click options
are in common.options, and the security they describe is built in common.security_options).

With CURVE every connection is encrypted, each worker proves it holds a secret key whose public
half is in the server's authorized-clients folder, and the worker checks it talks to the server
whose public key it was given. `ps-keys` (psserver/cli/keys.py) writes the key files.

This module is not a firewall and not a user system: it admits a fixed set of client keys, read
once when the server starts, and does not limit what an admitted worker may send. Without the
--curve-* options nothing here is used and traffic is plain ZeroMQ, which is only safe on
loopback or a trusted network.
"""

import ipaddress
import logging
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

import zmq
from zmq.auth import load_certificate
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from common.errors import ConfigError

server_log = logging.getLogger("ps.server")
log = logging.getLogger("ps.security")

KEYS_HINT = "create keys with `ps-keys DIR` (see `ps-keys --help`)"
LOOPBACK_NAMES = ("localhost", "lo", "lo0")  # host names and interface names ZeroMQ accepts
LOCAL_TRANSPORTS = ("ipc", "inproc")  # never leave this machine


def require_curve() -> None:
    """Raise a ConfigError when the installed libzmq was built without CURVE (libsodium)."""
    if not zmq.has("curve"):
        raise ConfigError(
            f"libzmq {zmq.zmq_version()} was built without CURVE support, so the --curve-* "
            "options cannot work; install a pyzmq wheel from PyPI (it bundles libsodium) or "
            "rebuild libzmq with libsodium"
        )


def _read_key_file(path: Path, option: str) -> tuple[bytes, bytes | None]:
    """The (public, secret-or-None) z85 keys in a key file, or a ConfigError saying why not."""
    if not path.is_file():
        raise ConfigError(f"{option} {path}: no such file; {KEYS_HINT}")
    if not os.access(path, os.R_OK):
        raise ConfigError(f"{option} {path}: not readable by this user; check its owner and mode")
    try:
        public, secret = load_certificate(path)
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{option} {path}: not a ZeroMQ key file ({exc}); {KEYS_HINT}") from None
    for kind, key in (("public", public), ("secret", secret)):
        if key is not None and not _is_z85_key(key):
            raise ConfigError(
                f"{option} {path}: the {kind} key is not a 40-character Z85 CURVE key; "
                f"the file is damaged, {KEYS_HINT}"
            )
    return public, secret


def _is_z85_key(key: bytes) -> bool:
    if len(key) != 40:
        return False
    try:
        return len(z85.decode(key)) == 32
    except (ValueError, KeyError, IndexError, struct.error):  # a group past 2**32: struct.error
        return False


def load_secret_key(path: Path, option: str) -> tuple[bytes, bytes]:
    """The (public, secret) keys of a `*.key_secret` file written by ps-keys."""
    public, secret = _read_key_file(path, option)
    if secret is None:
        raise ConfigError(
            f"{option} {path}: holds only a public key; pass the matching *.key_secret file "
            f"written by ps-keys"
        )
    if zmq.curve_public(secret) != public:
        raise ConfigError(
            f"{option} {path}: its public and secret keys do not belong together; "
            f"the file was edited, {KEYS_HINT}"
        )
    return public, secret


def warn_if_anyone_can_read(path: Path, option: str) -> None:
    """Once per process, when the options are checked: every socket set up later loads the
    key again (a worker's at each reconnect), and would repeat the warning. (The shard secret
    file, psserver.shards.auth, is warned about the same way.)"""
    if path.stat().st_mode & stat.S_IROTH:
        # Warned, not refused: a copy without -p loses ps-keys' 0600, and a Kubernetes
        # Secret is mounted group-readable on purpose.
        log.warning(
            "%s %s can be read by every user of this machine; anyone who reads it can pose "
            "as this process: chmod 600 it", option, path,
        )  # fmt: skip


def load_public_key(path: Path, option: str) -> bytes:
    """The public key of a `*.key` file; a file holding a secret key is refused on purpose."""
    public, secret = _read_key_file(path, option)
    if secret is not None:
        raise ConfigError(
            f"{option} {path}: holds a secret key; pass the public file (*.key, not *.key_secret) "
            "so that no secret has to be copied to another host"
        )
    return public


@dataclass(frozen=True)
class ServerSecurity:
    """The server's key pair and the folder of public keys of the workers allowed in."""

    secret_key_file: Path
    authorized_clients_dir: Path

    def __post_init__(self) -> None:
        require_curve()
        load_secret_key(self.secret_key_file, "--curve-secret-key")
        warn_if_anyone_can_read(self.secret_key_file, "--curve-secret-key")
        self.authorized_client_keys()  # at least one key, every file valid

    def public_key(self) -> str:
        """The z85 public key of the server's pair: the one every shard of the job uses, and
        the ZAP user id (pyzmq's `curve_user_id`) of whoever connects with it."""
        return load_secret_key(self.secret_key_file, "--curve-secret-key")[0].decode("ascii")

    def authorized_client_keys(self) -> frozenset[bytes]:
        """The z85 public keys of every `*.key` file in the authorized-clients folder."""
        option = "--curve-authorized-clients"
        folder = self.authorized_clients_dir
        if not folder.is_dir():
            raise ConfigError(f"{option} {folder}: no such folder; {KEYS_HINT}")
        files = sorted(folder.glob("*.key"))
        if not files:
            raise ConfigError(
                f"{option} {folder}: holds no *.key files, so no worker could connect; "
                f"{KEYS_HINT} or copy the workers' public key files there"
            )
        return frozenset(load_public_key(file, option) for file in files)


@dataclass(frozen=True)
class ClientSecurity:
    """A worker's key pair and the public key of the server it may talk to."""

    secret_key_file: Path
    server_public_key_file: Path

    def __post_init__(self) -> None:
        require_curve()
        load_secret_key(self.secret_key_file, "--curve-secret-key")
        warn_if_anyone_can_read(self.secret_key_file, "--curve-secret-key")
        load_public_key(self.server_public_key_file, "--curve-server-key")


class ClientKeyAuthenticator(ThreadAuthenticator):
    """pyzmq's ZAP thread, admitting only the given client keys and logging every rejection.

    pyzmq decides and logs through its own "zmq.auth" logger at DEBUG, without the peer address
    at decision time. Here the decision is our `callback` (pyzmq's documented credentials
    provider hook) and the address comes from the ZAP request, which this thread handles one at
    a time, so `_peer_address` always belongs to the request being decided.
    """

    def __init__(
        self, context: zmq.Context, authorized_keys: frozenset[bytes], authorized_dir: Path
    ) -> None:
        super().__init__(context, log=logging.getLogger("ps.server.zap"))
        self._authorized_keys = authorized_keys
        self._authorized_dir = authorized_dir
        self._peer_address = "an unknown address"
        self.configure_curve_callback(domain="*", credentials_provider=self)

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        if len(msg) > 3:  # version, request id, domain, address, identity, mechanism, ...
            self._peer_address = msg[3].decode("utf-8", "replace") or "an unknown address"
        await super().handle_zap_message(msg)

    def curve_user_id(self, client_public_key: bytes) -> str:
        """The User-Id ZeroMQ attaches to every message of an admitted client: its z85 public
        key. pyzmq's default too; said here because the leader relies on it to tell its
        follower shards (the server's own key) from workers (psserver.shards.auth)."""
        return z85.encode(client_public_key).decode("ascii")

    def callback(self, domain: str, client_key: bytes) -> bool:
        """Called by pyzmq with the client's z85 public key; True admits it."""
        if client_key in self._authorized_keys:
            server_log.debug(
                "admitted %s with client key %s", self._peer_address, client_key.decode()
            )
            return True
        server_log.warning(
            "rejected a connection from %s: client key %s is not authorized; put that "
            "worker's public key file in %s and restart the server, or give the worker a "
            "key from there",
            self._peer_address,
            client_key.decode(),
            self._authorized_dir,
        )
        return False


def _check_not_connected(socket: zmq.Socket, function: str) -> None:
    if socket.get(zmq.LAST_ENDPOINT):
        raise ValueError(f"{function} must be called before the socket binds or connects")


def secure_server_socket(
    context: zmq.Context, socket: zmq.Socket, security: ServerSecurity
) -> ClientKeyAuthenticator:
    """Make `socket` a CURVE server admitting only authorized clients. Call before `bind`.

    Starts the context's ZAP thread (one per context) and returns it; call its `stop()` on
    shutdown, before closing the context, or `context.term()` waits for it forever.
    """
    require_curve()
    _check_not_connected(socket, "secure_server_socket")
    if socket.context is not context:
        raise ValueError("secure_server_socket: the socket must belong to the given context")
    public, secret = load_secret_key(security.secret_key_file, "--curve-secret-key")
    # The server's own key is admitted too: the shards of one job share it and use it to
    # reach each other (whoever holds the secret key can play the server anyway).
    authenticator = ClientKeyAuthenticator(
        context, security.authorized_client_keys() | {public}, security.authorized_clients_dir
    )
    # Without a ZAP handler libzmq admits *every* CURVE client, so start it before any handshake.
    authenticator.start()
    socket.curve_secretkey = secret
    socket.curve_publickey = public
    socket.curve_server = True
    return authenticator


def secure_client_socket(socket: zmq.Socket, security: ClientSecurity) -> None:
    """Make `socket` a CURVE client of the server whose public key it was given. Call before
    `connect`."""
    require_curve()
    _check_not_connected(socket, "secure_client_socket")
    public, secret = load_secret_key(security.secret_key_file, "--curve-secret-key")
    socket.curve_secretkey = secret
    socket.curve_publickey = public
    socket.curve_serverkey = load_public_key(security.server_public_key_file, "--curve-server-key")


def secure_peer_socket(socket: zmq.Socket, security: ServerSecurity) -> None:
    """Make `socket` a CURVE client of another shard of the same job (same key pair)."""
    require_curve()
    _check_not_connected(socket, "secure_peer_socket")
    public, secret = load_secret_key(security.secret_key_file, "--curve-secret-key")
    socket.curve_secretkey = secret
    socket.curve_publickey = public
    socket.curve_serverkey = public


def is_loopback_endpoint(endpoint: str) -> bool:
    """True when a ZeroMQ endpoint cannot be reached from another host.

    ipc:// and inproc:// are local; for tcp:// and the rest, the host must be localhost, the
    loopback interface, or a 127.0.0.0/8 or ::1 address. Names are not resolved, so any other
    host name, `*`, 0.0.0.0 and unparseable endpoints count as public.
    """
    transport, sep, rest = endpoint.partition("://")
    if not sep:
        return False
    if transport.lower() in LOCAL_TRANSPORTS:
        return True
    address = rest.rsplit(";", 1)[-1].split("/", 1)[0]  # "source;peer", ws://host:port/path
    host = address.rsplit(":", 1)[0] if ":" in address else address
    host = host.strip("[]").lower()
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def warn_if_public_without_curve(endpoint: str, secured: bool, log: logging.Logger) -> None:
    """Log one warning when traffic to a non-loopback endpoint is neither encrypted nor
    authenticated."""
    if secured or is_loopback_endpoint(endpoint):
        return
    log.warning(
        "%s is reachable from other hosts without CURVE: anyone who can reach it can read the "
        "weights and send updates; %s and pass the --curve-* options to every role",
        endpoint,
        KEYS_HINT,
    )
