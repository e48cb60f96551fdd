"""GC killed by SIGKILL halfway through its deletes, on a real S3 server ("GC killed
halfway: no kept version loses an object; the next run finishes").

The collector runs in its own process, which kills itself with SIGKILL after a given number of
deletes (no cleanup, no exception handler runs: what a kill -9 or an OOM kill does). Every kept
and pinned version must still pull bit-exactly, and the next run must finish the collection.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from deltastore.format.history import History
from deltastore.lifecycle.gc import collect
from deltastore.lifecycle.index import pin, read_index
from deltastore.storage import open_store
from testkit.lifecycle import assert_versions_intact, needs_of, publish, pull_from_manifest
from testkit.stores import keys
from testkit.tensors import assert_bits_equal, mp_context

#: GC's grace in this test (unsafe_grace_ok): the versions are published, then aged past it.
GRACE_S = 1.0


def _collect_then_die(url: str, options: dict, after: int) -> None:
    store = open_store(url, storage_options=options)
    lock, done = threading.Lock(), [0]
    real_delete = store.delete

    def delete(key: str) -> None:
        with lock:  # GC deletes on several threads
            if done[0] == after:
                os.kill(os.getpid(), signal.SIGKILL)
            done[0] += 1
        real_delete(key)

    store.delete = delete  # type: ignore[method-assign]
    collect(store, keep_last=2, grace_s=GRACE_S, unsafe_grace_ok=True)


@pytest.mark.integration
@pytest.mark.parametrize("after", [0, 4])
def test_gc_killed_by_sigkill_halfway_loses_nothing_kept(seaweedfs_s3_url, after: int) -> None:
    url, options = seaweedfs_s3_url.url, seaweedfs_s3_url.storage_options
    store = open_store(url, storage_options=options)
    states = publish(store, 10)  # anchors at 1, 4, 7, 10
    pin(store, 2)
    time.sleep(GRACE_S + 1.5)  # every object older than the grace (store clock)
    before = keys(store)

    proc = mp_context().Process(target=_collect_then_die, args=(url, options, after))
    proc.start()
    proc.join(timeout=120)
    assert proc.exitcode == -signal.SIGKILL, f"the collector was not killed (exit code {proc.exitcode})"

    h = History(store)
    head, _ = h.read_head()
    index = read_index(h, head)
    assert index is not None and index.floor == 7, "the floor is committed before the first delete"
    left = keys(store)
    # deletes run on several threads: those counted may not all have reached the server
    assert len(before - left) <= after, "the collector deleted more than it had started before its death"
    for v in range(index.floor, head.version + 1):
        assert needs_of(store, v) <= left, f"version {v} lost an object"
    assert_versions_intact(store, states, range(index.floor, head.version + 1))
    assert_bits_equal(pull_from_manifest(store, index.pins[0].manifest), states[2], "pinned version 2")

    # The killed run's own record (its clock probe) ages past the grace too: else the next run
    # keeps it (the store's clock has whole seconds) and the run after deletes it.
    time.sleep(GRACE_S + 1.5)
    report = collect(store, keep_last=2, grace_s=GRACE_S, unsafe_grace_ok=True)  # the next run finishes
    assert report.floor_after == 7 and report.deleted_objects > 0
    again = collect(store, keep_last=2, grace_s=GRACE_S, unsafe_grace_ok=True)
    assert again.deleted_objects <= 2, f"the second run left work: {again.deleted}"  # its own gc records at most
    assert_versions_intact(store, states, range(7, head.version + 1))
    assert_bits_equal(pull_from_manifest(store, index.pins[0].manifest), states[2], "pinned version 2")
