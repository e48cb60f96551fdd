"""The fleet ledger: heartbeats written per version and on a timer, read back, liveness."""

from __future__ import annotations

import json
import os
import re
import time
from datetime import datetime, timedelta, timezone

import pytest

from deltastore.errors import AccessDeniedError, StorageError
from deltastore.fleet.ledger import (
    LEDGER_PREFIX,
    LIVE_TTL_S,
    Heartbeat,
    HeartbeatWriter,
    encode_heartbeat,
    oldest_live_version,
    parse_heartbeat,
    read_ledger,
)
from deltastore.storage import open_store
from testkit.stores import WrappedStore


@pytest.fixture
def store(tmp_path):
    with open_store(str(tmp_path / "s")) as s:
        yield s


def test_writes_once_per_version_and_again_after_the_interval(store):
    w = HeartbeatWriter(store, "w-1", interval_s=3600)
    assert w.beat(3) is True
    assert w.beat(3) is False  # same version, interval not passed: no request
    assert w.beat(4) is True
    w.interval_s = 0
    assert w.beat(4) is True
    (hb,) = read_ledger(store)
    assert (hb.worker, hb.version) == ("w-1", 4)
    assert hb.live()


def test_read_only_credentials_switch_the_writer_off_quietly(store, caplog):
    class ReadOnly(WrappedStore):
        def put(self, key, data, *, mode="overwrite"):
            raise AccessDeniedError(f"access denied for {key}")

    w = HeartbeatWriter(ReadOnly(store), "w-ro")
    with caplog.at_level("INFO", logger="deltastore.fleet.ledger"):
        assert w.beat(1) is False
        assert w.beat(2) is False
    assert not w.enabled
    assert sum("read-only" in r.message for r in caplog.records) == 1
    assert read_ledger(store) == []


def test_a_transient_failure_is_logged_and_retried_next_beat(store):
    class Flaky(WrappedStore):
        fail = True

        def put(self, key, data, *, mode="overwrite"):
            if self.fail:
                raise StorageError("503 slow down")
            return super().put(key, data, mode=mode)

    flaky = Flaky(store)
    w = HeartbeatWriter(flaky, "w-2")
    assert w.beat(1) is False and w.enabled
    flaky.fail = False
    assert w.beat(1) is True


def test_malformed_and_foreign_objects_are_skipped(store, caplog):
    HeartbeatWriter(store, "good").beat(7)
    store.put(f"{LEDGER_PREFIX}bad.json", b"{not json", mode="overwrite")
    store.put(f"{LEDGER_PREFIX}liar.json", encode_heartbeat("someone-else", 1), mode="overwrite")
    store.put(f"{LEDGER_PREFIX}neg.json", json.dumps({"format": "deltastore.heartbeat", "schema": 1, "worker": "neg",
                                                       "version": -1, "host": "h", "time": "2026-01-01T00:00:00Z"}).encode())
    store.put(f"{LEDGER_PREFIX}huge.json", b" " * 10_000, mode="overwrite")
    store.put(f"{LEDGER_PREFIX}sub/x.json", encode_heartbeat("x", 1), mode="overwrite")
    with caplog.at_level("WARNING", logger="deltastore.fleet.ledger"):
        beats = read_ledger(store)
    assert [b.worker for b in beats] == ["good"]
    assert len([r for r in caplog.records if "skipping" in r.message]) == 4


def test_oldest_live_version_ignores_workers_not_heard_from():
    now = datetime(2026, 12, 1, tzinfo=timezone.utc)
    beats = [
        Heartbeat("a", 10, "h", now - timedelta(seconds=5)),
        Heartbeat("b", 4, "h", now - timedelta(hours=2)),  # dead
        Heartbeat("c", 8, "h", now - timedelta(seconds=100)),
    ]
    assert oldest_live_version(beats, now=now) == 8
    assert oldest_live_version(beats, now=now, ttl_s=10) == 10
    assert oldest_live_version(beats[1:2], now=now) is None


def test_liveness_uses_the_store_clock_when_known():
    data = encode_heartbeat("w", 3, when=datetime(2000, 1, 1, tzinfo=timezone.utc))  # a skewed worker clock
    store_time = datetime.now(timezone.utc)
    hb = parse_heartbeat(data, f"{LEDGER_PREFIX}w.json", last_modified=store_time)
    assert hb.time == store_time and hb.live()
    assert not parse_heartbeat(data, f"{LEDGER_PREFIX}w.json").live()


@pytest.mark.parametrize("bad", ["", "../x", "a/b", "x" * 200, "-lead", "sp ace"])
def test_worker_ids_are_one_safe_key_segment(store, bad):
    with pytest.raises(ValueError, match="worker id"):
        HeartbeatWriter(store, bad)


def test_status_command_shows_head_and_each_workers_lag(tmp_path, capsys):
    from deltastore import Publisher
    from deltastore.cli import main
    from testkit.tensors import small_state

    url = str(tmp_path / "run")
    state = small_state()
    with Publisher(url) as pub:
        for i in range(3):
            state = {k: v + 1 for k, v in state.items()}
            pub.publish(state, step=i)
        HeartbeatWriter(pub.store, "behind").beat(1)
        HeartbeatWriter(pub.store, "current").beat(3)
    assert main(["status", url, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["head_version"] == 3 and doc["oldest_live_version"] == 1
    by = {w["worker"]: w for w in doc["workers"]}
    assert by["behind"]["lag_versions"] == 2 and by["behind"]["lag_s"] >= 0 and by["behind"]["live"]
    assert by["current"]["lag_versions"] == 0 and by["current"]["lag_s"] == 0
    assert main(["status", url]) == 0
    text = capsys.readouterr().out
    assert "head version 3" in text and "2 behind" in text and "current" in text


def test_status_on_an_empty_store(tmp_path, capsys):
    from deltastore.cli import main

    url = str(tmp_path / "empty")
    (tmp_path / "empty").mkdir()  # status creates nothing: an empty store, not a missing one
    assert main(["status", url, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["head_version"] == 0 and doc["workers"] == []


def test_a_stopped_worker_is_never_live_and_an_unknown_state_counts_as_following():
    now = datetime.now(timezone.utc)
    stopped = parse_heartbeat(encode_heartbeat("w", 3, state="stopped"), f"{LEDGER_PREFIX}w.json", last_modified=now)
    assert stopped.stopped and not stopped.live(now) and oldest_live_version([stopped], now=now) is None
    doc = json.loads(encode_heartbeat("w", 3))
    assert doc["state"] == "following"
    for state in (None, "draining"):  # an older writer (no state), a newer one (a state unknown here)
        doc["state"] = state
        if state is None:
            del doc["state"]
        hb = parse_heartbeat(json.dumps(doc).encode(), f"{LEDGER_PREFIX}w.json", last_modified=now)
        assert not hb.stopped and hb.live(now)
    doc["state"] = 7
    with pytest.raises(ValueError, match="state"):
        parse_heartbeat(json.dumps(doc).encode(), f"{LEDGER_PREFIX}w.json")


def test_close_writes_a_last_heartbeat_marked_stopped(store):
    with HeartbeatWriter(store, "w-1") as w:
        assert w.beat(4)
    (hb,) = read_ledger(store)
    assert (hb.worker, hb.version, hb.stopped, hb.live()) == ("w-1", 4, True, False)
    assert w.beat(5) is False and read_ledger(store)[0].version == 4  # closed: writes nothing more
    HeartbeatWriter(store, "w-2").close()  # never held a version: nothing to say
    assert [b.worker for b in read_ledger(store)] == ["w-1"]


def test_the_thread_beats_at_once_on_each_change_and_every_interval(store):
    calls = []

    class Counting(WrappedStore):
        def put(self, key, data, *, mode="overwrite"):
            calls.append(json.loads(data)["version"])
            return super().put(key, data, mode=mode)

    held = [None]
    w = HeartbeatWriter(Counting(store), "w-t", interval_s=0.2).start(lambda: held[0])
    try:
        time.sleep(0.3)
        assert calls == []  # nothing held yet: no heartbeat
        held[0] = (1, "L")
        w.notify()
        _until(lambda: calls == [1])
        held[0] = (2, "L")
        w.notify()
        _until(lambda: calls[-1] == 2)
        _until(lambda: len(calls) >= 4)  # then again every interval, unchanged
        assert set(calls[2:]) == {2}
    finally:
        w.close()
    (hb,) = read_ledger(store)
    assert (hb.version, hb.lineage, hb.stopped) == (2, "L", True)
    assert not w._thread.is_alive()


def _until(cond, timeout=10.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def test_status_shows_live_stopped_and_silent_workers_and_its_liveness_window(tmp_path, capsys):
    from deltastore import Publisher
    from deltastore.cli import main
    from testkit.tensors import small_state

    url = str(tmp_path / "run")
    with Publisher(url) as pub:
        pub.publish(small_state())
        HeartbeatWriter(pub.store, "a-live").beat(1)
        with HeartbeatWriter(pub.store, "b-stopped") as w:  # exited cleanly a moment ago
            w.beat(1)
        HeartbeatWriter(pub.store, "c-silent").beat(1)
    silent = tmp_path / "run" / "workers" / "c-silent.json"
    four_min_ago = time.time() - 4 * 60  # four heartbeats missed: it died without a word
    os.utime(silent, (four_min_ago, four_min_ago))
    assert main(["status", url, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["live_ttl_s"] == LIVE_TTL_S
    assert [(w["worker"], w["state"], w["live"]) for w in doc["workers"]] == [
        ("a-live", "live", True), ("b-stopped", "stopped", False), ("c-silent", "gone", False)]
    assert doc["workers"][2]["last_seen_s"] >= 4 * 60
    assert main(["status", url]) == 0
    text = capsys.readouterr().out
    assert "3 worker(s): 1 live, 1 stopped, 1 gone" in text
    assert f"(live = following, heartbeat within {LIVE_TTL_S / 60:.0f}m)" in text
    assert re.search(r"c-silent +v1 +current +seen 4m ago +gone ", text), text


def test_a_format_workers_heartbeat_says_which_format_it_reads_and_status_shows_it(tmp_path, capsys):
    import torch

    from deltastore import Publisher, Subscriber
    from deltastore.cli import main

    url = str(tmp_path / "run")
    g = torch.Generator().manual_seed(0)
    state = {"model.layers.0.mlp.down_proj.weight": torch.randn(128, 128, generator=g).bfloat16()}
    with Publisher(url, formats=["bf16", "fp8-block128"]) as pub:
        pub.publish(state)
    with Subscriber(url, format="fp8-block128") as sub, Subscriber(url) as plain:
        sub.pull()
        plain.pull()
        with sub.heartbeat("fp8-worker"), plain.heartbeat("bf16-worker"):
            deadline = time.monotonic() + 10
            while len(beats := {b.worker: b for b in read_ledger(sub.store)}) < 2 and time.monotonic() < deadline:
                time.sleep(0.02)  # each writer's thread beats at once
            assert beats["fp8-worker"].serving_format == "fp8-block128" and beats["fp8-worker"].version == 1
            assert beats["bf16-worker"].serving_format is None
            assert main(["status", url, "--json"]) == 0
            by = {w["worker"]: w for w in json.loads(capsys.readouterr().out)["workers"]}
            assert by["fp8-worker"]["serving_format"] == "fp8-block128" and by["bf16-worker"]["serving_format"] is None
            assert main(["status", url]) == 0
            lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.startswith("  ")}
            assert "reads fp8-block128" in lines["fp8-worker"] and "reads" not in lines["bf16-worker"]


@pytest.mark.parametrize("value", [7, "FP8 Block", "", ["fp8-block128"]])
def test_a_serving_format_that_is_not_a_formats_name_reads_as_absent(value):
    doc = json.loads(encode_heartbeat("w", 3))
    doc["serving_format"] = value
    beat = parse_heartbeat(json.dumps(doc).encode(), f"{LEDGER_PREFIX}w.json")
    assert beat.version == 3 and beat.serving_format is None
    with pytest.raises(ValueError):
        encode_heartbeat("w", 3, serving_format="FP8 Block")
