"""Durable writes and renames: a file or directory renamed into place survives a crash only once its
parent directory's entry is on disk, which takes an fsync of the directory itself."""

from __future__ import annotations

import os


def fsync_path(path: str | os.PathLike[str], *, strict: bool = True) -> None:
    """fsync the file or directory ``path`` (a directory: its entries, e.g. a rename into it).
    ``strict=False`` ignores an OSError (a filesystem that cannot open or sync directories: the
    rename stands, undurably).

    Raises:
        OSError: ``strict`` and the directory could not be opened or synced.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        if strict:
            raise
        return
    try:
        os.fsync(fd)
    except OSError:
        if strict:
            raise
    finally:
        os.close(fd)
