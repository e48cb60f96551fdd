"""Prometheus metrics of a follower and of a publisher, served over HTTP for scraping.

``prometheus-client`` is an optional extra (``pip install 'deltastore-weights[metrics]'``),
imported only when metrics are asked for; without it, asking raises
:class:`~deltastore.errors.MetricsUnavailableError`. Each exporter has its own
``CollectorRegistry`` (not the process's default one): several subscribers or publishers in
one process each serve their own port, and never collide on a metric's name.

Every metric is recorded once per poll or once per version, never per chunk, so that metrics
cost a few microseconds per version. The names (all prefixed ``deltastore_``):

==============================================  ==========  ====================================================
metric                                          type        meaning
==============================================  ==========  ====================================================
``deltastore_head_version``                     gauge       the version HEAD names (follower: last poll)
``deltastore_held_version``                     gauge       the version the follower's target holds
``deltastore_lag_versions``                     gauge       head minus held (0 when current)
``deltastore_lag_seconds``                      gauge       seconds since a newer HEAD was first seen (0 when current)
``deltastore_polls_total``                      counter     looks at HEAD
``deltastore_versions_applied_total{load}``     counter     versions applied (``load`` = ``delta`` or ``full``)
``deltastore_bytes_fetched_total``              counter     bytes of packs read from the store
``deltastore_fetch_seconds``                    histogram   per version: waiting for segments (before the pause)
``deltastore_decode_seconds``                   histogram   per version: checking and decoding (before the pause)
``deltastore_pause_seconds``                    histogram   per version: inside the pause (the target written)
``deltastore_errors_total{type}``               counter     errors by class name (follower: retried ones)
``deltastore_deadline_exceeded_total{phase}``   counter     phases past their deadline (poll, fetch, decode, ...)
``deltastore_published_version``                gauge       the version the publisher last committed
``deltastore_versions_published_total``         counter     versions committed
``deltastore_bytes_published_total``            counter     bytes of packs written
``deltastore_commit_seconds``                   histogram   per version: publish call to HEAD written
``deltastore_publish_queue_depth``              gauge       snapshots queued by ``publish_async``, not yet committed
``deltastore_store_info{url,role}``             gauge       1, labelled with the store's URL and the role
==============================================  ==========  ====================================================

Example::

    for rec in sub.follow(model, metrics_port=9400):   # scrape http://host:9400/metrics
        ...
    pub = Publisher(url, metrics_port=9401)
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections.abc import Callable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from deltastore.errors import DeadlineExceededError, MetricsPortInUseError, MetricsUnavailableError

logger = logging.getLogger(__name__)

#: Prefix of every metric's name.
PREFIX = "deltastore_"
#: Histogram buckets in seconds: a pause of a steady delta is under a millisecond, a full load
#: of a multi-GB model minutes.
SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                   60.0, 120.0, 300.0, 600.0)
#: Where an exporter listens by default: every interface, so that a Prometheus in the cluster
#: can scrape it (metrics carry versions and timings, never weights or credentials).
DEFAULT_ADDR = "0.0.0.0"
#: How often the exporter's accept loop looks for a shutdown: closing it (at the end of a follow
#: loop) waits up to this long.
SHUTDOWN_POLL_S = 0.05

#: The names of every metric an exporter defines (without the ``_total``/``_bucket`` suffixes
#: the exposition adds), for dashboards and tests to check against.
FOLLOWER_METRICS = ("head_version", "held_version", "lag_versions", "lag_seconds", "polls", "versions_applied",
                    "bytes_fetched", "fetch_seconds", "decode_seconds", "pause_seconds", "errors",
                    "deadline_exceeded", "store_info")
PUBLISHER_METRICS = ("published_version", "versions_published", "bytes_published", "commit_seconds",
                     "publish_queue_depth", "errors", "store_info")


def client() -> Any:
    """The ``prometheus_client`` module.

    Raises:
        MetricsUnavailableError: it is not installed.
    """
    try:
        import prometheus_client
    except ImportError:
        raise MetricsUnavailableError(
            "metrics need the 'prometheus-client' package, which is not installed: "
            "pip install 'deltastore-weights[metrics]' (or drop metrics_port / --metrics-port)"
        ) from None
    return prometheus_client


def metric_names() -> frozenset[str]:
    """Every metric name an exporter can expose, prefixed (``deltastore_held_version``, ...)."""
    return frozenset(PREFIX + n for n in FOLLOWER_METRICS + PUBLISHER_METRICS)


class Exporter:
    """An HTTP server answering ``GET /metrics`` with one registry's metrics, on its own thread.

    Args:
        registry: the ``prometheus_client.CollectorRegistry`` to serve.
        port: the TCP port (0: any free one, see :attr:`port`).
        addr: the address to listen on (default every interface).

    Raises:
        MetricsPortInUseError: the port cannot be listened on (held by another process).
        MetricsUnavailableError: ``prometheus-client`` is not installed.
    """

    def __init__(self, registry: Any, port: int, addr: str = DEFAULT_ADDR):
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"a metrics port is an integer from 0 to 65535, got {port!r}")
        pc = client()
        try:
            self._server = make_server(addr, port, pc.make_wsgi_app(registry), _Server, handler_class=_Quiet)
        except OSError as e:
            why = "it is already in use" if e.errno == errno.EADDRINUSE else (e.strerror or str(e))
            raise MetricsPortInUseError(
                f"cannot serve metrics on {addr}:{port}: {why}; pick another --metrics-port / metrics_port "
                "(each worker process on a host needs its own), or stop the process holding it"
            ) from None
        self.addr = addr
        self.port: int = self._server.server_port
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": SHUTDOWN_POLL_S},
                         name=f"deltastore-metrics-{self.port}", daemon=True).start()
        logger.info("serving metrics on http://%s:%d/metrics", addr, self.port)

    def close(self) -> None:
        """Stop serving and release the port (idempotent)."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()


class _Server(ThreadingMixIn, WSGIServer):
    """One thread per scrape, none of them holding up the process's exit."""

    daemon_threads = True


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """A scrape every few seconds is not news: no access log on stderr."""


class FollowerMetrics:
    """The metrics of one follower (see the module docstring), in a private registry.

    Args:
        url: the followed store's URL (the ``url`` label of ``deltastore_store_info``).
        registry: a ``prometheus_client.CollectorRegistry`` (default: a new one).

    Raises:
        MetricsUnavailableError: ``prometheus-client`` is not installed.
    """

    def __init__(self, url: str, registry: Any = None):
        pc = client()
        self.registry = registry if registry is not None else pc.CollectorRegistry(auto_describe=True)
        r, p = self.registry, PREFIX
        self._head = pc.Gauge(p + "head_version", "The version HEAD names, at the last poll.", registry=r)
        self._held = pc.Gauge(p + "held_version", "The version this follower's target holds.", registry=r)
        self._lag = pc.Gauge(p + "lag_versions", "HEAD's version minus the held one (0 when current).", registry=r)
        lag_s = pc.Gauge(p + "lag_seconds", "Seconds since a HEAD newer than the held version was first seen "
                         "(0 when current).", registry=r)
        lag_s.set_function(self._lag_seconds)  # computed at scrape time: it grows between polls
        self._polls = pc.Counter(p + "polls", "Looks at HEAD.", registry=r)
        self._applied = pc.Counter(p + "versions_applied", "Versions applied to the target.", ["load"], registry=r)
        self._bytes = pc.Counter(p + "bytes_fetched", "Bytes of packs read from the store.", registry=r)
        self._fetch = pc.Histogram(p + "fetch_seconds", "Per version: seconds waiting for segments before the pause.",
                                   buckets=SECONDS_BUCKETS, registry=r)
        self._decode = pc.Histogram(p + "decode_seconds", "Per version: seconds checking and decoding before the "
                                    "pause.", buckets=SECONDS_BUCKETS, registry=r)
        self._pause = pc.Histogram(p + "pause_seconds", "Per version: seconds inside the pause (target written).",
                                   buckets=SECONDS_BUCKETS, registry=r)
        self._errors = pc.Counter(p + "errors", "Errors by class name (a follower retries them).", ["type"],
                                  registry=r)
        self._late = pc.Counter(p + "deadline_exceeded", "Phases that ran past their deadline.", ["phase"],
                                registry=r)
        pc.Gauge(p + "store_info", "1, labelled with the store and this process's role.", ["url", "role"],
                 registry=r).labels(url=url, role="follower").set(1)
        self._lock = threading.Lock()
        self._behind_since: float | None = None  # when a newer HEAD was first seen (monotonic)

    def _lag_seconds(self) -> float:
        since = self._behind_since
        return 0.0 if since is None else max(0.0, time.monotonic() - since)

    def polled(self, head_version: int | None, held_version: int | None) -> None:
        """After each poll: HEAD's version and the held one (None: none yet)."""
        self._polls.inc()
        with self._lock:
            if head_version is not None:
                self._head.set(head_version)
            if held_version is not None:
                self._held.set(held_version)
            if head_version is None:
                return
            behind = max(0, head_version - (held_version or 0))
            self._lag.set(behind)
            if behind == 0:
                self._behind_since = None
            elif self._behind_since is None:
                self._behind_since = time.monotonic()

    def applied(self, rec: Any) -> None:
        """After each version applied: its :class:`~deltastore.read.follow.FollowRecord`."""
        self._applied.labels(load="full" if rec.full_load else "delta").inc()
        self._bytes.inc(rec.bytes_fetched)
        self._fetch.observe(rec.fetch_s)
        self._decode.observe(rec.decode_s)
        self._pause.observe(rec.pause_s)
        self._held.set(rec.info.version)

    def failed(self, e: BaseException) -> None:
        """An error the follower met (and retries): counted by class name, and by phase when a deadline passed."""
        self._errors.labels(type=type(e).__name__).inc()
        if isinstance(e, DeadlineExceededError):
            self._late.labels(phase=e.phase or "unknown").inc()

    def late(self, e: DeadlineExceededError) -> None:
        """A CPU phase that overran its deadline and went on (reported by the watchdog, not raised)."""
        self._late.labels(phase=e.phase or "unknown").inc()


class PublisherMetrics:
    """The metrics of one publisher (see the module docstring), in a private registry.

    Args:
        url: the store's URL.
        queue_depth: returns the number of snapshots queued and not yet committed (read at
            scrape time).
        registry: a ``prometheus_client.CollectorRegistry`` (default: a new one).

    Raises:
        MetricsUnavailableError: ``prometheus-client`` is not installed.
    """

    def __init__(self, url: str, queue_depth: Callable[[], int] | None = None, registry: Any = None):
        pc = client()
        self.registry = registry if registry is not None else pc.CollectorRegistry(auto_describe=True)
        r, p = self.registry, PREFIX
        self._version = pc.Gauge(p + "published_version", "The version this publisher last committed.", registry=r)
        self._count = pc.Counter(p + "versions_published", "Versions committed.", registry=r)
        self._bytes = pc.Counter(p + "bytes_published", "Bytes of packs written.", registry=r)
        self._commit = pc.Histogram(p + "commit_seconds", "Per version: seconds from the publish to HEAD written.",
                                    buckets=SECONDS_BUCKETS, registry=r)
        depth = pc.Gauge(p + "publish_queue_depth", "Snapshots queued by publish_async, not yet committed.",
                         registry=r)
        depth.set_function((lambda: float(queue_depth())) if queue_depth is not None else (lambda: 0.0))
        self._errors = pc.Counter(p + "errors", "Errors by class name.", ["type"], registry=r)
        pc.Gauge(p + "store_info", "1, labelled with the store and this process's role.", ["url", "role"],
                 registry=r).labels(url=url, role="publisher").set(1)

    def committed(self, info: Any, seconds: float) -> None:
        """After each version committed: its :class:`~deltastore.format.history.VersionInfo` and the commit's seconds."""
        self._version.set(info.version)
        self._count.inc()
        self._bytes.inc(info.bytes_stored)
        self._commit.observe(seconds)

    def failed(self, e: BaseException) -> None:
        """A publish that failed: counted by class name."""
        self._errors.labels(type=type(e).__name__).inc()


class PublisherExport:
    """A publisher's metrics and their exporter (what ``Publisher(metrics_port=)`` keeps).

    Args:
        url: the store's URL.
        port: the port to serve on.
        queue_depth: see :class:`PublisherMetrics`.

    Raises:
        MetricsUnavailableError, MetricsPortInUseError: as :class:`Exporter`.
    """

    def __init__(self, url: str, port: int, queue_depth: Callable[[], int] | None = None):
        self.metrics = PublisherMetrics(url, queue_depth)
        self.exporter = Exporter(self.metrics.registry, port)

    def committed(self, info: Any, seconds: float) -> None:
        self.metrics.committed(info, seconds)

    def failed(self, e: BaseException) -> None:
        self.metrics.failed(e)

    def close(self) -> None:
        self.exporter.close()


__all__ = ["DEFAULT_ADDR", "FOLLOWER_METRICS", "PREFIX", "PUBLISHER_METRICS", "SECONDS_BUCKETS", "Exporter",
           "FollowerMetrics", "PublisherExport", "PublisherMetrics", "client", "metric_names"]
