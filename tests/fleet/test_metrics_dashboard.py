"""The Grafana dashboard (infra/grafana) reads only metrics the exporters define, and metrics
without prometheus-client fail with an error naming the extra. Neither needs prometheus-client."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from deltastore import Publisher, Subscriber
from deltastore.errors import MetricsUnavailableError
from deltastore.fleet.metrics import metric_names
from testkit.targets import unique_prefix
from testkit.tensors import small_state

DASHBOARD = Path(__file__).resolve().parents[2] / "infra" / "grafana" / "deltastore-dashboard.json"
#: Suffixes the exposition adds to a metric's name (counters, histograms).
SUFFIXES = ("_total", "_bucket", "_sum", "_count")
METRIC = re.compile(r"\bdeltastore_[a-z_]+")


def base_name(series: str) -> str:
    for suffix in SUFFIXES:
        if series.endswith(suffix):
            return series[: -len(suffix)]
    return series


def exprs(doc: dict) -> list[str]:
    return [t["expr"] for p in doc["panels"] for t in p.get("targets", [])]


def test_the_dashboard_reads_only_metrics_the_exporters_define():
    doc = json.loads(DASHBOARD.read_text())
    known = metric_names()
    used = {base_name(m) for e in exprs(doc) for m in METRIC.findall(e)}
    unknown = sorted(used - known)
    assert not unknown, f"the dashboard queries metrics no exporter defines: {unknown}"
    # the operator's questions: lag, pause, fetch time, bytes, errors
    for needed in ("deltastore_lag_versions", "deltastore_lag_seconds", "deltastore_pause_seconds",
                   "deltastore_fetch_seconds", "deltastore_bytes_fetched", "deltastore_errors"):
        assert needed in used, f"the dashboard has no panel over {needed}"
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids)) and all(p["targets"] for p in doc["panels"])
    for e in exprs(doc):  # balanced brackets: a typo Grafana would show as a broken panel
        for open_, close in ("()", "[]", "{}"):
            assert e.count(open_) == e.count(close), e


def test_metrics_without_the_client_name_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # as if it were not installed
    url = f"memory://{unique_prefix()}"
    with Publisher(url) as pub, Subscriber(url) as sub:
        pub.publish(small_state(8))
        loop = sub.follow(sub.allocate(), heartbeat=None, metrics_port=1)
        with pytest.raises(MetricsUnavailableError, match=r"deltastore-weights\[metrics\]"):
            next(loop)
        with pytest.raises(ImportError, match="prometheus-client"):
            Publisher(url, metrics_port=1)
        assert sub.version is None  # nothing fetched
