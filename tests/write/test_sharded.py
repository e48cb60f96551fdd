"""Sharded publishing (SPEC §8, design 010): ranks of a gloo process group each publish their
rows; an unsharded Subscriber reads every version whole, bit-exactly.

Each test starts real processes (spawn) with torch.distributed over 127.0.0.1; the ranks write
their outcome to files the test reads. Kept small: the CI machine may have two cores.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from deltastore import Subscriber
from deltastore.storage import open_store
from testkit.grid_ranks import GRID_CHUNK_COLS, GRID_CHUNK_ROWS, GRID_COLS, GRID_ROWS, grid_model
from testkit.ranks import full_model, head_version, run_ranks

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed unavailable")


# --- the rank side ----------------------------------------------------------------------------


# --- publish_async (design 010 D10) -----------------------------------------------------------


# --- column grids in sharded layouts (design 011 D11) ------------------------------------------



def _ok(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert "error" not in r and "hung" not in r and "exitcode" not in r, r


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for k, t in want.items():
        assert got[k].dtype == t.dtype and got[k].shape == t.shape, k
        assert torch.equal(got[k].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), k


# --- tests ------------------------------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
def test_ranks_publish_rows_and_whole_tensors(tmp_path: Path, world: int) -> None:
    url = f"file://{tmp_path}/store"
    results = run_ranks(world, url, "versions", tmp_path)
    _ok(results)
    kinds = [k for _, k in results[0]["infos"]]
    assert kinds == ["anchor", "delta", "delta", "anchor"]  # anchor_every=3
    assert all(r["infos"] == results[0]["infos"] for r in results)
    with Subscriber(url) as sub:
        for v in range(1, 5):
            _assert_equal(sub.pull(v), full_model(v))
            m = sub._reader.history.manifest(sub.info(v).manifest)
            assert len(m.parts) == world and not any(p is None for p in m.parts)
        # an unsharded subscriber fast-forwards in place across sharded deltas and an anchor
        target = sub.pull(1)
        sub.pull_into(target, 3)
        _assert_equal(target, full_model(3))
        sub.pull_into(target)
        _assert_equal(target, full_model(4))
        assert sub.info(4).metadata == {"v": 4} and sub.info(4).step == 4
    layout_parts = open_store(url).list("objects/")
    assert sum(1 for o in layout_parts if o.key.endswith(".part.json.zst")) == 4 * world


@pytest.mark.distributed
def test_two_ranks_over_s3(tmp_path: Path, moto_s3_url: Any) -> None:
    """The same protocol against a real S3 server (moto): conditional writes, HTTP."""
    target = moto_s3_url
    _ok(run_ranks(2, target.url, "versions", tmp_path, target.storage_options))
    with Subscriber(target.url, storage_options=target.storage_options) as sub:
        target_state = sub.pull(1)
        sub.pull_into(target_state, 2)
        staged = sub.stage(target_state, 4)  # what follow() does: prepare while serving, then swap
        assert staged is not None
        sub.swap(staged, target_state)
        _assert_equal(target_state, full_model(4))


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_lean_collectives_carry_what_torchs_do(tmp_path: Path, world: int) -> None:
    """Design 010 D9: on gloo, the publisher's all_gather, broadcast and gather carry every
    object as torch's object collectives do, small or larger than INLINE_BYTES; a small one is
    one gloo operation (all_gather, broadcast) or two (gather: lengths, then bytes)."""
    from deltastore.write.sharded import INLINE_BYTES

    results = run_ranks(world, f"file://{tmp_path}/store", "collectives", tmp_path)
    _ok(results)
    for r in results:
        assert r["lean"] == r["torch"]
        assert len(r["lean"]) == 5 * world
        for (gathered, broadcast, to_root), (expected, root) in zip(r["lean"], r["expected"]):
            assert gathered == expected  # each rank's object, in rank order
            assert broadcast == root
            assert to_root == (expected if r["rank"] == 0 else None)
        for size, ops in r["ops"]:
            one_round = size < INLINE_BYTES - 100  # the pickle adds a few dozen bytes
            assert ops == ((1, 1, 2) if one_round else (2, 2, 2)), (size, ops)


@pytest.mark.distributed
def test_disagreeing_ranks_commit_nothing(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/store"
    results = run_ranks(2, url, "disagree", tmp_path)
    _ok(results)
    for r in results:
        assert "disagree on the layout" in r["shape"]
        assert "claimed twice" in r["overlap"]
        assert "held by no rank" in r["gap"]
        assert "different steps" in r["step"]
        assert r["ok"] == 1  # nothing was committed before
        assert "different versions [1, 7]" in r["version"]
    assert head_version(url) == 1  # the version disagreement committed nothing either
    with Subscriber(url) as sub:
        assert sub.pull(1)["x"].tolist() == [[0, 0], [0, 0], [1, 1], [1, 1]]


@pytest.mark.distributed
def test_failed_part_commits_nothing_and_retry_commits(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/store"
    results = run_ranks(2, url, "fail_then_retry", tmp_path)
    _ok(results)
    # rank 1's own error; rank 0 re-raises it by class (a deltastore error), naming the tensor
    assert all(r["invalid"][0] == "InvalidStateDictError" and "'a'" in r["invalid"][1] for r in results), results
    assert all(r["head_after_invalid"] == 1 for r in results)
    assert results[0]["failure"] == "PartFailedError" and results[1]["failure"] == "OSError"
    assert all(r["head_after_failure"] == 1 for r in results)
    # rank 1 dropped its reference (advanced to the failed rows): every rank resumes from version 1
    # (design 010 D11), a delta, bit-exact below only if no rank kept a stale reference
    assert results[0]["retry"] == (2, "delta")
    with Subscriber(url) as sub:
        _assert_equal(sub.pull(2), full_model(2))


@pytest.mark.distributed
def test_steady_versions_skip_the_plan_round_and_read_nothing(tmp_path: Path) -> None:
    """Design 010 D6: a version on the last one's layout and base is planned by rank 0 before
    step 1, so its only broadcast is the outcome; rank 0 reads nothing back from the store. A
    rank's anchor request that the pre-plan did not foresee falls back to step 2's round."""
    url = f"file://{tmp_path}/store"
    results = run_ranks(2, url, "steady", tmp_path)
    _ok(results)
    assert results[0]["infos"] == results[1]["infos"] == [(1, "anchor"), (2, "delta"), (3, "anchor"), (4, "delta"), (5, "delta")]
    for r in results:
        assert r["broadcasts"] == [2, 1, 2, 1, 1], r
    assert results[0]["reads"][1] == results[0]["reads"][3] == results[0]["reads"][4] == 0, results[0]["reads"]
    with Subscriber(url) as sub:
        for v in range(1, 6):
            _assert_equal(sub.pull(v), full_model(v))


@pytest.mark.distributed
def test_steady_claims_go_as_a_digest(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/store"
    results = run_ranks(2, url, "claims", tmp_path)
    _ok(results)
    for r in results:
        assert r["infos"] == [(1, "anchor"), (2, "delta"), (3, "delta"), (4, "delta"), (5, "delta"), (6, "anchor"),
                              (7, "delta")], r
        assert r["rounds"] == [1, 1, 1, 2, 1, 1, 1], r  # version 4: rank 1 planned nothing, so a second round
    # a rank's share is made anew for a new layout object only: on rank 1 at version 4 (it
    # planned again) and on both at version 6 (another row split)
    assert results[0]["share_kept"] == [False, True, True, True, True, False, True]
    assert results[1]["share_kept"] == [False, True, True, False, True, False, True]
    assert results[0]["sent"] == ["claims", "digest", "digest", "digest", "digest", "claims", "digest"]
    assert results[1]["sent"] == ["claims", "digest", "digest", "claims", "digest", "claims", "digest"]
    with Subscriber(url) as sub:
        for v in range(1, 8):
            _assert_equal(sub.pull(v), full_model(v))


@pytest.mark.distributed
def test_failed_part_manifest_upload_or_preplan_commits_nothing_and_retry_commits(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/store"
    results = run_ranks(2, url, "part_upload_fails", tmp_path)
    _ok(results)
    assert [r["failure"] for r in results] == ["StorageError", "StorageError"]
    assert all(r["head_after_failure"] == 1 for r in results)
    assert all(r["retry"] == (2, "delta") and r["next"] == "delta" for r in results), results  # resumed (D11)
    assert [r["preplan_failure"] for r in results] == ["StorageError", "StorageError"]
    assert all(r["head_after_preplan_failure"] == 3 for r in results)
    # a failed plan drops the references; version 4 is an anchor by the cost policy (two deltas of
    # 207 bytes outweigh this tiny model's 373-byte anchor), so nothing is read back for it
    assert all(r["after"] == (4, "anchor") for r in results), results
    assert [r["join_failure"] for r in results] == ["CorruptObjectError", "CorruptObjectError"]
    assert all(r["head_after_join_failure"] == 4 for r in results)
    assert all(r["after_join"][:2] == (5, "delta") for r in results), results
    # the refused attempt's manifest was stored while the join ran: an unreferenced object
    manifests_5 = [o.key for o in open_store(url).list("manifests/") if o.key.startswith("manifests/000000000005-")]
    assert len(manifests_5) == 2 and results[0]["after_join"][2] in manifests_5, manifests_5
    with Subscriber(url) as sub:
        for v in (2, 3, 4, 5):
            _assert_equal(sub.pull(v), full_model(v))


@pytest.mark.distributed
def test_killed_rank_leaves_nothing_visible_and_a_new_group_commits(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/store"
    results = run_ranks(2, url, "killed", tmp_path)
    assert results[1].get("exitcode") == -signal.SIGKILL
    assert "was lost" in results[0]["failure"], results[0]
    assert head_version(url) == 1  # nothing visible
    store = open_store(url)
    orphans = [o.key for o in store.list("objects/") if o.key.endswith(".pack")]
    assert orphans  # rank 1's packs of the lost attempt lie unreferenced (part manifests go up only at the commit)
    # the restarted job (new processes, no reference copies) resumes from version 1 (design 010
    # D11): version 2 is a delta
    _ok(run_ranks(2, url, "versions", tmp_path))
    with Subscriber(url) as sub:
        assert sub.info(2).kind == "delta"
        _assert_equal(sub.pull(), full_model(4))  # "versions" published its versions 1-4 as 2-5


@pytest.mark.distributed
def test_fsdp2_module_publishes_local_shards(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/store"
    results = run_ranks(2, url, "fsdp", tmp_path)
    _ok(results)
    with Subscriber(url) as sub:
        for version, full in results[0]["fulls"]:
            _assert_equal(sub.pull(version), full)
        assert sub.info(2).kind == "delta"
    assert [r["resumed"] for r in results] == ["delta", "delta"]


@pytest.mark.distributed
def test_compaction_and_gc_of_sharded_versions(tmp_path: Path) -> None:
    """Compaction and GC read sharded versions through the history module: a squash over
    sharded deltas is written and applies; GC keeps the kept versions' part manifests."""
    from deltastore.lifecycle.compact import compact
    from deltastore.lifecycle.gc import collect

    url = f"file://{tmp_path}/store"
    _ok(run_ranks(2, url, "versions", tmp_path))
    report = compact(url, bases=[1], to=3)
    assert [(s.from_, s.to) for s in report.squashes] == [(1, 3)]
    with Subscriber(url) as sub:
        target = sub.pull(1)
        sub.pull_into(target, 3)
        _assert_equal(target, full_model(3))
    before = {o.key for o in open_store(url).list("objects/") if o.key.endswith(".part.json.zst")}
    collect(url, keep_last=1, grace_s=0, unsafe_grace_ok=True)
    after = {o.key for o in open_store(url).list("objects/") if o.key.endswith(".part.json.zst")}
    assert after < before and len(after) == 2  # version 4's two parts are kept, the others collected
    with Subscriber(url) as sub:
        _assert_equal(sub.pull(4), full_model(4))


@pytest.mark.distributed
def test_signed_sharded_versions_verify_and_a_publisher_without_the_key_is_refused(tmp_path: Path) -> None:
    from deltastore.errors import SignatureError, UnsignedVersionError
    from deltastore.format.signing import generate_key_files

    _, public = generate_key_files(tmp_path / "key.pem")
    url = f"file://{tmp_path}/store"
    results = run_ranks(2, url, "signed", tmp_path)
    _ok(results)
    _assert_equal(results[0]["signed"], full_model(2))
    for r in results:
        assert r["refused"] is not None and url in r["refused"] and "allow_unsigned" in r["refused"], r
        assert r["unchanged"] and r["unsigned"] == 3, r
    with Subscriber(url, trusted_keys=[public]) as sub:
        with pytest.raises(UnsignedVersionError, match="publisher without the signing key"):
            sub.pull()
    _, other = generate_key_files(tmp_path / "other.pem")
    with Subscriber(url, trusted_keys=[other]) as sub, pytest.raises(SignatureError):
        sub.pull(2)


# --- part manifests, checked as a reader checks them (pure: no processes) ---------------------

ATTEMPT = "ab" * 16
LINEAGE = "cd" * 16


def _layout(parts: int = 2) -> Any:
    from deltastore.format.models import Layout

    return Layout(schema=3, name=("a", "b"), dtype=("float32", "float32"), shape=((4, 2), (3,)), chunk_rows=(2, 3),
                  chunk_cols=(0, 0), pieces=((2,), ()), piece_parts=((0, 1), (1,)), parts=parts)


def _anchor_part(part: int, of: Any, tensors: list[tuple[str, list[tuple[int, Any]]]],
                 **override: Any) -> tuple[Any, bytes]:
    """Part ``part`` of an anchor (version 1) of layout ``of``: per ``(name, [(index, values)])``
    one float32 tensor entry listing those chunks with full segments of ``values``; ``override``
    replaces fields of the part (its ``layout`` included)."""
    from deltastore import codec
    from deltastore.format.keys import object_key, part_key, sha256_hex
    from deltastore.format.models import BlobRef, ChunkEntry, ObjectRef, PartRef, SegmentRef, Stats, TensorEntry
    from deltastore.format.parts import encode_part
    from deltastore.layout.tensors import state_digest

    pack = bytearray()
    entries = []
    for name, chunks in tensors:
        listed = []
        for index, values in chunks:
            seg = codec.encode_full(values)
            ref = SegmentRef(blob=0, offset=len(pack), length=len(seg.data), sha256=sha256_hex(seg.data),
                             codec=seg.codec, n_changed=seg.n_changed)
            pack += seg.data
            listed.append(ChunkEntry(index=index, digest=state_digest(values), full=ref))
        i = of.name.index(name)
        entries.append(TensorEntry(name=name, dtype="float32", shape=of.shape[i], chunk_rows=of.chunk_rows[i],
                                   chunks=tuple(listed)))
    digest = sha256_hex(bytes(pack))
    blob = BlobRef(key=object_key(ATTEMPT, digest, ".pack"), size=len(pack), sha256=digest, role="f")
    kw = {"schema": 3, "version": 1, "part": part, "commit_id": ATTEMPT, "lineage": LINEAGE,
          "layout_ref": ObjectRef(key=object_key(ATTEMPT, "e" * 64, ".layout.json.zst"), sha256="e" * 64),
          "layout": of, "tensors": entries, "blobs": (blob,), "stats": Stats()}
    kw.update(override)
    data = encode_part(**kw)
    d = sha256_hex(data)
    return PartRef(part=part, key=part_key(ATTEMPT, part, d), sha256=d, writer=f"w{part}", bytes=len(pack)), data


def _part(part: int, chunks: list[tuple[str, int]], **override: Any) -> tuple[Any, bytes]:
    """Part ``part`` of an anchor (version 1) listing ``chunks`` with full segments."""
    import numpy as np

    return _anchor_part(part, _layout(), [(name, [(index, np.arange(4 if name == "a" else 3, dtype=np.uint32) + index)])
                                          for name, index in chunks], **override)


def _header(refs: list[Any]) -> Any:
    from deltastore.format.keys import object_key
    from deltastore.format.models import Manifest, ObjectRef

    return Manifest(schema=3, version=1, parent=None, parent_manifest=None, kind="anchor", anchor=1, created="t",
                    writer="w0", epoch=1, commit_id=ATTEMPT, lineage=LINEAGE, parts=tuple(refs), chain_start=1,
                    layout=ObjectRef(key=object_key(ATTEMPT, "e" * 64, ".layout.json.zst"), sha256="e" * 64),
                    max_attempt_s=60)


def _two_parts_joined() -> tuple[dict[str, bytes], Any]:
    """Part 0 with a[0], part 1 with a[1] and b[0]: their bytes by key, and join_parts' result."""
    from deltastore.format.manifest import join_parts

    p0, p1 = _part(0, [("a", 0)]), _part(1, [("a", 1), ("b", 0)])
    parts = {p0[0].key: p0[1], p1[0].key: p1[1]}
    return parts, join_parts(_header([p0[0], p1[0]]), _layout(), parts)


def test_parts_join_into_one_manifest_and_round_trip() -> None:
    from deltastore.format.keys import manifest_key, sha256_hex
    from deltastore.format.manifest import encode_manifest, parse_manifest

    parts, m = _two_parts_joined()
    assert [t.name for t in m.tensors] == ["a", "b"] and [c.index for c in m.tensors[0].chunks] == [0, 1]
    assert len(m.blobs) == 2 and m.tensors[0].chunks[1].full.blob == 1  # part 1's pack follows part 0's
    assert set(m.references()) >= set(parts)  # GC keeps the part manifests
    data = encode_manifest(m, _layout(), parts)
    key = manifest_key(1, sha256_hex(data))
    back = parse_manifest(data, key, layout=_layout(), parts=lambda ref: parts[ref.key])
    assert back == m
    with pytest.raises(ValueError, match="part manifests"):
        parse_manifest(data, key, layout=_layout())


def test_joined_version_encodes_without_a_second_join(tmp_path: Path) -> None:
    """encode_joined (rank 0's commit, design 010 D7) stores the same bytes as encode_manifest,
    signed or not, and refuses a manifest that is not the one join_parts returned."""
    from deltastore.format.keys import manifest_key, sha256_hex
    from deltastore.format.manifest import encode_joined, encode_manifest, parse_manifest
    from deltastore.format.signing import generate_key_files, load_private_key, sign_manifest

    parts, joined = _two_parts_joined()
    private, _ = generate_key_files(tmp_path / "k.pem")
    signed = sign_manifest(joined, load_private_key(private))
    for m in (joined, signed):
        data = encode_joined(m, _layout(), joined)
        assert data == encode_manifest(m, _layout(), parts)
        back = parse_manifest(data, manifest_key(1, sha256_hex(data)), layout=_layout(), parts=lambda ref: parts[ref.key])
        assert back == m  # with its signature: what a subscriber verifies
    with pytest.raises(ValueError, match="not the version join_parts returned"):
        encode_joined(joined.model_copy(update={"step": 7}), _layout(), joined)
    with pytest.raises(ValueError, match="not the version join_parts returned"):
        encode_joined(joined.model_copy(update={"tensors": joined.tensors[:1]}), _layout(), joined)
    with pytest.raises(ValueError, match="not the version join_parts returned"):  # a signature of another form
        encode_joined(signed.model_copy(update={"step": 7}), _layout(), joined)
    with pytest.raises(ValueError, match="sharded"):
        encode_joined(joined.model_copy(update={"parts": ()}), _layout(), joined)


@pytest.mark.parametrize(
    ("case", "match"),
    [
        ("version", "version is .2., but the version says .1."),
        ("commit_id", "commit_id is"),
        ("lineage", "lineage is"),
        ("layout", "layout is"),
        ("foreign_piece", "lies in a piece of part 1"),
        ("twice", "not sorted|listed by two parts|piece of part"),
        ("digest", "SHA-256"),
        ("missing_part", "0…1"),
    ],
)
def test_bad_parts_are_refused(case: str, match: str) -> None:
    from deltastore.errors import CorruptObjectError, IntegrityError
    from deltastore.format.keys import object_key
    from deltastore.format.manifest import join_parts
    from deltastore.format.models import ObjectRef

    unsharded = _layout().model_copy(update={"parts": 0, "pieces": (None, None), "piece_parts": (None, None)})
    good0, good1 = _part(0, [("a", 0)]), _part(1, [("a", 1), ("b", 0)])
    p0, p1 = good0, good1
    if case == "version":
        p1 = _part(1, [("a", 1), ("b", 0)], version=2)
    elif case == "commit_id":
        p1 = _part(1, [("a", 1), ("b", 0)], commit_id="ef" * 16)
    elif case == "lineage":
        p1 = _part(1, [("a", 1), ("b", 0)], lineage="01" * 16)
    elif case == "layout":
        p1 = _part(1, [("a", 1), ("b", 0)], layout_ref=ObjectRef(key=object_key(ATTEMPT, "f" * 64, ".layout.json.zst"),
                                                                sha256="f" * 64))
    elif case == "foreign_piece":  # part 0 writes a chunk of part 1's rows (the writer's check bypassed)
        p0 = _part(0, [("a", 0), ("a", 1)], layout=unsharded)
    elif case == "twice":
        p0 = _part(0, [("a", 0), ("b", 0)], layout=unsharded)
    elif case == "digest":
        p1 = (p1[0], p1[1] + b"x")
    parts = {p0[0].key: p0[1], p1[0].key: p1[1]}
    refs = [p0[0]] if case == "missing_part" else [p0[0], p1[0]]
    with pytest.raises((CorruptObjectError, IntegrityError), match=match):
        join_parts(_header(refs), _layout(), parts)


def test_writer_refuses_a_chunk_of_another_part() -> None:
    with pytest.raises(ValueError, match="another part's piece"):
        _part(0, [("a", 1)])


# --- the golden sharded stores (tests/golden/make_golden.py sharded, sharded-grid) ---------------

GOLDEN = Path(__file__).resolve().parents[1] / "golden"


def test_golden_sharded_store_reads_bit_exact(tmp_path: Path) -> None:
    """Sharded versions written by the first release that wrote them are read bit for bit by
    every later one: three parts, pieces of a row-split tensor, whole and replicated tensors,
    anchors with and without deltas."""
    import shutil

    from safetensors.torch import load_file

    shutil.copytree(GOLDEN / "store-sharded", tmp_path / "store")
    url = f"file://{tmp_path / 'store'}"
    with Subscriber(url) as sub:
        m = sub._reader.history.manifest(sub.info(2).manifest)
        layout = sub._reader.history.layout(m.layout)
        assert layout.parts == 3 and [p.part for p in m.parts] == [0, 1, 2]
        assert layout.pieces[layout.name.index("a")] == (4, 8) and layout.piece_parts[layout.name.index("a")] == (0, 1, 2)
        for v in range(1, 5):
            _assert_equal(sub.pull(v), load_file(str(GOLDEN / "store-sharded-expected" / f"v{v}.safetensors")))
        target = sub.pull(1)
        sub.pull_into(target, 4)
        _assert_equal(target, load_file(str(GOLDEN / "store-sharded-expected" / "v4.safetensors")))
        assert not sub.verify().problems


def test_golden_sharded_grid_store_reads_bit_exact(tmp_path: Path) -> None:
    """Column grids in sharded layouts written by the first release that wrote them (design 011
    D11) are read bit for bit by every later one: whole, by pull_into, and by TP=4 column
    readers that read only their column block of every row block."""
    import shutil

    from safetensors.torch import load_file

    from deltastore.layout.select import Selection

    shutil.copytree(GOLDEN / "store-sharded-grid", tmp_path / "store")
    url = f"file://{tmp_path / 'store'}"
    expected = [load_file(str(GOLDEN / "store-sharded-grid-expected" / f"v{v}.safetensors")) for v in range(1, 5)]
    with Subscriber(url) as sub:
        m = sub._reader.history.manifest(sub.info(2).manifest)
        layout = sub._reader.history.layout(m.layout)
        assert layout.parts == 3 and [p.part for p in m.parts] == [0, 1, 2]
        g, d = layout.name.index("g"), layout.name.index("d")
        assert (layout.chunk_cols[g], layout.chunk_rows[g], layout.pieces[g]) == (2, 2, (4, 8))
        assert (layout.chunk_cols[d], layout.chunk_rows[d], layout.pieces[d]) == (2, 1, (3, 6))
        assert layout.chunk_cols[layout.name.index("b")] == 0
        for v in range(1, 5):
            _assert_equal(sub.pull(v), expected[v - 1])
        target = sub.pull(1)
        sub.pull_into(target, 4)
        _assert_equal(target, expected[3])
        assert not sub.verify().problems
    for rank in range(4):
        with Subscriber(url, select=Selection(names=("g", "d"), shard=(1, rank, 4))) as sub:
            mine = sub.pull(1)
            res = sub._reader.partial.resolved(sub.units())
            assert res.chunks == {("g", i * 4 + rank) for i in range(6)} | {("d", i * 4 + rank) for i in range(9)}
            sub.pull_into(mine, 4)
            for name in ("g", "d"):
                want = expected[3][name][:, 2 * rank:2 * rank + 2].contiguous()
                assert torch.equal(mine[name].reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))
    # compaction squashes sharded grid deltas (the joined tables); GC keeps what reads need
    from deltastore.lifecycle.compact import compact
    from deltastore.lifecycle.gc import collect

    report = compact(url, bases=[1], to=3)
    assert [(s.from_, s.to) for s in report.squashes] == [(1, 3)]
    with Subscriber(url) as sub:
        target = sub.pull(1)
        sub.pull_into(target, 3)
        _assert_equal(target, expected[2])
    collect(url, keep_last=1, grace_s=0, unsafe_grace_ok=True)
    with Subscriber(url) as sub:
        _assert_equal(sub.pull(4), expected[3])


@pytest.mark.distributed
def test_publish_async_pipelines_versions_bit_exact(tmp_path: Path) -> None:
    """publish_async: each version is planned while the one before is still being committed
    (design 010 D10), every rank's Futures agree, and every version reads back bit for bit."""
    url = f"file://{tmp_path}/store"
    results = run_ranks(2, url, "async_versions", tmp_path)
    _ok(results)
    want = [(1, "anchor"), (2, "delta"), (3, "delta"), (4, "delta"), (5, "anchor"), (6, "delta")]  # anchor_every=4
    assert all(r["infos"] == want and r["sync"] == (7, "delta") for r in results), results
    assert all(r["head_after_flush"] == 6 for r in results)
    assert not any(r["first_done_at_once"] for r in results)  # resolved by the next call, not before
    assert all("call flush() first" in r["result_before_flush"] for r in results), results
    # rank 0 planned every version after the first on the one being committed: no plan round
    assert results[0]["counts"] == {"ahead": 5, "planned": 1, "failed": 0}, results[0]["counts"]
    with Subscriber(url) as sub:
        for v in range(1, 8):
            _assert_equal(sub.pull(v), full_model(v))
        assert sub.info(3).metadata == {"v": 3} and sub.info(3).step == 3


@pytest.mark.distributed
def test_publish_async_over_s3(tmp_path: Path, moto_s3_url: Any) -> None:
    """publish_async against a real S3 server (moto over HTTP): the committer's conditional
    writes run beside the next version's uploads."""
    target = moto_s3_url
    results = run_ranks(2, target.url, "async_versions", tmp_path, target.storage_options)
    _ok(results)
    assert all(r["sync"] == (7, "delta") and r["head_after_flush"] == 6 for r in results), results
    with Subscriber(target.url, storage_options=target.storage_options) as sub:
        _assert_equal(sub.pull(6), full_model(6))


@pytest.mark.distributed
def test_publish_async_failure_is_raised_once_and_the_retry_commits(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/store"
    results = run_ranks(2, url, "async_failures", tmp_path)
    _ok(results)
    for r in results:
        assert r["flush"][0] == "StorageError" and "injected" in r["flush"][1], r
        assert r["second_flush"] == "quiet"
        assert r["futures"][0] == (1, "anchor")
        assert r["futures"][1][0] == "StorageError"
        assert r["futures"][2][0] == "PartFailedError" and "planned on version 2" in r["futures"][2][1]
        assert r["head_after_failure"] == 1  # neither 2 nor the version planned on it is visible
        assert r["retry"] == (2, "delta")  # every rank dropped its reference, then resumed from version 1
        assert r["head_after_part"] == 2
        assert r["part_retry"] == (3, "delta")
    assert results[0]["counts"]["ahead"] >= 1  # version 3 was planned on version 2 while it committed
    assert results[0]["next_call"] == "PartFailedError" and results[1]["next_call"] == "OSError"
    assert results[0]["part_future"] == "PartFailedError" and results[1]["part_future"] == "OSError"
    with Subscriber(url) as sub:
        _assert_equal(sub.pull(2), full_model(2))
        _assert_equal(sub.pull(3), full_model(3))
        assert [sub.info(v).kind for v in (1, 2, 3)] == ["anchor", "delta", "delta"]


@pytest.mark.distributed
def test_publish_async_close_without_flush(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/store"
    results = run_ranks(2, url, "async_close", tmp_path)
    _ok(results)
    assert all(r["head"] == 2 for r in results)  # rank 0 committed both before closing
    assert results[0]["f1"] == ("ok", 1) and results[0]["f2"] == ("ok", 2)
    assert results[1]["f2"][0] == "PartFailedError" and "had not reached rank 1" in results[1]["f2"][1]
    with Subscriber(url) as sub:
        _assert_equal(sub.pull(2), full_model(2))


@pytest.mark.distributed
def test_publish_async_killed_rank_commits_only_the_complete_version(tmp_path: Path) -> None:
    """A rank dies while writing its part of version 2 and version 1 is still being committed:
    version 1 (every part in) becomes visible, version 2 never does, rank 0 forgets its
    reference (its rows were advanced to version 2), and a new group commits."""
    url = f"file://{tmp_path}/store"
    results = run_ranks(2, url, "async_killed", tmp_path)
    assert results[1].get("exitcode") == -signal.SIGKILL
    r0 = results[0]
    assert "error" not in r0, r0
    assert "was lost" in r0["failure"] and r0["reference_dropped"] is True, r0
    assert r0["f1"] == 1 and r0["head"] == 1
    _ok(run_ranks(2, url, "versions", tmp_path))
    with Subscriber(url) as sub:
        assert sub.info(2).kind == "delta"  # resumed from version 1 (design 010 D11)
        _assert_equal(sub.pull(1), full_model(1))
        _assert_equal(sub.pull(), full_model(4))


# --- resuming from the store (design 010 D11) -------------------------------------------------


def _packs_by_part(sub: Subscriber, versions: range) -> dict[int, set[str]]:
    """Per part: the packs its chunks' segments lie in, over ``versions``."""
    from deltastore.format.models import piece_part

    out: dict[int, set[str]] = {}
    for v in versions:
        m = sub._reader.history.manifest(sub.info(v).manifest)
        layout = sub._reader.history.layout(m.layout)
        index = {n: i for i, n in enumerate(layout.name)}
        for t in m.tensors:
            for c in t.chunks:
                part = piece_part(layout, index[t.name], c.index)
                for seg in (c.full, c.delta):
                    if seg is not None:
                        out.setdefault(part, set()).add(m.blobs[seg.blob].key)
    return out


@pytest.mark.distributed
def test_restarted_publisher_resumes_from_its_own_rows(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/store"
    results = run_ranks(2, url, "resume", tmp_path)
    _ok(results)
    infos = results[0]["infos"]
    assert all(r["infos"] == infos for r in results)
    kinds = [(v, k) for v, k, _ in infos]
    assert kinds == [(1, "anchor"), (2, "delta"), (3, "delta"), (4, "delta"), (5, "anchor"), (6, "anchor")], kinds
    # the resumed version is delta-sized: as version 2's delta (the same few changes), not an anchor
    assert infos[2][2] <= 1.5 * infos[1][2] and infos[2][2] < infos[0][2] / 1.5, infos
    with Subscriber(url) as sub:
        m3 = sub._reader.history.manifest(sub.info(3).manifest)
        assert m3.delta_base == 2 and m3.kind == "delta"
        for v in range(1, 7):
            _assert_equal(sub.pull(v), full_model(v))
        target = sub.pull(2)
        sub.pull_into(target, 4)  # across the resumed version, in place
        _assert_equal(target, full_model(4))
        packs = _packs_by_part(sub, range(1, 3))
    assert packs[0] and packs[1] and not packs[0] & packs[1]
    for r in results:
        read = {k for k, _ in r["reads"]}
        # each rank read its own part's packs of versions 1-2, and nothing of the other's
        assert read and read <= packs[r["rank"]], (r["rank"], read, packs)
        assert sum(n for _, n in r["reads"]) <= sum(open_store(url).head(k).size for k in packs[r["rank"]])
        assert r["reads_after"] == 0 and r["reads_no_resume"] == 0
    # another world size (one rank now): another layout, so an anchor; then deltas on it
    _ok(run_ranks(1, url, "versions", tmp_path))
    with Subscriber(url) as sub:
        assert [sub.info(v).kind for v in range(7, 11)] == ["anchor", "delta", "delta", "anchor"]  # anchor_every=3
        _assert_equal(sub.pull(7), full_model(1))
        _assert_equal(sub.pull(10), full_model(4))


@pytest.mark.distributed
def test_resume_with_a_corrupt_chunk_on_one_rank_anchors_on_every_rank(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/store"
    _ok(run_ranks(2, url, "versions", tmp_path))  # versions 1-4 (4 an anchor: anchor_every=3)
    with Subscriber(url) as sub:
        own = _packs_by_part(sub, range(4, 5))[1] - _packs_by_part(sub, range(4, 5))[0]
    key = min(own)  # a pack only rank 1's rows lie in
    path = Path(url.removeprefix("file://")) / key
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.chmod(0o644)
    path.write_bytes(bytes(data))
    results = run_ranks(2, url, "resume_bad_rows", tmp_path)
    _ok(results)
    for r in results:
        assert r["infos"] == [(5, "anchor"), (6, "delta")], r
        kind, has_base, dropped, held = r["resumed"]
        assert (kind, has_base, dropped, held) == ("anchor", False, True, None), r  # rank 0 read fine, and dropped it
    assert results[0]["read"] == "ok" and results[1]["read"] == "IntegrityError", results
    with Subscriber(url) as sub:
        _assert_equal(sub.pull(5), full_model(3))
        _assert_equal(sub.pull(6), full_model(4))


def test_resolve_rows_reads_only_the_chunks_of_the_rows() -> None:
    from deltastore.errors import SelectionError
    from deltastore.layout.select import resolve_rows
    from deltastore.layout.tensors import TensorSpec

    units = {"a": TensorSpec("a", "bfloat16", (10, 6), 5), "s": TensorSpec("s", "float32", (), 1)}
    res = resolve_rows(units, {"a": (5, 10), "s": (0, 1)})
    assert res.chunks == {("a", 1), ("s", 0)} and not res.edges
    assert res.shapes == {"a": ("bfloat16", (5, 6)), "s": ("float32", ())}
    assert resolve_rows(units, {"a": (3, 7)}).edges == {("a", 0), ("a", 1)}
    with pytest.raises(SelectionError, match="not rows"):
        resolve_rows(units, {"a": (5, 11)})
    with pytest.raises(SelectionError, match="not a tensor"):
        resolve_rows(units, {"x": (0, 1)})


def _grid_packs_by_part(sub: Subscriber, version: int) -> dict[int, set[str]]:
    """Per part (rank): the packs of ``version`` holding chunks of its rows of ``w`` and of its
    whole tensors, from the grid's arithmetic (row block = index // column blocks), not from
    ``manifest.piece_part``."""
    m = sub._reader.history.manifest(sub.info(version).manifest)
    nc = -(-GRID_COLS // GRID_CHUNK_COLS)
    out: dict[int, set[str]] = {}
    for t in m.tensors:
        for c in t.chunks:
            part = (c.index // nc) * GRID_CHUNK_ROWS >= GRID_ROWS // 2 if t.name == "w" else (1 if t.name == "b" else 0)
            for seg in (c.full, c.delta):
                if seg is not None:
                    out.setdefault(int(part), set()).add(m.blobs[seg.blob].key)
    return out


@pytest.mark.distributed
def test_grid_in_a_sharded_layout_reads_whole_by_columns_and_resumes(tmp_path: Path) -> None:
    """Design 011 D11: two ranks publish a gridded tensor split by rows; an unsharded
    Subscriber reads every version bit-exactly and fast-forwards in place; column-cut partial
    subscribers (world 2 and 4) read only their column blocks; a restarted publisher reads its
    own grid rows back and writes a delta; ranks disagreeing on column_slices commit nothing."""
    from deltastore.layout.select import Selection
    from testkit.partial import needed_bytes

    url = f"file://{tmp_path}/store"
    results = run_ranks(2, url, "grid", tmp_path)
    _ok(results)
    infos = results[0]["infos"]
    assert all(r["infos"] == infos for r in results)
    assert [(v, k) for v, k, _ in infos] == [(1, "anchor"), (2, "delta"), (3, "delta"), (4, "anchor"), (5, "delta"),
                                             (6, "delta")], infos
    assert infos[4][2] < infos[3][2] / 4, infos  # the resumed version is delta-sized
    nc = GRID_COLS // GRID_CHUNK_COLS
    assert [r["first_chunk"] for r in results] == [0, (GRID_ROWS // 2 // GRID_CHUNK_ROWS) * nc]
    for r in results:
        assert r["disagree"] is not None and "column_slices" in r["disagree"], r
        assert r["head"] == 6  # the refused publishers wrote nothing
    with Subscriber(url) as sub:
        m = sub._reader.history.manifest(sub.info(1).manifest)
        layout = sub._reader.history.layout(m.layout)
        i = layout.name.index("w")
        assert (layout.parts, layout.chunk_cols[i], layout.chunk_rows[i]) == (2, GRID_CHUNK_COLS, GRID_CHUNK_ROWS)
        assert layout.chunk_cols[layout.name.index("o")] == 0  # matched, too small for a grid
        _assert_equal(sub.pull(1), grid_model(1))
        whole = sub.bytes_fetched  # of version 1
        for v in range(2, 7):
            _assert_equal(sub.pull(v), grid_model(v))
        target = sub.pull(1)
        sub.pull_into(target, 3)
        _assert_equal(target, grid_model(3))
        sub.pull_into(target)  # across the anchor and the resumed delta
        _assert_equal(target, grid_model(6))
        packs = _grid_packs_by_part(sub, 4)
    assert packs[0] and packs[1] and not packs[0] & packs[1]
    for r in results:  # each rank read back only its own part's packs of version 4 (the anchor)
        read = {k for k, _ in r["reads"]}
        assert read and read <= packs[r["rank"]], (r["rank"], read, packs)
    for world in (2, 4):
        for rank in range(world):
            sel = Selection(names=("w",), shard=(1, rank, world))
            lo, hi = rank * GRID_COLS // world, (rank + 1) * GRID_COLS // world
            with Subscriber(url, select=sel) as sub:
                mine = sub.pull(1)
                res = sub._reader.partial.resolved(sub.units())
                blocks = range(rank * nc // world, (rank + 1) * nc // world)
                assert res.chunks == {("w", i * nc + j) for i in range(GRID_ROWS // GRID_CHUNK_ROWS) for j in blocks}
                assert not res.edges
                assert torch.equal(mine["w"].view(torch.int16), grid_model(1)["w"][:, lo:hi].contiguous().view(torch.int16))
                assert sub.bytes_fetched <= needed_bytes(url, sel, 1)
                assert sub.bytes_fetched < whole / world * 1.2, (sub.bytes_fetched, whole)  # its blocks of w only
                fetched = sub.bytes_fetched
                sub.pull_into(mine, 3)
                assert sub.bytes_fetched - fetched <= needed_bytes(url, sel, 3, since=1)
                fetched = sub.bytes_fetched
                sub.pull_into(mine, 6)  # across the anchor: its deltas or its full segments, of these blocks only
                assert sub.bytes_fetched - fetched <= needed_bytes(url, sel, 6) + needed_bytes(url, sel, 6, since=3)
                assert torch.equal(mine["w"].view(torch.int16), grid_model(6)["w"][:, lo:hi].contiguous().view(torch.int16))


def _grid_layout(parts: int = 2) -> Any:
    """``g`` (4, 6) float32 in chunks of 2 rows × 3 columns (2 row blocks × 2 column blocks),
    rows 0-2 written by part 0 and 2-4 by part 1: chunks 0, 1 are part 0's, 2, 3 part 1's."""
    from deltastore.format.models import Layout

    return Layout(schema=3, name=("g",), dtype=("float32",), shape=((4, 6),), chunk_rows=(2,), chunk_cols=(3,),
                  pieces=((2,),), piece_parts=((0, 1),), parts=parts)


def _grid_part(part: int, chunks: list[int], **override: Any) -> tuple[Any, bytes]:
    """Part ``part`` of an anchor of :func:`_grid_layout` listing ``chunks`` (full segments)."""
    import numpy as np

    # each chunk a block of 2 rows × 3 columns
    return _anchor_part(part, _grid_layout(), [("g", [(i, np.arange(6, dtype=np.uint32) + 10 * i) for i in chunks])],
                        **override)


def test_grid_parts_join_by_row_block_and_a_foreign_block_is_refused() -> None:
    """Design 011 D11: a part lists every column block of its row blocks (chunk (i, j) lies in
    the piece of row block i = index // nc, not of row index·chunk_rows); a part listing a block
    of another part's rows is corrupt, and the writer refuses to write one."""
    from deltastore.errors import CorruptObjectError
    from deltastore.format.manifest import join_parts
    from deltastore.format.models import piece_part

    layout = _grid_layout()
    assert [piece_part(layout, 0, c) for c in range(4)] == [0, 0, 1, 1]
    p0, p1 = _grid_part(0, [0, 1]), _grid_part(1, [2, 3])
    m = join_parts(_header([p0[0], p1[0]]), layout, {p0[0].key: p0[1], p1[0].key: p1[1]})
    assert [c.index for c in m.tensors[0].chunks] == [0, 1, 2, 3]
    unsharded = layout.model_copy(update={"parts": 0, "pieces": (None,), "piece_parts": (None,)})
    for chunks0, chunks1 in (([0], [1, 2, 3]), ([0, 1, 2], [3])):  # a block of the other part's row block
        q0, q1 = _grid_part(0, chunks0, layout=unsharded), _grid_part(1, chunks1, layout=unsharded)
        with pytest.raises(CorruptObjectError, match="lies in a piece of part"):
            join_parts(_header([q0[0], q1[0]]), layout, {q0[0].key: q0[1], q1[0].key: q1[1]})
    with pytest.raises(ValueError, match="another part's piece"):
        _grid_part(1, [1, 2, 3])


def test_plan_layout_grids_matched_tensors_by_their_global_shape() -> None:
    """Design 011 D11: the sharded layout's grid is the unsharded writer's choice from the
    global shape; its chunk rows divide the piece boundaries; a tensor tied on any rank, a
    tensor too small, and unmatched tensors get none."""
    from deltastore.layout.tensors import grid_cols_for
    from deltastore.write.sharded.planning import Claim, Report, plan_layout

    def claims(rank: int, tied: bool = False) -> tuple[Any, ...]:
        start, stop = (0, 96) if rank == 0 else (96, 200)
        return (Claim("w", "bfloat16", (200, 1024), start, stop), Claim("t", "bfloat16", (200, 1024), start, stop, tied),
                Claim("v", "bfloat16", (200, 1024), start, stop), Claim("o", "float32", (8, 16), 0, 8))

    reports = [Report(0, claims(0)), Report(1, claims(1, tied=True))]
    layout = plan_layout(reports, 2, 16 * 1024, ("w", "t", "o"), 4)
    cols = dict(zip(layout.name, layout.chunk_cols))
    rows = dict(zip(layout.name, layout.chunk_rows))
    assert cols == {"w": grid_cols_for((200, 1024), 2, 4, 16 * 1024), "t": 0, "v": 0, "o": 0} and cols["w"] == 256
    assert 96 % rows["w"] == 0 and rows["w"] * 256 * 2 <= 16 * 1024 < 2 * rows["w"] * 256 * 2  # 32 rows: 16 KiB blocks
    assert rows["v"] == 8  # whole rows of 2 KiB, as without a grid
    assert plan_layout(reports, 2, 16 * 1024).chunk_cols == (0, 0, 0, 0)  # no column_slices: no grid
