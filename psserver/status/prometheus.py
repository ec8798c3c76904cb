"""Prometheus metrics for `ps-server --metrics-port`: a view of the live status over HTTP.

The server thread builds a status dict (psserver.status.live) at most every half second and hands
it to `MetricsExporter.publish`; prometheus_client's HTTP thread turns the latest one into
metrics on each scrape. Handing over is one reference assignment, so the HTTP thread never
reads the server's state while the server changes it, and every scrape is one consistent
snapshot.

The endpoint is plain HTTP without authentication, even when the ZeroMQ socket uses CURVE. It
binds 127.0.0.1 unless --bind is reachable from other hosts, and then all interfaces.

Whoever can reach it must not be able to hurt training: prometheus_client's own server gives
every connection a thread and waits on it for ever, so idle connections used up the server's
file descriptors until a checkpoint could not be written. `BoundedMetricsServer` serves at
most MAX_CONNECTIONS at once, closes the rest at once, and drops a connection silent for
READ_TIMEOUT_S.
"""

import http.server
import logging
import socket
import socketserver
import threading
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import MetricsHandler
from prometheus_client.registry import Collector

from common.errors import ConfigError
from common.wire.security import is_loopback_endpoint

log = logging.getLogger("ps.server")
MAX_CONNECTIONS = 16  # scrapers served at once; Prometheus itself uses one
READ_TIMEOUT_S = 5.0  # a scrape's request arrives in milliseconds


def metrics_address(bind: str) -> str:
    """Where the metrics listen: loopback for a loopback --bind, every interface otherwise."""
    return "127.0.0.1" if is_loopback_endpoint(bind) else "0.0.0.0"


# Every metric: name -> (type, help, labels). The help may name the throughput window.
METRICS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "ps_step": ("gauge", "Weights version: updates applied", ()),
    "ps_epoch": ("gauge", "Completed epochs", ()),
    "ps_workers": ("gauge", "Workers in each state", ("state",)),
    "ps_images_per_second": ("gauge", "Training images per second over the last {window}", ()),
    "ps_server_cpu_seconds_total": ("counter", "CPU time of the server process", ()),
    "ps_server_cpu_busy": ("gauge", "Server CPU seconds per second over the last {window}", ()),
    "ps_follower_cpu_seconds_total": (
        "counter", "CPU time of the follower shards this server started, all together", (),
    ),
    "ps_updates_total": ("counter", "Weight updates (the step, as a counter)", ()),
    "ps_gradients_total": ("counter", "Gradients applied by this server", ()),
    "ps_late_gradients_total": ("counter", "Gradients dropped as too late", ()),
    "ps_rejected_requests_total": ("counter", "Requests answered with an ERROR", ()),
    "ps_test_accuracy": ("gauge", "Test accuracy at the last evaluation", ()),
    "ps_staleness_max": ("gauge", "Largest staleness of an applied gradient", ()),
    "ps_checkpoint_step": ("gauge", "The step of the newest checkpoint (latest.pt)", ()),
}  # fmt: skip


def _family(
    name: str, value: float | None = None, window: str = "status window"
) -> GaugeMetricFamily | CounterMetricFamily:
    """The metric `name` as METRICS describes it, with one value (or none yet)."""
    kind, help_text, labels = METRICS[name]
    family = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
    documentation = help_text.format(window=window)
    if labels:
        return family(name, documentation, labels=list(labels))
    return family(name, documentation, value=value)


class StatusCollector(Collector):
    """Metrics from the last published status; nothing before the first one."""

    def __init__(self) -> None:
        self.status: dict[str, Any] | None = None  # replaced whole, never changed in place

    def describe(self) -> Iterator[Metric]:
        """Every metric this may yield, without values: prometheus_client needs the names
        to serve a scrape that asks for some by name (`/metrics?name[]=ps_step`)."""
        for name in METRICS:
            yield _family(name)

    def collect(self) -> Iterator[Metric]:
        status = self.status
        if status is None:
            return
        throughput, cpu = status["throughput"], status["server_cpu"]
        window = f"{throughput['window_s']:g} s"
        yield _family("ps_step", status["step"])
        yield _family("ps_epoch", status["epoch"]["completed"])
        workers = _family("ps_workers")
        for state, count in status["worker_states"].items():
            workers.add_metric([state], count)
        yield workers
        yield _family("ps_images_per_second", throughput["images_per_second"], window)
        yield _family("ps_server_cpu_seconds_total", cpu["seconds"])
        yield _family("ps_server_cpu_busy", cpu["busy"], window)
        if cpu.get("followers_seconds") is not None:
            yield _family("ps_follower_cpu_seconds_total", cpu["followers_seconds"])
        yield _family("ps_updates_total", status["step"])
        yield _family("ps_gradients_total", throughput["gradients"])
        yield _family("ps_late_gradients_total", status["late_gradients"])
        yield _family("ps_rejected_requests_total", status["rejected_requests"])
        if (evaluation := status["last_evaluation"]) is not None:
            yield _family("ps_test_accuracy", evaluation["accuracy"])
        if (staleness := status["staleness"]) is not None:
            yield _family("ps_staleness_max", staleness["max"])
        checkpoints = status.get("checkpoints")
        if checkpoints is not None and checkpoints["step"] is not None:
            yield _family("ps_checkpoint_step", checkpoints["step"])


class BoundedMetricsServer(socketserver.ThreadingMixIn, http.server.HTTPServer):
    """A threading HTTP server with a cap on connections and a timeout on each (see the
    module doc)."""

    daemon_threads = True

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[http.server.BaseHTTPRequestHandler],
        max_connections: int = MAX_CONNECTIONS,
        read_timeout_s: float = READ_TIMEOUT_S,
    ) -> None:
        self._slots = threading.BoundedSemaphore(max_connections)
        self.read_timeout_s = read_timeout_s
        super().__init__(address, handler)

    def server_bind(self) -> None:
        # HTTPServer's own looks the host's name up (socket.getfqdn), which can wait on DNS.
        socketserver.TCPServer.server_bind(self)
        host, self.server_port = self.server_address[:2]
        self.server_name = str(host)

    def get_request(self) -> tuple[socket.socket, Any]:
        connection, client = super().get_request()
        connection.settimeout(self.read_timeout_s)  # a silent client cannot hold its thread
        return connection, client

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):  # full: this one is closed at once
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class MetricsExporter:
    """An HTTP server on its own daemon thread serving the last published status."""

    def __init__(
        self,
        port: int,
        bind: str,
        max_connections: int = MAX_CONNECTIONS,
        read_timeout_s: float = READ_TIMEOUT_S,
    ) -> None:
        self.collector = StatusCollector()
        registry = CollectorRegistry(auto_describe=False)  # StatusCollector.describe()
        registry.register(self.collector)
        address = metrics_address(bind)
        handler = MetricsHandler.factory(registry)
        try:
            self._httpd = BoundedMetricsServer(
                (address, port), handler, max_connections, read_timeout_s
            )
        except OSError as exc:
            raise ConfigError(
                f"cannot serve metrics on {address}:{port} ({exc.strerror}); pick a free "
                "--metrics-port"
            ) from None
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name="prometheus", daemon=True
        )
        self._thread.start()
        log.info("Prometheus metrics on http://%s:%d/metrics", address, port)

    def publish(self, status: dict[str, Any]) -> None:
        self.collector.status = status

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)
