from __future__ import annotations

import os
from pathlib import Path

import pytest

from deltastore.errors import BucketNotFoundError, PreconditionFailedError
from deltastore.storage import IfMatch, LocalStore, open_store
from deltastore.storage._keys import content_etag
from deltastore.storage._local import local_etag
from testkit.contract import StoreContract
from testkit.tensors import mp_context

#: Processes and increments per process in the cross-process CAS test.
PROCESSES = 4
INCREMENTS = 25


class TestLocalStore(StoreContract):
    @pytest.fixture
    def store(self, tmp_path: Path) -> LocalStore:
        return LocalStore(tmp_path / "root")


def test_open_store_creates_missing_root(tmp_path: Path) -> None:
    root = tmp_path / "a" / "b"
    store = open_store(str(root))
    assert isinstance(store, LocalStore) and root.is_dir()
    store.put("k", b"v")
    assert (root / "k").read_bytes() == b"v"
    assert open_store(root.as_uri()).get("k") == b"v"


def test_missing_root_without_create(tmp_path: Path) -> None:
    with pytest.raises(BucketNotFoundError, match="does not exist"):
        LocalStore(tmp_path / "missing", create=False)


def test_temp_files_and_locks_are_not_listed(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    meta = store.put("dir/HEAD", b"1")
    store.put("dir/HEAD", b"2", mode=IfMatch(meta.etag))  # creates the lock file
    (tmp_path / "dir" / ".deltastore-tmp-crashed").write_bytes(b"partial")  # a crashed writer
    assert (tmp_path / ".deltastore-locks").is_dir()
    assert [m.key for m in store.list()] == ["dir/HEAD"]


def test_etag_of_file_written_by_hand_is_its_content_hash(tmp_path: Path) -> None:
    (tmp_path / "manual").write_bytes(b"by hand")
    store = LocalStore(tmp_path)
    assert store.head("manual").etag == local_etag(b"by hand")
    store.put("manual", b"next", mode=IfMatch(local_etag(b"by hand")))
    assert store.get("manual") == b"next"
    assert store.head("manual").etag == store.put("other", b"next").etag == local_etag(b"next")


def test_an_object_of_an_older_release_is_compared_by_its_content(tmp_path: Path) -> None:
    """Releases before XXH3 ETags kept an MD5 under another attribute: this release ignores it,
    hashes the content, and its compare-and-swap on such an object works."""
    path = tmp_path / "HEAD"
    path.write_bytes(b"old head")
    try:
        os.setxattr(path, "user.deltastore.md5", content_etag(b"old head").encode())
    except OSError:
        pytest.skip("no user xattrs on this filesystem")
    store = LocalStore(tmp_path)
    etag = store.head("HEAD").etag
    assert etag == local_etag(b"old head") != content_etag(b"old head")
    with pytest.raises(PreconditionFailedError):
        store.put("HEAD", b"lost", mode=IfMatch(content_etag(b"old head")))
    store.put("HEAD", b"new head", mode=IfMatch(etag))
    assert store.get("HEAD") == b"new head"


def test_key_and_directory_collision_is_one_line_error(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    store.put("a/b", b"1")
    with pytest.raises(Exception) as info:
        store.put("a", b"2", mode="create")
    assert "a" in str(info.value) and "\n" not in str(info.value)


def _increment(root: str, n: int) -> int:
    store = LocalStore(root)
    conflicts = 0
    done = 0
    while done < n:
        got = store.get_with_meta("counter")
        try:
            store.put("counter", str(int(got.data) + 1).encode(), mode=IfMatch(got.meta.etag))
            done += 1
        except PreconditionFailedError:
            conflicts += 1
    return conflicts


def test_cas_is_atomic_across_processes(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    store.put("counter", b"0", mode="create")
    # Not fork: a test worker runs server threads, and a child forked while one of them holds a
    # lock waits for it forever.
    with mp_context().Pool(PROCESSES) as pool:
        pool.starmap(_increment, [(str(tmp_path), INCREMENTS)] * PROCESSES)
    # A lost update (two processes both "winning" against one ETag) would leave it lower.
    assert int(store.get("counter")) == PROCESSES * INCREMENTS


# --- streamed create-only writes (begin_put) -------------------------------------


def _temp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name.startswith(".deltastore-tmp-")]


def test_a_streamed_write_is_invisible_until_committed_then_reads_as_a_put(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "root")
    pieces = [os.urandom(n) for n in (1, 0, 4096, 70_000)]
    w = store.begin_put("objects/a/")
    for p in pieces:
        w.write(p)
        assert list(store.list("")) == []  # nothing under any key yet
    meta = w.commit("x.pack")
    data = b"".join(pieces)
    assert meta.key == "objects/a/x.pack" and meta.size == len(data)
    assert store.get("objects/a/x.pack") == data
    # the same ETag and metadata a whole put of these bytes gets
    assert meta.etag == local_etag(data) == store.head("objects/a/x.pack").etag
    assert store.put("objects/a/y.pack", data, mode="create").etag == meta.etag
    assert _temp_files(tmp_path / "root") == []
    with pytest.raises(ValueError, match="committed or aborted"):
        w.write(b"more")


def test_a_streamed_write_is_create_only_and_an_abort_leaves_nothing(tmp_path: Path) -> None:
    from deltastore.errors import AlreadyExistsError

    store = LocalStore(tmp_path / "root")
    store.put("objects/a/x.pack", b"first", mode="create")
    w = store.begin_put("objects/a/")
    w.write(b"second")
    with pytest.raises(AlreadyExistsError, match="already exists"):
        w.commit("x.pack")
    assert store.get("objects/a/x.pack") == b"first"  # never replaced
    assert _temp_files(tmp_path / "root") == []
    w = store.begin_put("objects/b/")
    w.write(b"dropped")
    assert len(_temp_files(tmp_path / "root")) == 1
    w.abort()
    w.abort()  # idempotent
    assert _temp_files(tmp_path / "root") == [] and [m.key for m in store.list("")] == ["objects/a/x.pack"]
    empty = store.begin_put("objects/c/")
    assert empty.commit("e").size == 0 and store.get("objects/c/e") == b""


def test_a_streamed_write_refuses_names_outside_its_directory(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "root")
    with pytest.raises(ValueError, match="ending in '/'"):
        store.begin_put("objects/a")
    w = store.begin_put("objects/a/")
    w.write(b"x")
    with pytest.raises(ValueError, match="no '/'"):
        w.commit("../b")
    assert _temp_files(tmp_path / "root") == []  # a refused commit drops the write
    with pytest.raises(ValueError, match="committed or aborted"):
        w.commit("b")


def test_stores_that_take_whole_objects_only_do_not_stream() -> None:
    assert open_store("memory://no-stream").begin_put("objects/a/") is None
