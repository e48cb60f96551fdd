"""Publishers and subscribers driven by hypothesis, checked against a list of committed states.

The model is the list of every committed state dict (version v is ``committed[v - 1]``) and the
layout generation of each version. Every rule acts on a real ``memory://`` store and compares
what the library says and returns with the model, bit for bit.
"""

from __future__ import annotations

import uuid

import numpy as np
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from deltastore import FencedError, LayoutMismatchError, Publisher, Subscriber
from deltastore.layout.tensors import bits
from deltastore.write.policy import AnchorPolicy, LayoutPolicy, WriterPolicy
from testkit.hypo import examples
from testkit.stores import check_invariants
from testkit.tensors import assert_bits_equal, snapshot

ANCHOR_EVERY = 4
N_SUBSCRIBERS = 2
#: Chunks of 64 bytes: the tiny tensors below still span several chunks each.
CHUNK_BYTES = 64


def _base_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(24, 4, generator=g).to(torch.bfloat16),
        "b": torch.randn(10, generator=g),
        "n": torch.randint(0, 1000, (6, 2), generator=g),
        "s": torch.tensor(0.5, dtype=torch.float64),
    }


class PublishSubscribe(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.url = f"memory://state-machine-{uuid.uuid4().hex}"
        self.committed: list[dict[str, torch.Tensor]] = []
        self.layout_gen: list[int] = []  # per version: bumps when the layout changed
        self.kinds: list[str] = []
        self.pub = Publisher(self.url, writer_policy=WriterPolicy(threads=1),
                             anchor_policy=AnchorPolicy(every=ANCHOR_EVERY),
                             layout_policy=LayoutPolicy(chunk_bytes=CHUNK_BYTES))
        self.fenced: list[Publisher] = []
        self.subs = [Subscriber(self.url, threads=1) for _ in range(N_SUBSCRIBERS)]
        self.targets: list[dict[str, torch.Tensor] | None] = [None] * N_SUBSCRIBERS
        self.held: list[int | None] = [None] * N_SUBSCRIBERS
        self.closing: list = []

    # --- helpers ------------------------------------------------------------------------

    def _next_kind(self, forced: bool) -> str:
        v = len(self.committed) + 1
        last_anchor = max((i + 1 for i, k in enumerate(self.kinds) if k == "anchor"), default=0)
        return "anchor" if forced or v == 1 or v - last_anchor >= ANCHOR_EVERY else "delta"

    def _commit(self, state: dict[str, torch.Tensor], *, anchor: bool, relayout: bool = False) -> None:
        if not anchor and self.committed and _bit_identical(state, self.committed[-1]):
            # skip_unchanged (the default): the same state again is not a new version
            info = self.pub.publish(state, step=len(self.committed), metadata={"v": len(self.committed) + 1})
            assert info.version == len(self.committed) and info.metadata == {"v": info.version}
            return
        expected_kind = self._next_kind(anchor)
        info = self.pub.publish(state, anchor=anchor, step=len(self.committed), metadata={"v": len(self.committed) + 1})
        self.committed.append(snapshot(state))
        self.layout_gen.append((self.layout_gen[-1] if self.layout_gen else 0) + relayout)
        self.kinds.append(info.kind)
        assert info.version == len(self.committed)
        assert info.parent == (info.version - 1 or None)
        assert info.kind == expected_kind, (info.version, info.kind, expected_kind)
        assert info.metadata == {"v": info.version}

    def _edit(self, seed: int, fraction: float) -> dict[str, torch.Tensor]:
        state = snapshot(self.committed[-1])
        rng = np.random.default_rng(seed)
        for t in state.values():
            b = bits(t)
            k = int(rng.integers(0, max(2, int(b.size * fraction) + 1)))
            idx = rng.integers(0, b.size, size=k)
            b[idx] ^= rng.integers(1, 255, size=k).astype(b.dtype)
        return state

    # --- rules --------------------------------------------------------------------------

    @initialize(seed=st.integers(0, 2**16))
    def first_version(self, seed: int) -> None:
        self._commit(_base_state(seed), anchor=False)

    @rule(seed=st.integers(0, 2**32 - 1), fraction=st.sampled_from([0.0, 0.01, 0.1, 1.0]))
    def publish_edit(self, seed: int, fraction: float) -> None:
        self._commit(self._edit(seed, fraction), anchor=False)

    @rule(seed=st.integers(0, 2**32 - 1))
    def publish_anchor(self, seed: int) -> None:
        self._commit(self._edit(seed, 0.05), anchor=True)

    @rule(seed=st.integers(0, 2**32 - 1), extra_rows=st.integers(1, 3))
    def publish_new_layout(self, seed: int, extra_rows: int) -> None:
        state = self._edit(seed, 0.05)
        b = state["b"]
        state["b"] = torch.cat([b, torch.arange(extra_rows, dtype=b.dtype)])
        try:
            self.pub.publish(state)
        except LayoutMismatchError as e:
            assert "'b'" in str(e)
        else:
            raise AssertionError("a layout change without anchor=True must be refused")
        self._commit(state, anchor=True, relayout=True)

    @rule()
    def takeover(self) -> None:
        old = self.pub
        self.pub = Publisher(self.url, writer_policy=WriterPolicy(threads=1),
                             anchor_policy=AnchorPolicy(every=ANCHOR_EVERY),
                             layout_policy=LayoutPolicy(chunk_bytes=CHUNK_BYTES))
        assert self.pub.version == len(self.committed)
        self.fenced.append(old)

    @precondition(lambda self: self.fenced)
    @rule(seed=st.integers(0, 2**32 - 1))
    def fenced_publisher_cannot_commit(self, seed: int) -> None:
        state = self._edit(seed, 0.05)
        for anchor in (False, True):  # (anchor=True: whatever the layout, it gets to the commit)
            try:
                self.fenced[-1].publish(state, anchor=anchor)
            except FencedError as e:
                assert e.head_version in (None, len(self.committed))  # None: it knew it was fenced
            except LayoutMismatchError:
                assert not anchor  # the layout changed since it was fenced: refused before any write
            else:
                raise AssertionError("a publisher that was taken over committed")

    @rule(i=st.integers(0, N_SUBSCRIBERS - 1), data=st.data())
    def subscriber_pull_into(self, i: int, data) -> None:
        sub, latest = self.subs[i], len(self.committed)
        if self.targets[i] is None:
            v = data.draw(st.integers(1, latest), label="first pull")
            self.targets[i] = sub.pull(v)
            self.held[i] = v
        else:
            held = self.held[i]
            assert held is not None
            to = data.draw(st.integers(held, latest), label="pull_into version")
            target = self.targets[i]
            before = snapshot(target)
            crosses_layout = self.layout_gen[to - 1] != self.layout_gen[held - 1]
            try:
                got = sub.pull_into(target, version=to)
            except LayoutMismatchError:
                assert crosses_layout, f"pull_into {held} -> {to} refused without a layout change"
                assert_bits_equal(target, before, "a refused pull_into changed the target")
                self.targets[i], self.held[i] = sub.pull(to), to
            else:
                assert not crosses_layout, f"pull_into {held} -> {to} crossed a layout change"
                assert (got is None) == (to == held)
                if got is not None:
                    assert got.version == to
                self.held[i] = to
        assert sub.version == self.held[i]
        assert_bits_equal(self.targets[i], self.committed[self.held[i] - 1], f"subscriber {i} at {self.held[i]}")

    @rule(data=st.data())
    def fresh_pull(self, data) -> None:
        v = data.draw(st.integers(1, len(self.committed)), label="version")
        with Subscriber(self.url, threads=1) as sub:
            assert_bits_equal(sub.pull(v), self.committed[v - 1], f"fresh pull({v})")
            assert sub.info(v).kind == self.kinds[v - 1]

    # --- invariants ---------------------------------------------------------------------

    @invariant()
    def store_matches_model(self) -> None:
        assert check_invariants(self.pub.store) == list(range(1, len(self.committed) + 1))
        latest = self.subs[0].latest()
        assert latest is not None and latest.version == len(self.committed)

    def teardown(self) -> None:
        for p in [self.pub, *self.fenced]:
            p.close()
        for s in self.subs:
            s.close()


PublishSubscribe.TestCase.settings = settings(
    # A fraction of the profile's budget: each example publishes and pulls a chain of versions.
    max_examples=examples(0.8),
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestPublishSubscribe = PublishSubscribe.TestCase


def _bit_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Same names, dtypes, shapes and bits (what skip_unchanged compares)."""
    return a.keys() == b.keys() and all(
        a[n].dtype == b[n].dtype and a[n].shape == b[n].shape
        and torch.equal(a[n].reshape(-1).view(torch.uint8), b[n].reshape(-1).view(torch.uint8))
        for n in a
    )
