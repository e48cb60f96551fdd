"""The changed-tensors API: which tensors and rows a fast-forward wrote, from
the plan, for engines that reload only those."""

from __future__ import annotations

import threading

import pytest
import torch

from deltastore import PollPolicy, Publisher, Subscriber
from deltastore.read.changes import changed_rows, changed_tensors, merge_spans, row_ranges
from deltastore.write.policy import LayoutPolicy, WriterPolicy

#: Small chunks: a (64, 16) fp32 tensor is 4 KiB, so 256-byte chunks are 4 rows each and an
#: edit to one row changes one chunk of it.
CHUNK_BYTES = 256
ROW = 16


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(64, ROW, generator=g),
        "layer.0.weight": torch.randn(64, ROW, generator=g),
        "layer.0.bias": torch.randn(ROW, generator=g),
        "head.weight": torch.randn(32, ROW, generator=g),
    }


def test_spans_and_rows_pure() -> None:
    assert merge_spans([(8, 12), (0, 4), (4, 6), (20, 30), (25, 28)]) == [(0, 6), (8, 12), (20, 30)]
    assert row_ranges((4, 8), [(10, 20)]) == [(1, 3)]
    assert row_ranges((4, 8), [(0, 8), (8, 16), (24, 32)]) == [(0, 2), (3, 4)]
    assert row_ranges((10,), [(3, 5)]) == [(3, 5)]
    assert row_ranges((0, 8), [(0, 0)]) == []
    assert row_ranges((2, 3, 4), [(12, 13)]) == [(1, 2)]


def test_pull_into_reports_only_changed_tensors_and_rows(tmp_path) -> None:
    url = str(tmp_path / "store")
    v1 = _state(0)
    v2 = {n: t.clone() for n, t in v1.items()}
    v2["layer.0.weight"][37, 5] += 1.0  # one element in row 37: its 4-row chunk is rows 36..39
    v2["head.weight"][0] *= 2.0  # the whole row 0
    with Publisher(url, writer_policy=WriterPolicy(threads=1), layout_policy=LayoutPolicy(chunk_bytes=CHUNK_BYTES)) as pub:
        pub.publish(v1)
        pub.publish(v2)
        with Subscriber(url, threads=1) as sub:
            weights = sub.pull(1)
            assert sub.pull_into(weights).version == 2
            changed = sub.last_changed
            assert set(changed) == {"layer.0.weight", "head.weight"}
            # Chunk-granular: the rows written contain the changed row and no more than a chunk.
            rows = {n: r for n, r, _ in changed_rows(weights, changed)}
            assert rows["layer.0.weight"] == [(36, 40)]
            assert rows["head.weight"] == [(0, 4)]
            got = dict(changed_tensors(weights, changed))
            for n, t in got.items():
                assert t is weights[n]  # the target's own tensors, not copies
                assert torch.equal(t, v2[n])
            # Every element outside the spans is unchanged between v1 and v2 (the spans cover the change).
            for n in v1:
                diff = (v1[n] != v2[n]).reshape(-1).nonzero().reshape(-1).tolist()
                spans = changed.get(n, [])
                assert all(any(a <= i < b for a, b in spans) for i in diff), n
            assert sub.pull_into(weights) is None
            assert sub.last_changed == {}


def test_follow_record_updates_feed_load_weights(tmp_path) -> None:
    url = str(tmp_path / "store")
    states = [_state(0)]
    for k in range(2):
        s = {n: t.clone() for n, t in states[-1].items()}
        s["embed.weight"][10 * k + 3] += 0.5
        states.append(s)
    loaded: list[list[str]] = []
    with Publisher(url, writer_policy=WriterPolicy(threads=1), layout_policy=LayoutPolicy(chunk_bytes=CHUNK_BYTES)) as pub:
        for s in states:
            pub.publish(s)
        with Subscriber(url, threads=1) as sub:
            weights = sub.allocate(1)
            model = {n: torch.zeros_like(t) for n, t in weights.items()}  # an engine's own copy

            def load_weights(items):  # what vLLM's model.load_weights does: copy what it is given
                names = []
                for n, t in items:
                    model[n].copy_(t)
                    names.append(n)
                loaded.append(names)

            stop = threading.Event()
            for rec in sub.follow(weights, poll=PollPolicy(0.05), stop=stop, heartbeat=None):
                load_weights(rec.updates(weights))
                if rec.full_load:
                    assert set(rec.changed) == set(weights)
                    # a full load of the latest version: nothing more to come
                    stop.set()
    assert loaded and set(loaded[0]) == set(states[0])
    for n, t in model.items():
        assert torch.equal(t, states[-1][n])


def test_follow_reports_each_version_changes(tmp_path) -> None:
    url = str(tmp_path / "store")
    base = _state(1)
    with Publisher(url, writer_policy=WriterPolicy(threads=1), layout_policy=LayoutPolicy(chunk_bytes=CHUNK_BYTES)) as pub, Subscriber(url, threads=1) as sub:
        pub.publish(base)
        weights = sub.allocate()
        model = {n: torch.zeros_like(t) for n, t in weights.items()}
        it = sub.follow(weights, poll=PollPolicy(0.02), heartbeat=None)
        rec = next(it)
        for n, t in rec.updates(weights):
            model[n].copy_(t)
        nxt = {n: t.clone() for n, t in base.items()}
        nxt["layer.0.bias"][3] = 7.0
        pub.publish(nxt)
        rec = next(it)
        assert rec.from_version == 1 and set(rec.changed) == {"layer.0.bias"}
        assert sub.last_changed == {"layer.0.bias": [(0, ROW)]}
        for n, t in rec.updates(weights):
            model[n].copy_(t)
        it.close()
    for n, t in model.items():
        assert torch.equal(t, nxt[n]), n


def test_changed_tensors_names_a_missing_tensor() -> None:
    with pytest.raises(KeyError, match="nope"):
        list(changed_tensors({"a": torch.zeros(2)}, {"nope": [(0, 1)]}))


def test_pull_into_on_a_grouped_store_names_member_tensors(tmp_path) -> None:
    """With tensor groups (design 007) last_changed names the member tensors a changed group
    chunk overlaps, in their own element coordinates, never the group row."""
    url = str(tmp_path / "s")
    gen = torch.Generator().manual_seed(3)
    state = {f"norm.{i}": torch.randn(256, generator=gen).to(torch.bfloat16) for i in range(40)}
    with Publisher(url, writer_policy=WriterPolicy(threads=2), layout_policy=LayoutPolicy(group_small_tensors=True)) as pub:
        pub.publish(state)
        sub = Subscriber(url)
        weights = sub.pull()
        assert any(n.startswith("#") for n in sub.units()) and not any(n.startswith("#") for n in weights)
        nxt = {n: t.clone() for n, t in state.items()}
        nxt["norm.7"][5] += 1
        pub.publish(nxt)
    sub.pull_into(weights)
    changed = sub.last_changed
    assert changed and all(not n.startswith("#") for n in changed)
    assert "norm.7" in changed
    for name, spans in changed.items():
        assert all(0 <= a < b <= weights[name].numel() for a, b in spans)
    got = dict(changed_tensors(weights, changed))
    assert torch.equal(got["norm.7"].view(torch.int16), nxt["norm.7"].view(torch.int16))
