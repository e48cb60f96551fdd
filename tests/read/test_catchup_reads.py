"""What a worker k versions behind reads to plan its catch-up (design 005 D6): with a
squash from the version it holds, a constant number of manifests whatever k; without one, the k
manifests of the chain (each lists segments it applies), fetched in O(log k) rounds through the
skip pointers, never one at a time."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from deltastore import Publisher, Subscriber
from deltastore.lifecycle.compact import compact
from deltastore.storage import open_store
from deltastore.storage.base import Store
from deltastore.write.policy import AnchorPolicy, LayoutPolicy, WriterPolicy
from testkit.stores import WrappedStore
from testkit.tensors import SMALL_CHUNK_BYTES, TinyTrainer, assert_bits_equal, snapshot

#: Versions behind head of the three workers (k = 1, 8, 64 of a real run, at test scale).
KS = (4, 16, 48)
#: Head version: the farthest worker holds HEAD_VERSION − 48 = 4.
HEAD_VERSION = 52
#: An anchor after the farthest worker's version (a cost-policy anchor lands like this at
#: rl-3e-6 every ~36 versions): its candidate path must be priced without reading the chain.
ANCHOR_AT = 8
#: Latency added to every manifest GET while a catch-up is measured, so that GETs issued in
#: the same round overlap in time and rounds can be counted from their intervals.
MANIFEST_DELAY_S = 0.1


class MetaCounter(WrappedStore):
    """Counts GETs of everything but packs; times manifest GETs when ``delay`` is set."""

    def __init__(self, inner: Store):
        super().__init__(inner)
        self.delay = 0.0
        self.intervals: list[tuple[float, float]] = []  # manifest GETs (start, end), monotonic

    def get(self, key: str, *, byte_range: tuple[int, int] | None = None) -> bytes:
        if not key.startswith("manifests/") or not self.delay:
            return super().get(key, byte_range=byte_range)
        t0 = time.monotonic()
        time.sleep(self.delay)
        try:
            return super().get(key, byte_range=byte_range)
        finally:
            with self._lock:
                self.intervals.append((t0, time.monotonic()))

    def meta_gets(self) -> list[str]:
        return [k for verb, k in self.calls if verb.startswith("get") and not k.endswith(".pack")]

    def manifest_gets(self) -> list[str]:
        return [k for k in self.meta_gets() if k.startswith("manifests/")]

    def reset(self) -> None:
        self.calls.clear()
        self.intervals.clear()


def sequential_rounds(intervals: list[tuple[float, float]]) -> int:
    """The most GETs that ran one after another (none overlapping the next): the rounds of
    round trips a reader waited for."""
    n, last_end = 0, -math.inf
    for start, end in sorted(intervals, key=lambda iv: iv[1]):
        if start >= last_end:
            n, last_end = n + 1, end
    return n


@dataclass
class Worker:
    sub: Subscriber
    store: MetaCounter
    target: dict[str, torch.Tensor]


def run_with_workers(root: Path) -> tuple[str, dict[int, Worker], dict[int, dict[str, torch.Tensor]]]:
    """Publish HEAD_VERSION versions (an anchor at ANCHOR_AT); a worker pulls head when head is
    HEAD_VERSION − k, for each k (it has read only what a worker following then would)."""
    url = f"file://{root}"
    trainer = TinyTrainer(3)
    states: dict[int, dict[str, torch.Tensor]] = {}
    workers: dict[int, Worker] = {}
    with Publisher(url, writer_policy=WriterPolicy(threads=2), anchor_policy=AnchorPolicy(every=1000),
                   layout_policy=LayoutPolicy(chunk_bytes=SMALL_CHUNK_BYTES)) as pub:
        state = trainer.export()
        for v in range(1, HEAD_VERSION + 1):
            assert pub.publish(state, anchor=v == ANCHOR_AT).version == v
            states[v] = snapshot(state)
            k = HEAD_VERSION - v
            if k in KS:
                store = MetaCounter(open_store(url))
                sub = Subscriber(url, threads=2, store=store)
                workers[k] = Worker(sub, store, sub.pull())
            state = trainer.step()
    return url, workers, states


def test_with_a_squash_the_manifest_reads_do_not_grow_with_k(tmp_path: Path) -> None:
    url, workers, states = run_with_workers(tmp_path)
    report = compact(url, bases=[HEAD_VERSION - k for k in KS], threads=2)
    squash_bytes = {s.from_: s.bytes for s in report.squashes}
    assert sorted(squash_bytes) == sorted(HEAD_VERSION - k for k in KS)
    reads = {}
    try:
        for k, w in workers.items():
            w.store.reset()
            before = w.sub.bytes_fetched
            assert w.sub.pull_into(w.target).version == HEAD_VERSION
            assert_bits_equal(w.target, states[HEAD_VERSION], f"k={k}")
            assert w.sub.bytes_fetched - before <= squash_bytes[HEAD_VERSION - k], f"k={k}: the squash was not used"
            reads[k] = (len(w.store.manifest_gets()), w.store.meta_gets())
    finally:
        for w in workers.values():
            w.sub.close()
    # HEAD, the head manifest, the index, the squash manifest; and the anchor's manifest (one
    # GET through anchor_manifest) when an anchor lies between the held version and head.
    for k, (n, gets) in reads.items():
        assert n <= 2, f"k={k}: {n} manifest GETs to plan a catch-up through a squash: {gets}"
        assert len(gets) <= 5, f"k={k}: {gets}"
    assert reads[48][0] <= reads[4][0] + 1, {k: r[0] for k, r in reads.items()}


def test_without_a_squash_the_chain_arrives_in_logarithmic_rounds(tmp_path: Path) -> None:
    _url, workers, states = run_with_workers(tmp_path)
    seen = {}
    try:
        for k, w in workers.items():
            w.store.reset()
            w.store.delay = MANIFEST_DELAY_S
            assert w.sub.pull_into(w.target).version == HEAD_VERSION
            w.store.delay = 0.0
            assert_bits_equal(w.target, states[HEAD_VERSION], f"k={k}")
            gets = w.store.manifest_gets()
            rounds = sequential_rounds(w.store.intervals)
            seen[k] = (len(gets), rounds)
            # every manifest of (h, t] lists segments the chain applies: each is read once
            assert len(gets) == len(set(gets)), f"k={k}: a manifest was read twice"
            assert len(gets) <= k + 1, f"k={k}: {len(gets)} manifest GETs"
            assert rounds <= 2 * math.ceil(math.log2(k)) + 2, f"k={k}: {rounds} sequential rounds of manifest GETs"
    finally:
        for w in workers.values():
            w.sub.close()
    print(f"manifest GETs, sequential rounds by k: {seen}")
