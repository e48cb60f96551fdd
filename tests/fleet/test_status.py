"""Fleet status (SPEC §10, docs/fleet.md): heartbeats carry stage, goal, lag and the last error
(and older heartbeats still read); ``deltastore status`` shows them and the target; the
readiness probe ``status --worker ID --ready-within N`` exits 0 or 1 as documented."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from deltastore import Publisher
from deltastore.cli import EXIT_FAILED, EXIT_OK, EXIT_USAGE, main
from deltastore.fleet.ledger import (
    LEDGER_PREFIX,
    HeartbeatWriter,
    Progress,
    encode_heartbeat,
    parse_heartbeat,
    read_ledger,
)
from deltastore.fleet.target import write_target
from deltastore.storage import open_store
from testkit.tensors import small_state


@pytest.fixture
def url(tmp_path: Path) -> str:
    """A store at version 5."""
    u = str(tmp_path / "store")
    state = small_state()
    with Publisher(u) as pub:
        for _ in range(5):
            state = {k: v + 1 for k, v in state.items()}
            pub.publish(state)
    return u


def _ready(url: str, worker: str, *within: str) -> int:
    return main(["status", url, "--worker", worker, *(("--ready-within", *within) if within else ())])


def test_readiness_exit_codes_follow_the_goal(url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with open_store(url) as store:
        HeartbeatWriter(store, "at-head").beat(5)
        HeartbeatWriter(store, "behind").beat(3)
        with HeartbeatWriter(store, "stopped") as w:
            w.beat(5)
        HeartbeatWriter(store, "silent").beat(5)
    silent = tmp_path / "store" / "workers" / "silent.json"
    long_ago = time.time() - 3600
    os.utime(silent, (long_ago, long_ago))

    assert _ready(url, "at-head") == EXIT_OK
    assert _ready(url, "behind") == EXIT_FAILED
    assert _ready(url, "behind", "1") == EXIT_FAILED
    assert _ready(url, "behind", "2") == EXIT_OK
    for gone in ("stopped", "silent", "never-started"):
        assert _ready(url, gone, "100") == EXIT_FAILED, gone
    capsys.readouterr()

    # The fleet is moved back to 3: the worker there is ready, the one at HEAD no longer.
    with open_store(url) as store:
        write_target(store, 3)
    assert _ready(url, "behind") == EXIT_OK
    assert _ready(url, "at-head", "1") == EXIT_FAILED
    assert _ready(url, "at-head", "2") == EXIT_OK
    capsys.readouterr()
    assert main(["status", url, "--worker", "at-head", "--json"]) == EXIT_FAILED
    doc = json.loads(capsys.readouterr().out)
    assert (doc["ready"], doc["version"], doc["goal"], doc["distance"], doc["within"]) == (False, 5, 3, 2, 0)

    assert main(["status", url, "--ready-within", "1"]) == EXIT_USAGE  # about one worker: --worker
    assert main(["status", url, "--worker", "w", "--ready-within", "-1"]) == EXIT_USAGE


def test_status_shows_the_target_and_each_workers_stage_goal_and_last_error(url: str,
                                                                            capsys: pytest.CaptureFixture[str]) -> None:
    with open_store(url) as store:
        w = HeartbeatWriter(store, "w1")
        w.report(Progress(stage="fetching", goal=4, lag=1, error="DeadlineExceededError: fetch of a pack stalled"))
        w.beat(3)
        write_target(store, 4, hold=True, note="5 regressed")
    assert main(["status", url, "--json"]) == EXIT_OK
    doc = json.loads(capsys.readouterr().out)
    assert doc["fleet_target"]["target"]["version"] == 4 and doc["fleet_target"]["target"]["hold"]
    assert doc["fleet_target"]["goal"] == 4 and doc["fleet_target"]["problem"] is None
    (w1,) = doc["workers"]
    assert (w1["version"], w1["stage"], w1["goal"], w1["goal_lag"]) == (3, "fetching", 4, 1)
    assert "stalled" in w1["last_error"]
    assert main(["status", url]) == EXIT_OK
    text = capsys.readouterr().out
    assert "fleet target: version 4 (hold" in text and "goal version 4" in text
    assert "fetching (goal v4)" in text and "last error: DeadlineExceededError" in text
    assert main(["target", url]) == EXIT_OK
    assert "followers hold version 4" in capsys.readouterr().out


def test_heartbeats_with_progress_and_without_read_alike() -> None:
    key = f"{LEDGER_PREFIX}w1.json"
    new = parse_heartbeat(encode_heartbeat("w1", 7, progress=Progress(stage="staged", goal=8, lag=1, error="x\n y")), key)
    assert new.version == 7 and new.progress == Progress(stage="staged", goal=8, lag=1, error="x y")
    older = parse_heartbeat(encode_heartbeat("w1", 7), key)  # a writer before progress existed
    assert older.version == 7 and older.progress == Progress()
    doc = json.loads(encode_heartbeat("w1", 7))
    assert not {"stage", "goal", "lag", "error"} & set(doc)  # nothing new in an old writer's bytes
    doc.update(stage="warming", lag=-1, goal="8", error=["no"])  # fields a later or broken writer sent
    odd = parse_heartbeat(json.dumps(doc).encode(), key)
    assert odd.version == 7 and odd.progress == Progress()  # the heartbeat still counts (for GC)
    long = parse_heartbeat(encode_heartbeat("w1", 7, progress=Progress(error="e" * 10_000)), key)
    assert long.progress.error is not None and len(long.progress.error) <= 512


def test_a_changed_report_is_written_at_once_and_an_unchanged_one_is_not(url: str) -> None:
    with open_store(url) as store:
        w = HeartbeatWriter(store, "w1")
        assert w.beat(5)
        assert not w.beat(5)  # same version, same progress: within the interval, nothing written
        w.report(Progress(stage="fetching", goal=6))
        assert w.beat(5)
        (beat,) = read_ledger(store)
        assert beat.progress.stage == "fetching" and beat.progress.goal == 6


def test_the_probe_names_the_format_a_worker_behind_reads(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A worker of a serving format the trainer stopped publishing stays at that format's last
    version: the probe's reason says which format it reads."""
    with open_store(url) as store:
        HeartbeatWriter(store, "fp8", serving_format="fp8-block128").beat(2)
        HeartbeatWriter(store, "plain").beat(2)
    capsys.readouterr()
    assert _ready(url, "fp8") == EXIT_FAILED
    out = capsys.readouterr()
    assert "holds version 2 of format fp8-block128, 3 from version 5" in out.out + out.err
    assert _ready(url, "plain") == EXIT_FAILED
    out = capsys.readouterr()
    assert "holds version 2, 3 from version 5" in out.out + out.err
