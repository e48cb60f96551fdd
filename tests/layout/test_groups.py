"""Tensor groups (design 007, SPEC §2 *Groups*, §3.2 schema 4).

- the publisher's grouping policy (per dtype, size threshold, no group of one, layout order);
- schema-4 layouts round-trip, and hostile group records are refused with typed errors;
- publish → pull / pull_into / stage+swap / squash / GC stay bit-exact with groups, on a real
  S3 endpoint (moto), with groups cut into several chunks that split members;
- a group chunk's digest is XXH3-128 of its members' bytes concatenated;
- a modified member is detected before anything is applied; a publisher resumes a grouped chain;
- with grouping off, the writer still writes schema 3.
"""

from __future__ import annotations

import json
import pickle
from typing import Any

import numpy as np
import pytest
import torch
import xxhash
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from deltastore import Publisher, Subscriber
from deltastore._util import kernels
from deltastore.errors import (
    CorruptObjectError,
    InvalidStateDictError,
    LayoutMismatchError,
    TargetModifiedError,
    UnsupportedSchemaError,
)
from deltastore.format.history import History
from deltastore.format.keys import object_key, sha256_hex
from deltastore.format.models import GroupMember, Layout, layout_of
from deltastore.format.objects import decode_object, encode_object
from deltastore.layout.groups import (
    GROUP_MEMBER_MAX_BYTES,
    GROUP_TARGET_BYTES,
    copy_members,
    group_specs,
    member_pointers,
    member_starts,
)
from deltastore.layout.tensors import (
    TensorDict,
    TensorSpec,
    bits,
    check_layout,
    member_specs,
    validate_state_dict,
)
from deltastore.lifecycle.compact import compact
from deltastore.lifecycle.gc import collect
from deltastore.read.stage import make_patch, split_patch
from deltastore.storage import open_store
from deltastore.write.policy import GROUP_AUTO_MIN_TENSORS, AnchorPolicy, LayoutPolicy, WriterPolicy
from testkit.tensors import SMALL_CHUNK_BYTES, TinyTrainer, assert_bits_equal, snapshot

# --- the grouping policy ---------------------------------------------------------------------


def _spec(name: str, dtype: str, shape: tuple[int, ...]) -> TensorSpec:
    return TensorSpec(name, dtype, shape, max(1, shape[0]) if shape else 1)


def test_grouping_is_per_dtype_in_order_and_leaves_big_and_lonely_tensors_alone() -> None:
    specs: dict[str, TensorSpec] = {}
    for i in range(300):  # 300 × 8 KiB of bf16, interleaved with fp32 norms and a big matrix
        specs[f"l{i}.w"] = _spec(f"l{i}.w", "bfloat16", (4096,))
        specs[f"l{i}.n"] = _spec(f"l{i}.n", "float32", (64,))
        if i == 150:
            specs["big"] = _spec("big", "bfloat16", (GROUP_MEMBER_MAX_BYTES // 2 + 1,))
    specs["lonely"] = _spec("lonely", "int64", (3,))
    specs["empty"] = _spec("empty", "bfloat16", (0,))
    units = group_specs(specs)
    rows = {n: s for n, s in units.items() if s.members}
    assert {"big", "lonely", "empty"} <= set(units) and not any(units[n].members for n in ("big", "lonely", "empty"))
    # every small tensor is in exactly one group, of its own dtype, members in state-dict order
    seen = [m.name for s in rows.values() for m in s.members]
    assert sorted(seen) == sorted(n for n in specs if n not in ("big", "lonely", "empty"))
    order = list(specs)
    for s in rows.values():
        assert all(m.dtype == s.dtype for m in s.members)
        assert [order.index(m.name) for m in s.members] == sorted(order.index(m.name) for m in s.members)
        assert s.shape == (sum(m.numel for m in s.members),)
        assert [m.offset for m in s.members] == list(np.cumsum([0] + [m.numel for m in s.members])[:-1])
        nbytes = s.nbytes
        assert nbytes <= GROUP_TARGET_BYTES + GROUP_MEMBER_MAX_BYTES
    full = [s for s in rows.values() if s.dtype == "bfloat16"]
    assert all(s.nbytes >= GROUP_TARGET_BYTES for s in full[:-1])  # only the last one is short
    # the user's view: every tensor, none of the rows
    assert set(member_specs(units)) == set(specs)


def test_group_names_never_collide_with_tensor_names() -> None:
    specs = {n: _spec(n, "float16", (8,)) for n in ("#group/0", "a", "b")}
    units = group_specs(specs)
    (row,) = [n for n, s in units.items() if s.members]
    assert row not in specs and row.startswith("##group/")


# --- schema-4 layouts ------------------------------------------------------------------------


def _layout() -> Layout:
    specs = {f"t{i}": _spec(f"t{i}", "bfloat16", (3, 4)) for i in range(5)}
    specs["big"] = _spec("big", "float32", (100_000,))
    return layout_of(group_specs(specs), schema=4)


def _doc(layout: Layout) -> dict[str, Any]:
    return json.loads(zstandard.ZstdDecompressor().decompress(encode_object(layout)))


def _decode(doc: dict[str, Any]) -> Layout:
    data = zstandard.ZstdCompressor(write_content_size=True).compress(json.dumps(doc, sort_keys=True).encode())
    return decode_object(Layout, data, object_key("0" * 32, sha256_hex(data), ".layout.json.zst"))


def test_schema4_layout_round_trips_with_its_members() -> None:
    layout = _layout()
    back = _decode(_doc(layout))
    assert back == layout and back.schema_ == 4
    (row,) = back.members()
    assert back.members()[row] == tuple(GroupMember(f"t{i}", "bfloat16", (3, 4), 12 * i) for i in range(5))
    with pytest.raises(ValueError, match="schema-3 layout cannot hold groups"):
        layout_of(group_specs({f"t{i}": _spec(f"t{i}", "int8", (2,)) for i in range(3)}))


def _mutate(path: tuple[Any, ...], value: Any) -> Any:
    def f(doc: dict[str, Any]) -> dict[str, Any]:
        node = doc
        for p in path[:-1]:
            node = node[p]
        node[path[-1]] = value
        return doc

    return f


HOSTILE = {
    "overlap": (_mutate(("groups", 0, "offset", 2), 20), "starts at element 20, not 24"),
    "gap": (_mutate(("groups", 0, "offset", 1), 13), "starts at element 13, not 12"),
    "negative offset": (_mutate(("groups", 0, "offset", 0), -1), "starts at element -1, not 0"),
    "past the end": (_mutate(("groups", 0, "shape", 4), [3, 5]), "past the group's 60"),
    "short of the end": (_mutate(("groups", 0, "shape", 4), [3, 3]), "members end at element 57"),
    "unit out of range": (_mutate(("groups", 0, "unit"), 7), "names row 7"),
    "two records, one row": (lambda d: {**d, "groups": d["groups"] * 2}, "another group record"),
    "columns differ": (_mutate(("groups", 0, "offset"), [0, 12]), "5 names, 5 shapes and 2 offsets"),
    "empty record": (_mutate(("groups", 0), {"unit": 0, "name": [], "shape": [], "offset": []}), "0 names"),
    "member named like a row": (_mutate(("groups", 0, "name", 1), "big"), "also names another row"),
    "member named twice": (_mutate(("groups", 0, "name", 1), "t0"), "also names another row or member"),
    "2-D group row": (_mutate(("shape", 0), [6, 10]), "a group row is 1-D"),
    "impossible member shape": (_mutate(("groups", 0, "shape", 0), [-12]), "impossible shape"),
    "schema 3 with groups": (_mutate(("schema",), 3), "schema-3 layout has no groups"),
    "schema 4 without groups": (lambda d: {k: v for k, v in d.items() if k != "groups"}, "needs a groups record"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_group_records_are_refused(case: str) -> None:
    mutate, message = HOSTILE[case]
    doc = _doc(_layout())
    assert doc["groups"][0]["unit"] == 0 and doc["shape"][0] == [60]
    with pytest.raises(CorruptObjectError, match=message):
        _decode(mutate(doc))


def test_a_newer_layout_schema_is_unsupported() -> None:
    with pytest.raises(UnsupportedSchemaError, match="upgrade"):
        _decode(_mutate(("schema",), 5)(_doc(_layout())))


# --- patches of a group chunk ----------------------------------------------------------------


@pytest.mark.parametrize("dense", [False, True])
def test_a_group_patch_splits_into_member_patches_that_rebuild_the_chunk(dense: bool) -> None:
    rng = np.random.default_rng(1)
    spec = group_specs({f"m{i}": _spec(f"m{i}", "int16", (n,)) for i, n in enumerate([5, 1, 7, 3, 9])})
    (row,) = spec.values()
    old = rng.integers(0, 2**16, row.numel, dtype=np.uint16)
    new = old.copy()
    where = rng.choice(row.numel, size=row.numel, replace=False) if dense else np.array([4, 5, 9, 18])
    new[where] ^= 1
    a, b = 3, 20  # a chunk that cuts the first and last members it touches
    patch = make_patch(row.name, 0, (a, b), old[a:b], new[a:b])
    assert patch is not None and (patch.positions is None) == dense
    members = {m.name: old[m.offset:m.offset + m.numel].copy() for m in row.members}
    for p in split_patch(patch, row):
        raw = members[p.name][p.span[0]:p.span[1]]
        if p.positions is None:
            assert np.array_equal(raw, p.expected_old)
            raw[...] = p.values
        else:
            assert np.array_equal(raw[p.positions], p.expected_old)
            raw[p.positions] = p.values
    got = np.concatenate([members[m.name] for m in row.members])
    want = old.copy()
    want[a:b] = new[a:b]
    assert np.array_equal(got, want)


# --- end to end, on S3 ------------------------------------------------------------------------


def _chunk_digests(url: str, storage_options: Any, version: int) -> tuple[Any, Layout]:
    store = open_store(url, storage_options=storage_options)
    h = History(store)
    head = h.read_head()[0]
    _, m = h.find(version, head)
    return m, h.layout(m.layout)


def test_grouped_store_is_bit_exact_over_s3_through_pull_pull_into_stage_squash_and_gc(moto_s3_url: Any) -> None:
    t = moto_s3_url
    opts = t.storage_options
    trainer = TinyTrainer(4)
    states: dict[int, dict[str, torch.Tensor]] = {}
    with Publisher(t.url, storage_options=opts, writer_policy=WriterPolicy(threads=2),
                   anchor_policy=AnchorPolicy(every=5),
                   layout_policy=LayoutPolicy(chunk_bytes=SMALL_CHUNK_BYTES, group_small_tensors=True)) as pub:
        state = trainer.export()
        for _ in range(8):
            states[pub.publish(state).version] = snapshot(state)
            state = trainer.step()

    # The format: schema 4, one group per dtype, split into several chunks; digests cover
    # the members' bytes concatenated (SPEC §2).
    m1, layout = _chunk_digests(t.url, opts, 1)
    assert m1.schema_ == 4 and layout.schema_ == 4 and layout.groups
    units = {e.name: e for e in m1.tensors}
    # SMALL_CHUNK_BYTES cuts the bf16 group, and members, across chunks
    assert max(len(units[layout.name[g.unit]].chunks) for g in layout.groups) > 2
    for g in layout.groups:
        row = layout.name[g.unit]
        members = layout.members()[row]
        concat = np.concatenate([bits(states[1][mm.name]).ravel() for mm in members])
        entry = units[row]
        for c in entry.chunks:
            a, b = c.index * entry.chunk_rows, min((c.index + 1) * entry.chunk_rows, concat.size)
            assert c.digest == xxhash.xxh3_128_hexdigest(concat[a:b].tobytes())
    assert m1.stats.tensors_total == len(states[1])

    with Subscriber(t.url, storage_options=opts, threads=2) as sub:
        for v in states:
            assert_bits_equal(sub.pull(v), states[v], f"pull v{v}")
        assert set(sub.layout()) == set(states[1]) and any(s.members for s in sub.units().values())
    with Subscriber(t.url, storage_options=opts, threads=2) as sub:
        target = sub.pull(1)
        sub.pull_into(target, 3)
        assert_bits_equal(target, states[3], "pull_into 3")
        staged = sub.stage(target, 6)
        assert staged is not None and staged.patches and all(p.name in states[6] for p in staged.patches)
        sub.swap(staged, target)
        assert_bits_equal(target, states[6], "stage+swap 6")
        sub.pull_into(target)
        assert_bits_equal(target, states[8], "pull_into head")

    # A squash 2 → 8 over group rows, then a worker at 2 catches up through it.
    (sq,) = compact(t.url, bases=[2], storage_options=opts, register=True).squashes
    with Subscriber(t.url, storage_options=opts, threads=2) as sub:
        target = sub.pull(2)
        before = sub.bytes_fetched
        sub.pull_into(target)
        assert sub.bytes_fetched - before == sq.bytes
        assert_bits_equal(target, states[8], "through the squash")

    # GC keeps what versions ≥ the floor need: they still pull bit-exactly; older ones are gone.
    report = collect(t.url, storage_options=opts, keep_last=2, grace_s=0, unsafe_grace_ok=True)
    assert report.floor_after == 6 and report.deleted_objects > 0
    with Subscriber(t.url, storage_options=opts, threads=2) as sub:
        for v in (6, 7, 8):
            assert_bits_equal(sub.pull(v), states[v], f"after GC v{v}")


def test_a_modified_member_is_refused_before_anything_is_applied(tmp_path: Any) -> None:
    url = str(tmp_path / "s")
    trainer = TinyTrainer(5)
    with Publisher(url, writer_policy=WriterPolicy(threads=2), layout_policy=LayoutPolicy(group_small_tensors=True)) as pub:
        v1 = snapshot(trainer.export())
        pub.publish(v1)
        with Subscriber(url, threads=2) as sub:
            target = sub.pull()
            pub.publish(trainer.step())
            name = "extra.f16"  # a member of a group
            assert any(m.name == name for s in sub.units().values() for m in s.members)
            target[name].view(-1)[3] += 1
            edited = snapshot(target)
            with pytest.raises(TargetModifiedError, match="group"):
                sub.pull_into(target)
            assert_bits_equal(target, edited, "nothing applied")
            with pytest.raises(TargetModifiedError):
                sub.stage(target)


def test_a_restarted_publisher_continues_a_grouped_chain_with_deltas(tmp_path: Any) -> None:
    url = str(tmp_path / "s")
    trainer = TinyTrainer(6)
    states = {}
    with Publisher(url, writer_policy=WriterPolicy(threads=2),
                   layout_policy=LayoutPolicy(group_small_tensors=True, chunk_bytes=SMALL_CHUNK_BYTES)) as pub:
        states[pub.publish(trainer.export()).version] = snapshot(trainer.export())
    for _ in range(2):  # the option is what a resumed publisher does not need: the chain decides
        with Publisher(url, writer_policy=WriterPolicy(threads=2),
                       layout_policy=LayoutPolicy(chunk_bytes=SMALL_CHUNK_BYTES)) as pub:
            s = trainer.step()
            info = pub.publish(s)
            states[info.version] = snapshot(s)
            assert info.kind == "delta"
    with Subscriber(url, threads=2) as sub:
        target = sub.pull(1)
        for v in (2, 3):
            sub.pull_into(target, v)
            assert_bits_equal(target, states[v])


def test_a_chain_grouped_at_the_old_target_keeps_its_groups(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Stores written while groups closed at 1 MiB (by earlier writers) are continued as they
    are: a new publisher resumes their layout with deltas, and only a fresh store gets the
    current target's (fewer, larger) groups."""
    gen = torch.Generator().manual_seed(3)
    state = {f"norm.{i}": torch.randn(32768, generator=gen).to(torch.bfloat16) for i in range(40)}  # 64 KiB each
    old_url, new_url = str(tmp_path / "old"), str(tmp_path / "new")
    with monkeypatch.context() as mp:
        mp.setattr("deltastore.layout.groups.GROUP_TARGET_BYTES", 1024 * 1024)
        with Publisher(old_url, writer_policy=WriterPolicy(threads=2),
                       layout_policy=LayoutPolicy(group_small_tensors=True)) as pub:
            pub.publish(state)
    assert GROUP_TARGET_BYTES >= 2560 * 1024  # the 2.5 MiB of members fit one group now
    s2 = {n: t.clone() for n, t in state.items()}
    for t in list(s2.values())[::7]:
        t.view(torch.int16)[::100] += 1
    with Publisher(old_url, writer_policy=WriterPolicy(threads=2), layout_policy=LayoutPolicy(group_small_tensors=True)) as pub:
        assert pub.publish(s2).kind == "delta"
    with Publisher(new_url, writer_policy=WriterPolicy(threads=2), layout_policy=LayoutPolicy(group_small_tensors=True)) as pub:
        pub.publish(state)
    m1, layout1 = _chunk_digests(old_url, None, 1)
    m2, layout2 = _chunk_digests(old_url, None, 2)
    assert m2.layout == m1.layout and len(layout1.groups or ()) == 3
    _, fresh = _chunk_digests(new_url, None, 1)
    assert len(fresh.groups or ()) == 1
    with Subscriber(old_url, threads=2) as sub:
        target = sub.pull(1)
        sub.pull_into(target, 2)
        assert_bits_equal(target, s2)


@pytest.mark.parametrize("option", [False, "auto"])
def test_without_the_option_the_writer_writes_schema_3(tmp_path: Any, option: Any) -> None:
    """False never groups; "auto" (the default) leaves a layout with few small tensors alone."""
    url = str(tmp_path / "s")
    with Publisher(url, writer_policy=WriterPolicy(threads=2), layout_policy=LayoutPolicy(group_small_tensors=option)) as pub:
        pub.publish(TinyTrainer(7).export())
    m, layout = _chunk_digests(url, None, 1)
    assert m.schema_ == 3 and layout.schema_ == 3 and layout.groups is None
    assert "groups" not in _doc(layout)


@pytest.mark.parametrize("n", [GROUP_AUTO_MIN_TENSORS - 1, GROUP_AUTO_MIN_TENSORS])
def test_auto_grouping_starts_at_its_tensor_count(tmp_path: Any, n: int) -> None:
    """The default groups a layout once it has GROUP_AUTO_MIN_TENSORS small tensors, and the
    grouped store pulls back bit-exact."""
    url = str(tmp_path / "s")
    gen = torch.Generator().manual_seed(n)
    state = {f"norm.{i}": torch.randn(64, generator=gen).to(torch.bfloat16) for i in range(n)}
    state["big"] = torch.randn(512, 1024, generator=gen).to(torch.bfloat16)  # 1 MiB: never grouped
    with Publisher(url, writer_policy=WriterPolicy(threads=2)) as pub:
        pub.publish(state)
    m, layout = _chunk_digests(url, None, 1)
    grouped = n >= GROUP_AUTO_MIN_TENSORS
    assert (m.schema_, layout.schema_) == ((4, 4) if grouped else (3, 3))
    assert bool(layout.groups) == grouped
    got = Subscriber(url).pull()
    assert got.keys() == state.keys()
    assert all(torch.equal(got[k].view(torch.int16), v.view(torch.int16)) for k, v in state.items())


def test_pull_allocates_a_group_in_one_buffer_and_pull_into_also_works_on_separate_tensors(tmp_path: Any) -> None:
    """pull() gives a group's members as views of one buffer (updated in place as one span);
    a target of separately allocated tensors (a model's own parameters) is updated through
    gather/scatter; both end bit-exact."""
    url = str(tmp_path / "s")
    trainer = TinyTrainer(8)
    states = {}
    with Publisher(url, writer_policy=WriterPolicy(threads=2),
                   layout_policy=LayoutPolicy(group_small_tensors=True, chunk_bytes=SMALL_CHUNK_BYTES)) as pub:
        for _ in range(3):
            s = trainer.export() if not states else trainer.step()
            states[pub.publish(s).version] = snapshot(s)
    with Subscriber(url, threads=2) as sub:
        shared = sub.pull(1)
        rows = [s for s in sub.units().values() if s.members]
        for row in rows:
            ptrs = [shared[m.name].data_ptr() for m in row.members]
            assert ptrs == [ptrs[0] + m.offset * shared[row.members[0].name].element_size() for m in row.members]
        separate = snapshot(shared)  # each its own storage
        assert sub.allocate(1).keys() == shared.keys()
    for target in (shared, separate):
        with Subscriber(url, threads=2) as sub:
            sub.pull_into(target, 1)  # adopt: the target holds version 1 (checked against its digests)
            sub.pull_into(target, 3)
            assert_bits_equal(target, states[3])


def test_closed_subscribers_leave_no_layout_behind(tmp_path: Any) -> None:
    """The layout caches (checked layouts, layout tables, member offsets, group indexes) keep
    an entry only while its layout lives: subscribers opened, pulled from and closed one after
    another leave none of their group members behind, however many (each would leave a
    layout's thousands of objects for the collector to walk)."""
    import gc

    from deltastore.format import checks
    from deltastore.layout import groups, tensors

    url = str(tmp_path / "s")
    gen = torch.Generator().manual_seed(3)
    state = {f"norm.{i}": torch.randn(64, generator=gen).to(torch.bfloat16) for i in range(GROUP_AUTO_MIN_TENSORS)}
    state2 = {k: v.clone() for k, v in state.items()}
    state2["norm.3"][5] += 1
    with Publisher(url, writer_policy=WriterPolicy(threads=2)) as pub:
        pub.publish(state)
        pub.publish(state2)

    def live_members() -> int:  # members are untracked (native): counted through their rows' specs and layouts
        gc.collect()
        return sum(len(o.members) if type(o) is tensors.TensorSpec else len(o.members()) if type(o) is Layout else 0
                   for o in gc.get_objects())

    def caches() -> tuple[int, ...]:
        return (len(checks._CHECKED_LAYOUTS), len(tensors._tables), len(groups._starts_cache), len(groups._group_index))

    base, base_caches = live_members(), caches()
    for _ in range(2):  # two in a row show that none is left behind
        with Subscriber(url, threads=2) as sub:
            target = snapshot(sub.pull(1))  # version 1, in separate tensors
            sub.pull_into(target, 2)
            assert_bits_equal(target, state2)
            assert live_members() > base  # this subscriber's layout is alive, and cached
            assert all(n > b for n, b in zip(caches(), base_caches)), (caches(), base_caches)
        del sub, target
        assert live_members() == base and caches() == base_caches


def test_a_layouts_group_members_are_out_of_the_collectors_sight(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A parsed schema-4 layout's members are untracked by the cyclic collector when the
    native extension is there (design 006), tracked without it, and read alike;
    a member's fields hold strings, ints and a tuple of ints, so it can close no cycle."""
    import gc
    import typing

    url = str(tmp_path / "s")
    gen = torch.Generator().manual_seed(4)
    state = {f"norm.{i}": torch.randn(3, 8, generator=gen).to(torch.bfloat16) for i in range(GROUP_AUTO_MIN_TENSORS)}
    with Publisher(url, writer_policy=WriterPolicy(threads=2)) as pub:
        pub.publish(state)
    store = open_store(url)
    head = History(store).read_head()[0]
    m = History(store).manifest(head.manifest)
    assert m.layout is not None
    data = store.get(m.layout.key)

    def members(layout: Layout) -> list[GroupMember]:
        return [g for ms in layout.members().values() for g in ms]

    native = decode_object(Layout, data, m.layout.key)
    monkeypatch.setattr(kernels, "untrack", None)
    fallback = decode_object(Layout, data, m.layout.key)
    assert members(native) == members(fallback) and len(members(native)) == GROUP_AUTO_MIN_TENSORS
    assert all(gc.is_tracked(g) for g in members(fallback))
    assert not any(gc.is_tracked(g) for g in members(native)) or kernels.NATIVE is False
    for name, tp in typing.get_type_hints(GroupMember).items():
        assert tp in (str, int, tuple[int, ...]), f"GroupMember.{name}: {tp!r}"
    with Subscriber(url) as sub:
        assert_bits_equal(sub.pull(), state)


def test_tied_small_tensors_stay_ungrouped_and_update_once(tmp_path: Any) -> None:
    url = str(tmp_path / "s")
    g = torch.Generator().manual_seed(0)
    norm = torch.randn(32, generator=g).to(torch.bfloat16)
    state = {f"n{i}": torch.randn(32, generator=g).to(torch.bfloat16) for i in range(6)}
    state["tied.a"] = norm
    state["tied.b"] = norm  # the same tensor under two names
    with Publisher(url, writer_policy=WriterPolicy(threads=2), layout_policy=LayoutPolicy(group_small_tensors=True)) as pub:
        pub.publish(state)
        with Subscriber(url, threads=2) as sub:
            target = sub.pull()
            units = sub.units()
            assert {"tied.a", "tied.b"} <= set(units) and not units["tied.a"].members
            assert any(s.members for s in units.values())
            target["tied.b"] = target["tied.a"]  # tied in the target too
            norm2 = norm.clone()
            norm2[3] = 1.0
            state2 = {**state, "tied.a": norm2, "tied.b": norm2}
            state2["n2"] = state["n2"].clone()
            state2["n2"][0] = -2.0
            pub.publish(state2)
            sub.pull_into(target)
            assert_bits_equal(target, state2)


# --- member tables: one native gather/scatter per group chunk, numpy fallback identical ---------



def _group_of(counts: list[int], width: int) -> tuple[Any, list[torch.Tensor]]:
    dtype = {1: "uint8", 2: "bfloat16", 4: "float32", 8: "int64"}[width]
    tdt = {1: torch.uint8, 2: torch.bfloat16, 4: torch.float32, 8: torch.int64}[width]
    members, off = [], 0
    for i, c in enumerate(counts):
        members.append(GroupMember(f"m{i}", dtype, (c,), off))
        off += c
    spec = TensorSpec("#group/0", dtype, (off,), max(1, off), tuple(members))
    g = torch.Generator().manual_seed(sum(counts) + width)
    ts = [torch.randint(0, 256, (c * width,), dtype=torch.uint8, generator=g).view(tdt) for c in counts]
    return spec, ts


def _both(fn: Any, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any]:
    """``fn()`` with the native kernels, then with the numpy fallback."""
    native = fn()
    with monkeypatch.context() as m:
        m.setattr(kernels, "gather_members", None)
        m.setattr(kernels, "scatter_members", None)
        fallback = fn()
    return native, fallback


@pytest.mark.skipif(not kernels.NATIVE, reason="native kernels not built")
@settings(deadline=None)
@given(counts=st.lists(st.integers(1, 40), min_size=1, max_size=12), width=st.sampled_from([1, 2, 4, 8]),
       cut=st.tuples(st.floats(0, 1), st.floats(0, 1)))
def test_copy_members_native_equals_fallback(counts: list[int], width: int, cut: tuple[float, float]) -> None:
    """Gather and scatter of any element range (cutting members anywhere) copy the same bytes
    natively and in numpy, and the same bytes as concatenating the members."""
    mp = pytest.MonkeyPatch()
    spec, ts = _group_of(counts, width)
    n = spec.numel
    a, b = sorted(int(x * n) for x in cut)
    starts = member_starts(spec)
    ptrs = member_pointers(spec, ts)
    assert ptrs is not None
    whole = np.concatenate([t.view(torch.uint8).numpy() for t in ts]).view(np.dtype(f"u{width}"))

    def gather() -> np.ndarray:
        out = np.empty(b - a, dtype=f"u{width}")
        copy_members(out, ptrs, starts, a, to_row=True)
        return out

    native, fallback = _both(gather, mp)
    assert native.tobytes() == fallback.tobytes() == whole[a:b].tobytes()

    src = np.arange(b - a, dtype=f"u{width}") ^ np.array(0x5A, dtype=f"u{width}")
    expected = whole.copy()
    expected[a:b] = src
    results = []
    for kernels_on in (True, False):
        for t, part in zip(ts, np.split(whole, np.cumsum(counts)[:-1])):
            t.view(torch.uint8).numpy()[:] = part.view(np.uint8)  # back to the original bytes
        with mp.context() as m:
            if not kernels_on:
                m.setattr(kernels, "scatter_members", None)
            copy_members(src, ptrs, starts, a, to_row=False)
        results.append(np.concatenate([t.view(torch.uint8).numpy() for t in ts]).tobytes())
    assert results[0] == results[1] == expected.tobytes()


@pytest.mark.parametrize("native", [True, False])
def test_copy_members_refuses_bad_tables(native: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A range outside the group, or (natively) a table that does not start at 0, decreases,
    or does not match the pointers, is a ValueError before any byte is copied."""
    if native and kernels.gather_members is None:  # not built, or built before groups.c
        pytest.skip("native kernels not built")
    if not native:
        monkeypatch.setattr(kernels, "gather_members", None)
    spec, ts = _group_of([3, 5, 2], 2)
    starts, ptrs = member_starts(spec), member_pointers(spec, ts)
    assert ptrs is not None
    for a, size in ((-1, 2), (9, 2), (0, 11)):
        with pytest.raises(ValueError):
            copy_members(np.empty(size, np.uint16), ptrs, starts, a, to_row=True)
    if native:
        for bad in (np.array([1, 3, 8, 10]), np.array([0, 5, 3, 10]), np.array([0, 3, 8])):
            with pytest.raises(ValueError):
                copy_members(np.empty(2, np.uint16), ptrs, bad.astype(np.int64), 0, to_row=True)
        read_only = np.zeros(2, np.uint16)
        read_only.setflags(write=False)
        with pytest.raises(ValueError):
            copy_members(read_only, ptrs, starts, 0, to_row=True)


def test_member_pointers_need_contiguous_cpu_members() -> None:
    spec, ts = _group_of([4, 4], 4)
    assert member_pointers(spec, ts) is not None
    ts[1] = torch.zeros(8, dtype=torch.float32)[::2]  # right shape, not contiguous
    assert member_pointers(spec, ts) is None


def test_pull_into_separate_member_tensors_scatters_natively() -> None:
    """A target whose members are separate tensors (a model's own parameters, not one buffer)
    is updated through the member table, bit-exact, and a modified member is still refused."""
    state = {f"n{i}": (torch.randn(300 + i) * 0.02).to(torch.bfloat16) for i in range(40)}
    url = "memory://groups-separate"
    with Publisher(url, layout_policy=LayoutPolicy(group_small_tensors=True)) as pub:
        pub.publish(state)
        with Subscriber(url) as sub:
            target = {n: t.clone() for n, t in sub.pull().items()}  # separate storages
            for step in range(2):
                new = {n: t.clone() for n, t in state.items()}
                for t in new.values():
                    t.view(torch.int16)[step::7] += 1
                pub.publish(new)
                assert sub.pull_into(target) is not None
                assert all(torch.equal(target[n].view(torch.int16), new[n].view(torch.int16)) for n in new)
            pub.publish({n: t + 1 for n, t in new.items()})
            target["n3"].view(torch.int16)[0] += 1
            with pytest.raises(TargetModifiedError):
                sub.pull_into(target)


# --- the one-pass checks (tensors.TensorScan) are redone on every call -----------------------
# torch has no metadata version counter: a member swapped, resized, transposed or moved to new
# memory in place (the same tensor object) since the last call must still be seen.


def _square_members(n: int = 60) -> dict[str, torch.Tensor]:
    return {f"m{i}": (torch.randn(8, 8) * 0.02).to(torch.bfloat16) for i in range(n)}


def _bumped(state: dict[str, torch.Tensor], k: int) -> dict[str, torch.Tensor]:
    out = {n: t.clone() for n, t in state.items()}
    for t in out.values():
        t.view(torch.int16).view(-1)[k::5] += 1
    return out


@pytest.mark.parametrize("change", ["transposed", "resized", "dtype", "replaced", "removed", "added"])
def test_pull_into_sees_a_member_changed_since_its_last_call(change: str) -> None:
    state = _square_members()
    url = f"memory://groups-changed-{change}"
    with Publisher(url, layout_policy=LayoutPolicy(group_small_tensors=True)) as pub:
        pub.publish(state)
        with Subscriber(url) as sub:
            target = sub.pull()
            assert any(s.members for s in sub.units().values())
            pub.publish(_bumped(state, 0))
            sub.pull_into(target)  # a first call: anything it could keep is now warm
            pub.publish(_bumped(state, 1))
            name = "m17"
            if change == "transposed":  # same object, same shape, no longer contiguous
                target[name].t_()
                expected: type[Exception] = InvalidStateDictError
            elif change == "resized":  # same object, another shape over the same memory
                target[name].resize_(4, 8)
                expected = LayoutMismatchError
            elif change == "dtype":
                target[name].data = target[name].data.float()
                expected = LayoutMismatchError
            elif change == "replaced":  # another tensor under the name
                target[name] = torch.zeros(8, 4, dtype=torch.bfloat16)
                expected = LayoutMismatchError
            elif change == "removed":
                del target[name]
                expected = LayoutMismatchError
            else:
                target["stranger"] = torch.zeros(3)
                expected = LayoutMismatchError
            before = snapshot(target)
            with pytest.raises(expected, match=name if change != "added" else "stranger"):
                sub.pull_into(target)
            assert_bits_equal(target, before, "nothing applied")


def test_pull_into_writes_a_member_moved_to_new_memory_since_its_last_call() -> None:
    """``set_`` gives a member (the same object) new memory holding the same bits: the next
    pull_into must update the new memory, not the address it had before."""
    state = _square_members()
    url = "memory://groups-moved"
    with Publisher(url, layout_policy=LayoutPolicy(group_small_tensors=True)) as pub:
        pub.publish(state)
        with Subscriber(url) as sub:
            target = sub.pull()
            pub.publish(_bumped(state, 0))
            sub.pull_into(target)
            old = target["m5"]
            old_memory = old.clone()
            old_view = old.view(-1)  # the group buffer's memory, as it was
            old.set_(old.clone())
            assert old.data_ptr() != old_view.data_ptr()
            new = _bumped(state, 2)
            pub.publish(new)
            sub.pull_into(target)
            assert_bits_equal(target, new)
            assert torch.equal(old_view.view(torch.int16), old_memory.view(-1).view(torch.int16)), "old memory untouched"


@pytest.mark.parametrize("change", ["transposed", "resized", "moved"])
def test_publish_sees_a_member_changed_since_its_last_call(change: str) -> None:
    state = _square_members()
    url = f"memory://groups-pub-changed-{change}"
    with Publisher(url, layout_policy=LayoutPolicy(group_small_tensors=True)) as pub:
        pub.publish(state)
        live = {n: t.clone() for n, t in state.items()}  # one dict, published again and again
        pub.publish(live)
        for t in live.values():
            t.view(torch.int16).view(-1)[::3] += 1
        pub.publish(live)
        name = "m40"
        if change == "transposed":
            live[name].t_()
            with pytest.raises(InvalidStateDictError, match=name):
                pub.publish(live)
        elif change == "resized":
            live[name].resize_(2, 8)
            with pytest.raises(LayoutMismatchError, match=name):
                pub.publish(live)
        else:  # new memory with new bits: the delta must read them there
            moved = live[name].clone()
            moved.view(torch.int16).view(-1)[:10] += 3
            live[name].set_(moved)
            v = pub.publish(live).version
            with Subscriber(url) as sub:
                assert_bits_equal(sub.pull(v), live)


@pytest.mark.parametrize("mutate", ["setitem", "delitem", "update", "ior", "pop", "popitem", "setdefault", "clear"])
def test_a_validated_state_dict_drops_its_scan_when_changed(mutate: str) -> None:
    """validate_state_dict's TensorDict carries its scan for the same call's checks; any change
    to the dict must drop it, so check_layout sees the tensors the dict now holds."""
    state = {f"t{i}": torch.zeros(4, 4) for i in range(5)}
    specs = {n: TensorSpec(n, "float32", (4, 4), 4) for n in state}
    d = validate_state_dict(state)
    assert isinstance(d, TensorDict)
    check_layout(specs, d, against="v1")  # uses (and keeps) the scan
    other = torch.zeros(2, 8)
    if mutate == "setitem":
        d["t2"] = other
    elif mutate == "delitem":
        del d["t2"]
    elif mutate == "update":
        d.update({"t2": other})
    elif mutate == "ior":
        d |= {"t2": other}
    elif mutate == "pop":
        d.pop("t2")
    elif mutate == "popitem":
        d.popitem()
    elif mutate == "setdefault":
        d.setdefault("t9", other)
    else:
        d.clear()
    with pytest.raises(LayoutMismatchError):
        check_layout(specs, d, against="v1")
    assert type(pickle.loads(pickle.dumps(d))) is dict


def test_member_tables_agree_with_the_per_group_checks() -> None:
    """groups.member_tables checks every group's members at once; it must find what the
    per-group checks (member_pointers, _span) find, row by row: a row of back-to-back views,
    of separate tensors, of views in the wrong order, with a non-contiguous or a meta member."""
    from deltastore.layout.groups import _span, member_tables
    from deltastore.layout.tensors import check_layout

    state: dict[str, torch.Tensor] = {}
    for row in range(5):
        buf = torch.zeros(6 * 64, dtype=torch.bfloat16)
        for i in range(6):
            j = 5 - i if row == 2 else i  # row 2: the right memory, in the wrong order
            state[f"r{row}.m{i}"] = buf[j * 64:(j + 1) * 64].view(8, 8)
    for i in range(6):
        state[f"r1.m{i}"] = state[f"r1.m{i}"].clone()  # row 1: separate tensors
    state["r3.m4"] = torch.zeros(8, 8, dtype=torch.bfloat16).t().contiguous().t()  # row 3: not contiguous
    state["r4.m0"] = torch.zeros(8, 8, dtype=torch.bfloat16, device="meta")  # row 4: no host memory
    specs = {}
    for r in range(5):
        members = tuple(GroupMember(f"r{r}.m{i}", "bfloat16", (8, 8), i * 64) for i in range(6))
        specs[f"#g{r}"] = TensorSpec(f"#g{r}", "bfloat16", (6 * 64,), 6 * 64, members)
    check_layout(specs, state, against="test")
    found = member_tables(specs, state)
    assert found is not None
    for name, spec in specs.items():
        ts = [state[m.name] for m in spec.members]
        ptrs = member_pointers(spec, ts)
        got = found[name]
        assert (got.ptrs is None) == (ptrs is None), name
        if ptrs is not None:
            assert np.array_equal(got.ptrs, ptrs), name
            assert got.span == (_span(spec, ts, ptrs) is not None), name
    assert [found[f"#g{r}"].span for r in range(5)] == [True, False, False, False, False]
    assert [found[f"#g{r}"].ptrs is not None for r in range(5)] == [True, True, True, False, False]


# --- the one-pass tensor scan (tensors.TensorScan, native scan_tensors) -------------------------


def _scan_zoo() -> list[torch.Tensor]:
    """Tensors of every kind the checks meet: plain, views, a Parameter, 0-d, empty, another
    dtype, not contiguous, on the meta device, sparse."""
    base = torch.arange(64, dtype=torch.float32)
    return [
        torch.zeros(3), base[8:24].view(4, 4), torch.nn.Parameter(torch.ones(2, 3, 5)), torch.tensor(7),
        torch.zeros(0, 4, dtype=torch.int64), torch.zeros(6, dtype=torch.bfloat16),
        torch.zeros(4, 6).t(), torch.zeros(3, device="meta"), torch.zeros(3, 3).to_sparse(),
        torch.zeros(2, 2, dtype=torch.uint8),
    ]


def _scan_fields(sc: Any, shapes: list[tuple[int, ...]]) -> dict[str, Any]:
    from deltastore.layout.tensors import shape_code

    strided = sc.strided.tolist()
    return {
        "dtypes": sc.dtypes, "strided": strided, "cpu": sc.cpu.tolist(), "contiguous": sc.contiguous.tolist(),
        "meta": sc.meta.tolist(), "shapes_equal": sc.shapes_equal(shapes),
        "shapes_equal_code": sc.shapes_equal(shapes, shape_code(shapes)),
    }


@pytest.mark.skipif(kernels.scan_tensors is None, reason="native kernels not built")
@pytest.mark.parametrize("shapes_change", [None, 0, 1, 3, 9])
def test_native_tensor_scan_equals_the_python_scan(shapes_change: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The native one-pass scan reads what the per-attribute Python scan reads, for every kind
    of tensor; and the shape comparison by codes fails wherever one shape differs (in rank or
    in a size), as the tuple comparison does."""
    from deltastore.layout.tensors import TensorScan

    ts = _scan_zoo()
    dense = [t.layout == torch.strided for t in ts]
    shapes = [tuple(t.shape) for t in ts]
    if shapes_change is not None:  # one shape off: another size, or another rank
        sh = shapes[shapes_change]
        shapes[shapes_change] = sh[:-1] + (sh[-1] + 1,) if sh else (1,)
    native = TensorScan(list(ts))
    got = _scan_fields(native, shapes)
    assert native._native is True
    ptrs = native.ptrs.tolist()
    monkeypatch.setattr(kernels, "scan_tensors", None)
    python = TensorScan(list(ts))
    want = _scan_fields(python, shapes)
    assert python._native is False
    assert got == want
    assert want["shapes_equal"] is (shapes_change is None)
    assert [p for p, d in zip(ptrs, dense) if d] == [t.data_ptr() for t, d in zip(ts, dense) if d]


@pytest.mark.skipif(kernels.scan_tensors is None, reason="native kernels not built")
def test_native_tensor_scan_declines_what_it_cannot_read_as_getattr_would() -> None:
    """The kernel reads only exact torch.Tensor / Parameter objects (a subclass may override
    an attribute in Python), says None when a getter raises, and refuses descriptors that are
    not torch's getters; the scan then reads in Python and finds the same values."""
    from deltastore.layout.tensors import _SCAN_ARGS, TensorScan

    assert _SCAN_ARGS is not None
    types, strided, descrs = _SCAN_ARGS

    class Odd(torch.Tensor):
        @property
        def dtype(self) -> torch.dtype:  # type: ignore[override]
            return torch.float64

    odd = torch.zeros(3).as_subclass(Odd)
    assert kernels.scan_tensors([torch.zeros(2), odd], types, strided, descrs) is None
    sc = TensorScan([torch.zeros(2), odd])
    assert sc.dtypes == [torch.float32, torch.float64] and sc._native is False
    assert kernels.scan_tensors([torch.zeros(2), "not a tensor"], types, strided, descrs) is None
    with pytest.warns(UserWarning):
        nested = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])
    assert kernels.scan_tensors([nested], types, strided, descrs) is None  # its shape raises
    with pytest.raises(TypeError):
        kernels.scan_tensors([torch.zeros(2)], types, strided, (len,) * 7)
    with pytest.raises(TypeError):
        kernels.scan_tensors([torch.zeros(2)], (dict,), strided, descrs)
    with pytest.raises(ValueError):
        kernels.scan_tensors([torch.zeros(2)], types, strided, descrs[:6])
    assert kernels.scan_tensors([], types, strided, descrs)[1] == b""


@pytest.mark.parametrize("native", [True, False])
def test_validate_and_check_layout_name_the_bad_tensor_with_either_scan(native: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every typed error of the per-member checks, with the native scan and without it."""
    if not native:
        monkeypatch.setattr(kernels, "scan_tensors", None)
    good = {f"m{i}": torch.zeros(4, 4, dtype=torch.bfloat16) for i in range(50)}
    specs = {n: TensorSpec(n, "bfloat16", (4, 4), 4) for n in good}
    check_layout(specs, validate_state_dict(good), against="v1")
    cases: list[tuple[str, Any, type[Exception]]] = [
        ("not contiguous", torch.zeros(4, 4, dtype=torch.bfloat16).t(), InvalidStateDictError),
        ("sparse", torch.zeros(4, 4, dtype=torch.bfloat16).to_sparse(), InvalidStateDictError),
        ("meta", torch.zeros(4, 4, dtype=torch.bfloat16, device="meta"), InvalidStateDictError),
        ("complex", torch.zeros(4, 4, dtype=torch.complex128), InvalidStateDictError),
        ("not a tensor", np.zeros((4, 4)), InvalidStateDictError),
        ("shape", torch.zeros(16, dtype=torch.bfloat16), LayoutMismatchError),
        ("rank", torch.zeros(4, 4, 1, dtype=torch.bfloat16), LayoutMismatchError),
        ("dtype", torch.zeros(4, 4, dtype=torch.float16), LayoutMismatchError),
    ]
    for what, value, error in cases:
        state = dict(good)
        state["m31"] = value
        with pytest.raises(error, match="m31"):
            check_layout(specs, validate_state_dict(state), against="v1")
        assert what


def test_bits_views_the_tensor_memory_and_keeps_it_alive() -> None:
    """tensors.bits: the address view of a plain tensor has the bits torch's numpy() view has,
    writes through to the tensor, and keeps the tensor alive; other tensors go through torch."""
    import gc

    cases = [torch.arange(10, dtype=torch.bfloat16), torch.nn.Parameter(torch.arange(6.0).view(2, 3)),
             torch.tensor(3, dtype=torch.int8), torch.tensor([True, False]), torch.arange(12.0).view(3, 4).t(),
             torch.zeros(0, dtype=torch.float64)]
    for t in cases:
        w = t.element_size()
        want = t.detach().reshape(-1).contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[w])
        got = bits(t)
        assert got.dtype.itemsize == w and got.tobytes() == want.numpy().tobytes()
    t = torch.zeros(5, dtype=torch.float32)
    view = bits(t)
    view[2] = 0x3F800000  # 1.0
    assert t[2].item() == 1.0
    del t
    gc.collect()
    assert view[2] == 0x3F800000 and view.base is not None


def test_bits_view_outlives_a_set_of_its_tensor() -> None:
    """The address view holds the tensor's storage, not the tensor: ``t.set_()`` (another
    storage for t) leaves the view on the old memory, as torch's own numpy() view is."""
    import gc

    t = torch.arange(1 << 16, dtype=torch.int16)
    view = bits(t)
    t.set_(torch.zeros(4, dtype=torch.int16))
    gc.collect()
    junk = [torch.full((1 << 16,), 7, dtype=torch.int16) for _ in range(8)]  # reuse freed memory
    assert view[:3].tolist() == [0, 1, 2] and int(view[-1]) == (1 << 16) - 1
    assert junk
