"""Staged updates and following for partial subscribers (SPEC §8 "Partial pulls", §7.7).

- ``stage`` + ``swap`` bring a selection (names, rows, columns, group members, grid blocks)
  to every version bit-exactly, interleaved with ``pull_into`` (the spare bits of edge chunks
  that a swap installs are what the next update starts from), writing nothing before the swap
  and reporting changed spans in the user's coordinates;
- a target written between stage and swap is detected with nothing applied, and a new stage
  then succeeds;
- ``follow`` takes a partial subscriber (in place and by rebinding); its worker cache holds the
  selection and the spare bits, is adopted by the same selection without a fetch (and the next
  delta applies on top), and is discarded for another selection or damaged spare bits;
- a selection's ``exclude`` leaves tensors out (a pipeline stage's other layers).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from deltastore import CachePolicy, PollPolicy, Publisher, Subscriber
from deltastore.errors import SelectionError, TargetModifiedError
from deltastore.layout.select import Selection
from deltastore.layout.tensors import bits
from deltastore.read.changes import changed_rows
from deltastore.write.policy import AnchorPolicy, LayoutPolicy, WriterPolicy
from testkit.partial import expected_rows
from testkit.tensors import assert_bits_equal, snapshot, sparse_edit

#: Chunks of 480 bytes: 10 rows of 24 bf16, so 16-row slices straddle chunk edges.
CHUNK = 480


def _model(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    state = {
        "layers.0.attn.w": torch.randn(64, 24, generator=g).bfloat16(),
        "layers.0.mlp.w": torch.randn(128, 24, generator=g).bfloat16(),
        "layers.1.attn.w": torch.randn(64, 24, generator=g).bfloat16(),
        "layers.1.mlp.w": torch.randn(128, 24, generator=g).bfloat16(),
        "emb": torch.randn(96, 12, generator=g).half(),
    }
    # small tensors stored back to back in group rows (design 007): a selection holds some of them
    state.update({f"layers.{i % 2}.norm{i}": torch.randn(40, generator=g).bfloat16() for i in range(6)})
    return state


def _publish_chain(url: str, n: int = 7, *, grouped: bool = False) -> list[dict[str, torch.Tensor]]:
    """Versions 1..n (an anchor every 3), returned as published; ``grouped``: every tensor
    here is small, so all of them share group rows (and none can be cut)."""
    rng = np.random.default_rng(1)
    state = _model()
    out = []
    with Publisher(url, writer_policy=WriterPolicy(threads=2), anchor_policy=AnchorPolicy(every=3),
                   layout_policy=LayoutPolicy(chunk_bytes=CHUNK, group_small_tensors=grouped)) as pub:
        for _ in range(n):
            pub.publish(state)
            out.append(snapshot(state))
            state = sparse_edit(state, rng, 0.05)
    return out


#: (selection, grouped store)
CASES = [
    (Selection(shard=(0, 1, 4), shard_names=("layers.*.w", "emb")), False),
    (Selection(names=("layers.1.*", "emb"), shard=(0, 0, 3), shard_names=("*.w", "emb")), False),
    (Selection(shard=(1, 2, 5), shard_names=("layers.*.w",)), False),
    (Selection(names=("layers.0.mlp.w", "layers.0.norm2", "layers.1.norm5")), True),
    (Selection(exclude=("layers.1.*",)), True),
]
IDS = ["rows", "names+rows", "cols-uneven", "members", "exclude-members"]


def _check_changed(mine: dict[str, torch.Tensor], before: dict[str, torch.Tensor], changed: dict) -> None:
    """Rows outside ``changed`` (the user's coordinates) did not change."""
    rows = {name: spans for name, spans, _ in changed_rows(mine, changed)}
    for name, t in mine.items():
        keep = np.ones(t.shape[0], dtype=bool)
        for a, b in rows.get(name, []):
            keep[a:b] = False
        now, then = bits(t).reshape(t.shape[0], -1), bits(before[name]).reshape(t.shape[0], -1)
        assert np.array_equal(now[keep], then[keep]), name


@pytest.mark.parametrize(("sel", "grouped"), CASES, ids=IDS)
def test_stage_and_swap_bring_a_selection_to_every_version(tmp_path, sel: Selection, grouped: bool) -> None:
    url = str(tmp_path / "store")
    states = _publish_chain(url, grouped=grouped)
    with Subscriber(url, threads=2, select=sel) as sub:
        mine = sub.pull(1)
        if grouped:
            assert any(s.members for s in sub.units().values())  # the members really share group rows
            assert sub._reader.partial.spare, "a member selection keeps its group chunks' other members"
        for v in range(2, len(states) + 1):
            before = snapshot(mine)
            if v % 3 == 0:  # pull_into in between: it starts from the spare bits the swaps left
                sub.pull_into(mine, v)
            else:
                staged = sub.stage(mine, v)
                assert staged is not None and staged.info.version == v
                assert_bits_equal(mine, before, f"v{v}: nothing written before the swap")
                sub.swap(staged, mine)
            assert_bits_equal(mine, expected_rows(states[v - 1], sel), f"v{v}")
            assert sub.version == v
            for name, spans in sub.last_changed.items():  # in the slice's own coordinates
                assert all(0 <= a < b <= mine[name].numel() for a, b in spans), (v, name, spans)
            _check_changed(mine, before, sub.last_changed)
        assert sub.stage(mine) is None  # current
    with Subscriber(url, threads=2, select=sel) as sub:  # staged from nothing into a zeroed target
        fresh = sub.allocate(4)
        sub.swap(sub.stage(fresh, 4), fresh)
        assert_bits_equal(fresh, expected_rows(states[3], sel), "fresh v4")
        sub.swap(sub.stage(fresh, 5), fresh)
        assert_bits_equal(fresh, expected_rows(states[4], sel), "fresh v5")


def test_a_selection_written_between_stage_and_swap_is_detected(tmp_path) -> None:
    url = str(tmp_path / "store")
    states = _publish_chain(url)
    sel = Selection(names=("layers.0.mlp.w", "emb"), shard=(0, 1, 3))
    with Subscriber(url, threads=2, select=sel) as sub:
        mine = sub.pull(1)
        for v in range(2, len(states)):  # the first version that changes the selection
            staged = sub.stage(mine, v)
            if staged.patches:
                break
            sub.swap(staged, mine)
        spare = {k: v.copy() for k, v in sub._reader.partial.spare.items()}
        p = staged.patches[0]
        b = bits(mine[p.name])
        at = p.span[0] + int(p.positions[-1])
        b[at] ^= 1  # written by someone else, at a position the update changes
        before = snapshot(mine)
        with pytest.raises(TargetModifiedError):
            sub.swap(staged, mine)
        assert_bits_equal(mine, before, "nothing applied")
        assert sub.version == v - 1
        assert sub._reader.partial.spare.keys() == spare.keys()
        assert all(np.array_equal(sub._reader.partial.spare[k], old) for k, old in spare.items()), "spare bits kept"
        b[at] ^= 1
        sub.swap(sub.stage(mine, v + 1), mine)
        assert_bits_equal(mine, expected_rows(states[v], sel))


@pytest.mark.parametrize("swap_mode", ["inplace", "rebind"])
@pytest.mark.parametrize(("sel", "grouped"), [
    (Selection(exclude=("layers.0.*",)), True),  # a pipeline stage: the other stage's layers left out
    (Selection(names=("layers.1.*",), shard=(0, 1, 2), shard_names=("*.w",)), False),  # the norms whole
], ids=["stage", "rows"])
def test_follow_a_partial_subscriber(tmp_path, swap_mode: str, sel: Selection, grouped: bool) -> None:
    url = str(tmp_path / "store")
    rng = np.random.default_rng(3)
    state = _model()
    fast = PollPolicy(0.001, jitter=0.0)
    pauses = []

    class Pause:
        def __enter__(self):
            pauses.append(threading.get_ident())

        def __exit__(self, *exc):
            return False

    with Publisher(url, writer_policy=WriterPolicy(threads=2), anchor_policy=AnchorPolicy(every=3),
                   layout_policy=LayoutPolicy(chunk_bytes=CHUNK, group_small_tensors=grouped)) as pub, \
            Subscriber(url, threads=2, select=sel) as sub:
        pub.publish(state)
        mine = sub.allocate()
        records = []
        for v in range(1, 6):
            if v > 1:
                state = sparse_edit(state, rng, 0.05)
                pub.publish(state)
            before = snapshot(mine)
            (rec,) = list(sub.follow(mine, poll=fast, max_versions=1, swap_mode=swap_mode, pause=Pause))
            records.append(rec)
            assert rec.info.version == v and rec.full_load == (v == 1)
            assert_bits_equal(mine, expected_rows(state, sel), f"v{v}")
            assert set(rec.changed) <= set(mine)
            if v > 1:
                _check_changed(mine, before, rec.changed)
                assert dict(rec.updates(mine)).keys() == rec.changed.keys()
        assert len(pauses) == 5
        assert any(r.changed for r in records[1:])


def test_a_partial_worker_cache_is_adopted_by_the_same_selection_only(tmp_path, caplog) -> None:
    url, cache = str(tmp_path / "store"), CachePolicy(str(tmp_path / "cache"))
    states = _publish_chain(url, n=4, grouped=True)
    sel = Selection(names=("layers.0.mlp.w", "layers.0.norm2", "layers.1.norm5"))
    fast = PollPolicy(0.001, jitter=0.0)
    with Subscriber(url, threads=2, select=sel) as sub:
        mine = sub.pull(3)
        assert sub._reader.partial.spare  # group rows shared with unselected members
        list(sub.follow(mine, poll=fast, cache=cache, stop=_stopped()))  # saves version 3 on the way out
    with Subscriber(url, threads=2, select=sel) as sub:
        fresh = sub.allocate(3)
        (rec,) = list(sub.follow(fresh, poll=fast, cache=cache, max_versions=1))
        assert rec.info.version == 3 and rec.bytes_fetched == 0  # adopted, nothing fetched
        assert_bits_equal(fresh, expected_rows(states[2], sel), "adopted v3")
        (rec,) = list(sub.follow(fresh, poll=fast, max_versions=1))  # its spare bits carry the next delta
        assert rec.info.version == 4 and not rec.full_load
        assert_bits_equal(fresh, expected_rows(states[3], sel), "v4 on top")
    other = Selection(names=("layers.0.mlp.w", "layers.0.norm2"))
    with Subscriber(url, threads=2, select=other) as sub, caplog.at_level("WARNING"):
        fresh = sub.allocate()
        (rec,) = list(sub.follow(fresh, poll=fast, cache=cache, max_versions=1))
        assert rec.bytes_fetched > 0 and "another selection" in caplog.text
        assert_bits_equal(fresh, expected_rows(states[3], other), "loaded from the store")


def _stopped() -> threading.Event:
    stop = threading.Event()
    stop.set()
    return stop


def test_damaged_spare_bits_in_a_worker_cache_are_not_adopted(tmp_path, caplog) -> None:
    from deltastore.read.cache import WorkerCache

    url, path = str(tmp_path / "store"), tmp_path / "cache"
    states = _publish_chain(url, n=2, grouped=True)
    sel = Selection(names=("layers.0.norm2",))
    fast = PollPolicy(0.001, jitter=0.0)
    with Subscriber(url, threads=2, select=sel) as sub:
        mine = sub.pull(2)
        list(sub.follow(mine, poll=fast, cache=CachePolicy(str(path)), stop=_stopped()))
    st = WorkerCache(path).load()
    assert st is not None and st.spare and st.selection is not None
    key = next(iter(st.spare))
    bad = {k: v.copy() for k, v in st.spare.items()}
    bad[key][0] ^= 1  # a bit of another member, outside the selection
    WorkerCache(path).save(st.tensors, url=st.url, version=st.version, manifest=st.manifest, lineage=st.lineage,
                           selection=st.selection, spare=bad)
    with Subscriber(url, threads=2, select=sel) as sub, caplog.at_level("WARNING"):
        fresh = sub.allocate()
        (rec,) = list(sub.follow(fresh, poll=fast, cache=CachePolicy(str(path)), max_versions=1))
        assert rec.bytes_fetched > 0 and "does not match its digest" in caplog.text
        assert_bits_equal(fresh, expected_rows(states[1], sel))


def test_exclude_leaves_tensors_out(tmp_path) -> None:
    url = str(tmp_path / "store")
    states = _publish_chain(url, n=2, grouped=True)
    sel = Selection(exclude=("layers.1.*", "nothing.*"))  # an exclusion may match nothing
    with Subscriber(url, threads=2, select=sel) as sub:
        mine = sub.pull(2)
    assert set(mine) == {n for n in states[1] if not n.startswith("layers.1.")}
    assert_bits_equal(mine, expected_rows(states[1], sel))
    with pytest.raises(SelectionError, match="lists of patterns"):
        Selection(exclude="layers.1.*")


def test_a_full_staged_load_of_members_among_zeros(tmp_path) -> None:
    """Staged from nothing, an edge chunk whose new bits are mostly zeros (a freshly initialised
    LoRA B beside the selected member) is patched sparsely: its spare bits start from zeros."""
    url = str(tmp_path / "store")
    g = torch.Generator().manual_seed(5)
    state = {"a.lora_A": torch.randn(40, generator=g).bfloat16(),
             **{f"a.lora_B{i}": torch.zeros(40, dtype=torch.bfloat16) for i in range(6)}}
    with Publisher(url, writer_policy=WriterPolicy(threads=2),
                   layout_policy=LayoutPolicy(group_small_tensors=True)) as pub:
        pub.publish(state)
        state2 = snapshot(state)
        state2["a.lora_B3"][7] = 1.0
        pub.publish(state2)
    sel = Selection(names=("a.lora_A",))
    with Subscriber(url, threads=2, select=sel) as sub:
        fresh = sub.allocate(1)
        staged = sub.stage(fresh, 1)
        assert staged.patches and all(p.positions is not None for p in staged.patches)
        sub.swap(staged, fresh)
        assert_bits_equal(fresh, expected_rows(state, sel))
        sub.pull_into(fresh, 2)  # the spare bits are version 1's: the delta applies and verifies
        assert_bits_equal(fresh, expected_rows(state2, sel))
