"""LocalStore: several processes (here threads) opening one new store at once all succeed."""

import threading
from pathlib import Path

import pytest

from deltastore.errors import BucketNotFoundError
from deltastore.storage import LocalStore


def test_concurrent_opens_of_a_new_root_all_succeed(tmp_path: Path) -> None:
    root = tmp_path / "a" / "b" / "store"
    n = 16
    barrier = threading.Barrier(n)
    errors: list[BaseException] = []

    def open_it() -> None:
        barrier.wait()
        try:
            LocalStore(root)
        except BaseException as e:  # noqa: BLE001 - collected and asserted below
            errors.append(e)

    for _ in range(20):
        threads = [threading.Thread(target=open_it) for _ in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        root.rmdir()


def test_a_file_where_the_root_should_be_is_refused(tmp_path: Path) -> None:
    (tmp_path / "store").write_text("not a directory")
    with pytest.raises(BucketNotFoundError, match="not a directory"):
        LocalStore(tmp_path / "store")
