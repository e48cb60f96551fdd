"""Workers started before the trainer: Subscriber.wait_for_version, and follow and
``deltastore pull --follow`` on a store that is empty or whose local directory does not exist yet."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from deltastore import DeltastoreError, PollPolicy, Publisher, Subscriber, WaitTimeoutError
from deltastore.cli import main
from deltastore.errors import StorageError
from deltastore.storage import open_store
from testkit.stores import WrappedStore
from testkit.tensors import assert_bits_equal, small_state

#: Polls in these tests are this far apart: a few per test, never seconds of waiting.
POLL_S = 0.02
#: Only a hung test waits this long.
DEADLINE_S = 60.0


def _publish_later(url: str, seeds: tuple[int, ...] = (0,), delay: float = 0.2) -> threading.Thread:
    """Publish ``small_state(seed)`` for each seed after ``delay`` seconds, from a thread."""
    def run() -> None:
        time.sleep(delay)
        with Publisher(url) as pub:
            for seed in seeds:
                pub.publish(small_state(seed))

    th = threading.Thread(target=run)
    th.start()
    return th


def _waiting_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("waiting for")]


# --- Subscriber.wait_for_version --------------------------------------------------------------


def test_wait_for_version_times_out_with_the_url_and_how_long(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    url = str(tmp_path / "run")
    with Subscriber(url, threads=1) as sub, caplog.at_level(logging.INFO, logger="deltastore.read"):
        t0 = time.monotonic()
        with pytest.raises(WaitTimeoutError, match=r"waited 0\.\d s for the first version of file://.*/run, which has no version") as got:
            sub.wait_for_version(timeout=0.2, interval=POLL_S)
        assert 0.2 <= time.monotonic() - t0 < 5
    assert isinstance(got.value, TimeoutError) and isinstance(got.value, DeltastoreError)
    assert _waiting_lines(caplog) == [f"waiting for the first version of {sub.url}"]  # once, not per poll


def test_wait_for_version_returns_once_the_trainer_has_published(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    url = str(tmp_path / "run")
    with Subscriber(url, threads=1) as sub, caplog.at_level(logging.INFO, logger="deltastore.read"):
        writer = _publish_later(url)
        info = sub.wait_for_version(timeout=DEADLINE_S, interval=POLL_S)
        writer.join()
        assert info is not None and info.version == 1
        assert_bits_equal(sub.pull(), small_state(0))
        assert sub.wait_for_version(timeout=0) == info  # already there: no wait, no log line
    assert len(_waiting_lines(caplog)) == 1


def test_a_look_without_waiting_says_nothing_of_waiting(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with Subscriber(str(tmp_path / "run"), threads=1) as sub, caplog.at_level(logging.INFO, logger="deltastore.read"):
        with pytest.raises(WaitTimeoutError, match="waited 0.0 s"):
            sub.wait_for_version(timeout=0)
    assert _waiting_lines(caplog) == []


def test_wait_for_a_given_version(tmp_path: Path) -> None:
    url = str(tmp_path / "run")
    with Publisher(url) as pub:
        pub.publish(small_state(0))
    with Subscriber(url, threads=1) as sub:
        with pytest.raises(WaitTimeoutError, match="for version 3 of .*, which has version 1"):
            sub.wait_for_version(3, timeout=0.1, interval=POLL_S)
        writer = _publish_later(url, seeds=(1, 2), delay=0.1)
        info = sub.wait_for_version(3, timeout=DEADLINE_S, interval=POLL_S)
        writer.join()
        assert info is not None and info.version == 3
        with pytest.raises(ValueError, match="version"):
            sub.wait_for_version(0)


def test_wait_for_version_ends_when_stopped(tmp_path: Path) -> None:
    stop = threading.Event()
    threading.Timer(0.1, stop.set).start()
    with Subscriber(str(tmp_path / "run"), threads=1) as sub:
        assert sub.wait_for_version(interval=POLL_S, stop=stop) is None


def test_wait_for_version_rides_out_a_storage_error(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    class Flaky(WrappedStore):
        failures = 2

        def get_if_changed(self, key, etag):
            if self.failures:
                self.failures -= 1
                raise StorageError(f"GET {key}: 503 Slow Down")
            return super().get_if_changed(key, etag)

    url = str(tmp_path / "run")
    with Publisher(url) as pub:
        pub.publish(small_state(0))
    store = Flaky(open_store(url))
    with Subscriber(url, store=store, threads=1) as sub, caplog.at_level(logging.WARNING, logger="deltastore.read"):
        info = sub.wait_for_version(timeout=DEADLINE_S, interval=POLL_S)
    assert info is not None and info.version == 1 and store.failures == 0
    assert caplog.text.count("503 Slow Down") == 2


def test_follow_on_an_empty_store_says_it_waits_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    url = str(tmp_path / "run")
    target = {k: torch.zeros_like(v) for k, v in small_state(0).items()}
    with Subscriber(url, threads=1) as sub, caplog.at_level(logging.INFO, logger="deltastore.read"):
        writer = _publish_later(url, delay=0.3)
        recs = list(sub.follow(target, poll=PollPolicy(POLL_S), heartbeat=None, max_versions=1))
        writer.join()
    assert [r.info.version for r in recs] == [1]
    assert _waiting_lines(caplog) == [f"waiting for the first version of {sub.url}"]
    assert_bits_equal(target, small_state(0))


# --- deltastore pull --follow -----------------------------------------------------------------


@pytest.mark.parametrize("store_dir", ["missing", "empty"])
def test_pull_follow_started_before_the_trainer_waits_then_follows(tmp_path: Path, store_dir: str,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    store, out = tmp_path / "store", tmp_path / "out.safetensors"
    if store_dir == "empty":
        store.mkdir()
    writer = _publish_later(str(store), delay=20 * POLL_S)  # the trainer starts after its worker
    try:
        rc = main(["pull", str(store), str(out), "--follow", "--interval", str(POLL_S), "--max-versions", "1"])
    finally:
        writer.join()
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert captured.err == f"deltastore: waiting for the first version of {store} (Ctrl-C stops)\n"  # once
    assert main(["pull", str(store), str(out), "--follow", "--interval", str(POLL_S), "--max-versions", "1", "-v"]) == 0
    assert "waiting" not in capsys.readouterr().err  # a version is there: no word of waiting, even with -v
    assert captured.out.startswith("v1 (full load)")
    assert_bits_equal(load_file(str(out)), small_state(0))


def test_pull_of_a_missing_local_store_still_fails_clearly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nothing"
    assert main(["pull", str(missing), str(tmp_path / "out.safetensors")]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0] == f"deltastore: error: BucketNotFoundError: local store root {missing} does not exist: nothing was published there"
    assert err[1] == "hint: check the path (publish creates a local store; pull --follow waits for one)"
    assert not missing.exists()


@pytest.mark.parametrize(("flags", "message"), [
    (["--follow", "--version", "1"], "--version pulls one version and --follow keeps OUT at the latest one: pass one of them"),
    (["--cache", "c"], "--cache is for --follow; a pull without --follow writes one version and exits"),
    (["--interval", "1"], "--interval is for --follow; a pull without --follow writes one version and exits"),
    (["--on-history-replaced", "reload"], "--on-history-replaced is for --follow; a pull without --follow"),
    (["--follow", "--worker-id", "a/b"], "--worker-id: worker id 'a/b' must be"),
])
def test_pull_refuses_contradictory_flags_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                      flags: list[str], message: str) -> None:
    assert main(["pull", str(tmp_path / "store"), str(tmp_path / "out.safetensors"), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"deltastore: error: {message}") and err.count("\n") == 1, err
