"""Metrics (deltastore.fleet.metrics): a running follower's and publisher's ``/metrics``, scraped
over HTTP and read with prometheus_client's own text parser; a port in use; spans per phase."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator

import numpy as np
import pytest

pc = pytest.importorskip("prometheus_client", reason="metrics need the [metrics] extra (prometheus-client)")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from deltastore import Publisher, Subscriber  # noqa: E402
from deltastore.devserver import free_ports  # noqa: E402
from deltastore.errors import DeadlineExceededError, MetricsPortInUseError, NotFoundError  # noqa: E402
from deltastore.fleet import tracing  # noqa: E402
from deltastore.fleet.metrics import FollowerMetrics, metric_names  # noqa: E402
from deltastore.read.follow import PollPolicy  # noqa: E402
from testkit.targets import unique_prefix  # noqa: E402
from testkit.tensors import assert_bits_equal, small_state, sparse_edit  # noqa: E402

FAST = PollPolicy(interval=0.02, jitter=0.0, max_interval=0.05)

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    """Every sample of an exposition, keyed by (sample name, labels)."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        assert r.status == 200
        return parse(r.read().decode())


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def test_a_followers_metrics_move_with_its_versions():
    url = f"memory://{unique_prefix()}"
    rng = np.random.default_rng(1)
    state = small_state(3)
    port = free_ports(1)[0]
    with Publisher(url) as pub, Subscriber(url) as sub:
        pub.publish(state)
        target = sub.allocate()
        records = sub.follow(target, poll=FAST, heartbeat=None, metrics_port=port)
        first = next(records)
        s1 = scrape(port)
        assert value(s1, "deltastore_held_version") == value(s1, "deltastore_head_version") == 1
        assert value(s1, "deltastore_lag_versions") == 0 and value(s1, "deltastore_lag_seconds") == 0
        assert value(s1, "deltastore_versions_applied_total", load="full") == 1
        assert value(s1, "deltastore_bytes_fetched_total") == first.bytes_fetched > 0
        assert value(s1, "deltastore_store_info", url=url, role="follower") == 1
        for step in (2, 3):
            state = sparse_edit(state, rng)
            pub.publish(state)
            rec = next(records)
            assert rec.info.version == step
        s3 = scrape(port)
        records.close()
        with pytest.raises(OSError):  # the exporter went with the loop
            scrape(port)
    assert_bits_equal(target, state)
    assert value(s3, "deltastore_held_version") == value(s3, "deltastore_head_version") == 3
    assert value(s3, "deltastore_versions_applied_total", load="delta") == 2
    assert value(s3, "deltastore_bytes_fetched_total") > value(s1, "deltastore_bytes_fetched_total")
    assert value(s3, "deltastore_polls_total") >= 3
    for phase in ("fetch", "decode", "pause"):
        assert value(s3, f"deltastore_{phase}_seconds_count") == 3
    assert value(s3, "deltastore_pause_seconds_sum") >= rec.pause_s


def test_lag_errors_and_deadlines_are_counted():
    m = FollowerMetrics("memory://lag")
    m.polled(5, 3)  # HEAD two versions ahead of the held one
    m.failed(DeadlineExceededError("stalled", phase="fetch", object="objects/x.pack", deadline_s=1.0))
    m.failed(NotFoundError("gone"))
    s = parse(pc.generate_latest(m.registry).decode())
    assert value(s, "deltastore_lag_versions") == 2
    assert value(s, "deltastore_errors_total", type="DeadlineExceededError") == 1
    assert value(s, "deltastore_errors_total", type="NotFoundError") == 1
    assert value(s, "deltastore_deadline_exceeded_total", phase="fetch") == 1
    behind = parse(pc.generate_latest(m.registry).decode())
    assert value(behind, "deltastore_lag_seconds") >= value(s, "deltastore_lag_seconds") > 0  # grows between polls
    m.polled(5, 5)
    s = parse(pc.generate_latest(m.registry).decode())
    assert value(s, "deltastore_lag_versions") == 0 and value(s, "deltastore_lag_seconds") == 0


def test_a_followers_stalled_polls_are_counted_and_it_keeps_its_version():
    from deltastore.fleet.deadlines import Deadlines
    from deltastore.storage._memory import MemoryStore

    class StallsWhenTold(MemoryStore):
        """HEAD's conditional GETs hang while ``stalled`` is set (the deadline abandons them)."""

        stalled = threading.Event()
        release = threading.Event()

        def get_if_changed(self, key, etag):
            if key == "HEAD" and self.stalled.is_set():
                self.release.wait(30)
            return super().get_if_changed(key, etag)

    url = f"memory://{unique_prefix()}"
    port = free_ports(1)[0]
    store = StallsWhenTold(url)
    # a poll deadline that only the stalled polls pass, also on a loaded test machine (allocate's
    # read of HEAD, before the stall, must not)
    with Publisher(url) as pub, Subscriber(url, store=store, deadlines=Deadlines(poll=0.5)) as sub:
        pub.publish(small_state(10))
        records = sub.follow(sub.allocate(), poll=FAST, heartbeat=None, metrics_port=port)
        next(records)
        StallsWhenTold.stalled.set()
        pub.publish(sparse_edit(small_state(10), np.random.default_rng(5)))
        got: list = []
        loop = threading.Thread(target=lambda: got.append(next(records)), daemon=True)
        loop.start()  # the follow loop runs while its generator is being advanced
        try:
            deadline = time.monotonic() + 10
            late = 0.0
            while time.monotonic() < deadline and late < 2:
                s = scrape(port)
                late = s.get(("deltastore_deadline_exceeded_total", frozenset({("phase", "poll")})), 0.0)
                if late < 2:
                    threading.Event().wait(0.05)
            held = sub.version
        finally:
            StallsWhenTold.stalled.clear()
            StallsWhenTold.release.set()
        loop.join(10)
        records.close()
    assert held == 1, "the follower kept its version through the stall"
    rec = got[0]
    assert late >= 2 and value(s, "deltastore_errors_total", type="DeadlineExceededError") >= 2
    assert rec.info.version == 2


@contextlib.contextmanager
def held_port() -> Iterator[int]:
    """A port another process could be listening on."""
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        yield s.getsockname()[1]


def test_a_metrics_port_in_use_fails_at_start():
    url = f"memory://{unique_prefix()}"
    with Publisher(url) as pub, Subscriber(url) as sub, held_port() as port:
        pub.publish(small_state(4))
        target = sub.allocate()
        with pytest.raises(MetricsPortInUseError, match=f"{port}.*already in use"):
            next(sub.follow(target, poll=FAST, heartbeat=None, metrics_port=port))
        assert sub.bytes_fetched == 0 and sub.version is None  # before anything was fetched
        with pytest.raises(MetricsPortInUseError, match="already in use"):
            Publisher(url, metrics_port=port)


def test_two_followers_in_one_process_each_serve_their_own():
    url = f"memory://{unique_prefix()}"
    ports = free_ports(2)
    with Publisher(url) as pub, Subscriber(url) as a, Subscriber(url) as b:
        pub.publish(small_state(5))
        loops = [s.follow(s.allocate(), poll=FAST, heartbeat=None, metrics_port=p) for s, p in zip((a, b), ports)]
        for loop in loops:
            next(loop)
        for p in ports:
            assert value(scrape(p), "deltastore_held_version") == 1
        for loop in loops:
            loop.close()


def test_a_publishers_metrics():
    url = f"memory://{unique_prefix()}"
    rng = np.random.default_rng(2)
    state = small_state(6)
    port = free_ports(1)[0]
    with Publisher(url, metrics_port=port) as pub:
        infos = [pub.publish(state)]
        state = sparse_edit(state, rng)
        infos.append(pub.publish_async(state).result())
        pub.flush()
        s = scrape(port)
        assert pub.pending == 0
    assert value(s, "deltastore_published_version") == 2
    assert value(s, "deltastore_versions_published_total") == 2
    assert value(s, "deltastore_bytes_published_total") == sum(i.bytes_stored for i in infos)
    assert value(s, "deltastore_commit_seconds_count") == 2
    assert value(s, "deltastore_publish_queue_depth") == 0
    assert value(s, "deltastore_store_info", url=url, role="publisher") == 1


def test_every_exposed_metric_is_declared():
    """The names a dashboard may use (metric_names) are exactly those the exporters expose."""
    url = f"memory://{unique_prefix()}"
    m = FollowerMetrics(url)
    m.failed(NotFoundError("x"))
    from deltastore.fleet.metrics import PublisherMetrics

    p = PublisherMetrics(url)
    p.failed(NotFoundError("x"))
    exposed = {f.name for r in (m.registry, p.registry) for f in text_string_to_metric_families(pc.generate_latest(r).decode())
               if not f.name.endswith("_created")}
    assert exposed == set(metric_names())


class _Spans:
    """A stand-in tracer that records the names of the spans started."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.lock = threading.Lock()

    @contextlib.contextmanager
    def start_as_current_span(self, name: str, attributes: dict | None = None) -> Iterator[None]:
        with self.lock:
            self.names.append(name)
        yield None


def test_follow_and_publish_open_a_span_per_phase(monkeypatch):
    spans = _Spans()
    monkeypatch.setattr(tracing, "_tracer", lambda: spans)
    url = f"memory://{unique_prefix()}"
    rng = np.random.default_rng(3)
    state = small_state(7)
    with Publisher(url) as pub, Subscriber(url) as sub:
        pub.publish(state)
        target = sub.allocate()
        records = sub.follow(target, poll=FAST, heartbeat=None)
        next(records)
        pub.publish(sparse_edit(state, rng))
        next(records)
        records.close()
    names = set(spans.names)
    assert {"deltastore.poll", "deltastore.stage", "deltastore.apply", "deltastore.commit"} <= names


def test_pull_follow_serves_metrics_on_its_port(tmp_path, capsys):
    from deltastore.cli import main

    url = str(tmp_path / "store")
    rng = np.random.default_rng(4)
    state = small_state(9)
    port = free_ports(1)[0]
    seen: list[Samples] = []
    with Publisher(url) as pub:
        pub.publish(state)

        def scrape_then_publish() -> None:  # the CLI's loop runs on the main thread (signal handlers)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and not seen:
                try:
                    got = scrape(port)
                except OSError:
                    got = None  # not listening yet
                if got is not None and got.get(("deltastore_held_version", frozenset())) == 1:
                    seen.append(got)
                else:
                    threading.Event().wait(0.02)
            pub.publish(sparse_edit(state, rng))  # the loop's second and last version

        helper = threading.Thread(target=scrape_then_publish, daemon=True)
        helper.start()
        rc = main(["pull", url, str(tmp_path / "out.safetensors"), "--follow", "--interval", "0.02",
                   "--max-versions", "2", "--metrics-port", str(port)])
        helper.join()
    assert rc == 0 and seen, capsys.readouterr().err
    assert value(seen[0], "deltastore_versions_applied_total", load="full") == 1
    with held_port() as taken:
        assert main(["pull", url, str(tmp_path / "out2.safetensors"), "--follow", "--max-versions", "1",
                     "--metrics-port", str(taken)]) != 0
    assert "already in use" in capsys.readouterr().err
    assert main(["pull", url, str(tmp_path / "out3.safetensors"), "--metrics-port", "9400"]) != 0
    assert "--metrics-port is for --follow" in capsys.readouterr().err
