"""Deadlines (deltastore.fleet.deadlines): a stalled phase raises a typed error within its deadline,
and a follower reports it and carries on once the stall clears.

The stall is the fault proxy's: a response held back far longer than any test runs ("forever").
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace

import numpy as np
import pytest

from deltastore import Publisher, Subscriber
from deltastore.errors import DeadlineExceededError, StorageError
from deltastore.fleet.deadlines import Deadlines, DeadlineStore, Watchdog, within
from deltastore.read.follow import PollPolicy
from deltastore.storage import open_store
from testkit.proxy import OFF, FaultPlan, FaultProxy
from testkit.targets import unique_prefix
from testkit.tensors import assert_bits_equal, small_state, sparse_edit

#: A short deadline keeps the tests fast; the property is the same at the default's scale.
DEADLINE_S = 0.5
#: The slack the goal allows past a deadline before the error must have arrived.
SLACK_S = 1.0
#: Longer than any test runs: the proxy holds such a response "forever".
FOREVER_S = 3600.0
#: Bytes per second high enough that a fetch's deadline is its floor alone.
INSTANT = 1e15

SHORT = Deadlines(poll=DEADLINE_S, fetch=DEADLINE_S, commit=DEADLINE_S, min_bytes_per_s=INSTANT)
#: The deadline of the phase a test stalls behind the fault proxy: the same phase's calls before
#: the stall (a follower's first polls, a pull's manifest fetch) go through the proxy to a moto
#: server that a loaded test machine (every core busy with other tests' processes) can keep past
#: half a second, and only the stalled call may pass it.
THROUGH_PROXY_S = 2.0


def stall(key_pattern: str) -> FaultPlan:
    """Every GET whose path matches ``key_pattern`` is answered after FOREVER_S."""
    return FaultPlan(rate=1.0, mix={"slow": 1.0}, methods=frozenset({"GET"}), key_pattern=key_pattern,
                     slow_s=FOREVER_S)


def test_deadlines_are_checked_and_grow_with_bytes():
    d = Deadlines(fetch=10, min_bytes_per_s=1024)
    assert d.fetch_s(0) == 10
    assert d.fetch_s(2048) == 12
    assert d.fetch_s(None) > d.fetch_s(64 * 1024 * 1024) / 2  # an unknown size is given a large object's time
    assert d.decode_s(1 << 30) > d.decode_s(1 << 20) > d.decode
    assert d.apply_s(1 << 30) > d.apply
    for bad in (0, -1, float("nan"), float("inf"), True, "5"):
        with pytest.raises(ValueError, match="Deadlines.poll"):
            Deadlines(poll=bad)


def test_within_returns_raises_and_abandons():
    assert within(1.0, "fetch", "k", lambda a, b=0: a + b, 1, b=2) == 3
    with pytest.raises(KeyError):
        within(1.0, "fetch", "k", {}.__getitem__, "x")
    release = threading.Event()
    t0 = time.monotonic()
    with pytest.raises(DeadlineExceededError) as got:
        within(0.05, "poll", "s3://b/p/HEAD", release.wait, 10)
    release.set()
    assert time.monotonic() - t0 < 0.05 + SLACK_S
    e = got.value
    assert (e.phase, e.object, e.deadline_s) == ("poll", "s3://b/p/HEAD", 0.05)
    assert isinstance(e, StorageError) and isinstance(e, TimeoutError)
    assert "s3://b/p/HEAD" in str(e) and "Deadlines.poll" in str(e)


def test_a_cpu_phase_past_its_deadline_is_reported_and_finishes():
    late: list[DeadlineExceededError] = []
    reported = threading.Event()
    dog = Watchdog(lambda e: (late.append(e), reported.set()))
    try:
        with dog.phase("apply", "version 3", 0.05):
            assert reported.wait(5.0), "the watchdog never reported the overrun"
        with dog.phase("decode", "version 4", 60.0):
            pass  # on time: nothing reported
    finally:
        dog.close()
    assert [(e.phase, e.object) for e in late] == [("apply", "version 3")]


def test_a_stalled_fetch_raises_a_typed_error_within_its_deadline(moto_server):
    url = moto_server.url(unique_prefix())
    with Publisher(url, storage_options=moto_server.storage_options()) as pub:
        pub.publish(small_state(1))
    with FaultProxy(moto_server.endpoint_url, stall(r"\.pack$")) as proxy:
        options = moto_server.storage_options(endpoint_url=proxy.endpoint_url)
        # only the fetch has a deadline of the test's (HEAD's is the default's): a slow HEAD on a
        # busy machine must not be the error seen
        fetch = Deadlines(fetch=THROUGH_PROXY_S, min_bytes_per_s=INSTANT)
        with Subscriber(url, storage_options=options, deadlines=fetch) as sub:
            t0 = time.monotonic()
            with pytest.raises(DeadlineExceededError) as got:
                sub.pull()
            waited = time.monotonic() - t0
        assert proxy.counts["slow"] >= 1  # the stall did happen
    assert got.value.phase == "fetch" and got.value.object.endswith(".pack")
    # the whole pull: HEAD and the manifest, then the pack's deadline
    assert waited < THROUGH_PROXY_S + SLACK_S, f"the stalled fetch was reported after {waited:.2f} s"


def test_a_write_past_its_deadline_raises_commit():
    inner = open_store("memory://deadline-commit")
    release = threading.Event()
    real_put = inner.put
    inner.put = lambda key, data, mode="overwrite": (release.wait(10), real_put(key, data, mode=mode))[1]  # type: ignore[method-assign]
    store = DeadlineStore(inner, Deadlines(commit=0.05, min_bytes_per_s=INSTANT))
    with pytest.raises(DeadlineExceededError) as got:
        store.put("workers/w.json", b"{}")
    release.set()
    assert got.value.phase == "commit" and got.value.object.endswith("workers/w.json")


def test_every_immutable_object_is_read_as_a_fetch_and_every_other_key_as_a_poll():
    """A read's deadline follows what it reads: a manifest or an object under an attempt is a
    fetch (its deadline grows with its bytes), at the root and inside a serving stream's tree;
    HEAD and the other small mutable objects are polls."""
    inner = open_store("memory://deadline-kinds")
    with Publisher(inner.url, store=inner, formats=["bf16", "fp8-block128"]) as pub:
        for i in range(2):
            pub.publish(small_state(i))
    inner.put("workers/w1.json", b"{}")
    keys = [m.key for m in inner.list()]
    assert any(k.startswith("streams/fp8-block128/objects/") for k in keys)
    assert any(k.startswith("streams/fp8-block128/manifests/") for k in keys)
    release = threading.Event()
    real_get = inner.get
    inner.get = lambda key, byte_range=None: (release.wait(10), real_get(key, byte_range=byte_range))[1]  # type: ignore[method-assign]
    store = DeadlineStore(inner, Deadlines(poll=0.02, fetch=0.02, min_bytes_per_s=INSTANT))
    try:
        for key in keys:
            rel = key.split("/", 2)[2] if key.startswith("streams/") else key
            want = "fetch" if rel.startswith(("objects/", "manifests/")) else "poll"
            with pytest.raises(DeadlineExceededError) as got:
                store.get(key)
            assert got.value.phase == want, key
    finally:
        release.set()


class _Seen(logging.Handler):
    """Notes when the follow loop logs a deadline error."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.at: float | None = None
        self.event = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if "DeadlineExceededError" in record.getMessage() and self.at is None:
            self.at = time.monotonic()
            self.event.set()


def test_a_follower_reports_a_stalled_poll_and_carries_on(moto_server):
    url = moto_server.url(unique_prefix())
    rng = np.random.default_rng(0)
    state = small_state(2)
    seen = _Seen()
    log = logging.getLogger("deltastore.read.follow")
    log.addHandler(seen)
    with Publisher(url, storage_options=moto_server.storage_options()) as pub, \
            FaultProxy(moto_server.endpoint_url) as proxy:
        pub.publish(state)
        options = moto_server.storage_options(endpoint_url=proxy.endpoint_url)
        stop = threading.Event()
        try:
            with Subscriber(url, storage_options=options, deadlines=replace(SHORT, poll=THROUGH_PROXY_S)) as sub:
                target = sub.allocate()
                records = sub.follow(target, poll=PollPolicy(interval=0.05, jitter=0.0, max_interval=0.2),
                                     stop=stop, heartbeat=None)
                assert next(records).info.version == 1
                proxy.set_plan(stall(r"/HEAD$"))  # from now on HEAD never answers
                stalled_at = time.monotonic()
                state = sparse_edit(state, rng)
                pub.publish(state)

                def clear_when_reported() -> None:
                    seen.event.wait(10.0)
                    proxy.set_plan(OFF)

                clearer = threading.Thread(target=clear_when_reported, daemon=True)
                clearer.start()
                rec = next(records)  # blocks through the stall; returns once it clears
                clearer.join()
                records.close()
        finally:
            stop.set()
            log.removeHandler(seen)
    assert seen.at is not None, "the follower never reported the stalled poll"
    # the loop was waiting at most one poll interval when the stall began
    assert seen.at - stalled_at < 0.05 + THROUGH_PROXY_S + SLACK_S
    assert rec.info.version == 2
    assert_bits_equal(target, state, "after the stall cleared")
