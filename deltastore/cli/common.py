"""Shared pieces of the command line: exit codes, typed option values, opening a store, errors
as one line with a hint in CLI terms, progress bars.

Nothing here imports torch, boto3 or fsspec at module level: ``deltastore --help`` must stay fast.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from deltastore.errors import (
    AccessDeniedError,
    BucketNotFoundError,
    CommitUnknownError,
    ConflictError,
    FencedError,
    HistoryReplacedError,
    LayoutMismatchError,
    SignatureError,
    StorageError,
    UnsafeStoreError,
    UnsignedVersionError,
    UnsupportedURLError,
    VersionNotFoundError,
)
from deltastore.storage import parse_storage_option

logger = logging.getLogger(__name__)

#: Exit codes (docs/cli.md): the same meaning for every command.
EXIT_OK = 0
#: The operation failed (an error line was printed; a failed verify too).
EXIT_FAILED = 1
#: The command line is wrong: an unknown flag, a bad value, a malformed store URL.
EXIT_USAGE = 2
#: Nothing to do: ``publish`` of a state identical to the head (not republished without --allow-empty).
EXIT_NOTHING_TO_DO = 3
#: Interrupted by Ctrl-C (128 + SIGINT, as shells report it).
EXIT_INTERRUPTED = 130

#: Environment switch for progress bars: ``0`` never, ``1`` even when stderr is not a terminal
#: (CI logs), unset: only on a terminal. ``-q`` always turns them off.
PROGRESS_ENV = "DELTASTORE_PROGRESS"


# --- typed option values (argparse ``type=`` functions) ---------------------------------------


def storage_option(text: str) -> tuple[str, Any]:
    """``--storage-option KEY=VALUE`` (:func:`deltastore.storage.parse_storage_option`)."""
    try:
        return parse_storage_option(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def endpoint_url(text: str) -> str:
    """``--endpoint-url``: an http(s) URL (botocore's own error for ``host:port`` is obscure)."""
    if not re.match(r"^https?://[^/\s]+", text):
        host = text.split("://", 1)[-1]
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an http(s) URL; write --endpoint-url http://{host} (or https://{host})"
        )
    return text


def json_object(text: str) -> dict[str, Any]:
    """``--metadata``: a JSON object."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}); e.g. --metadata '{{\"run\": \"a\", \"lr\": 1e-6}}'") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {type(value).__name__}: {text!r}")
    return value


def _integer(text: str, low: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer ({what})") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"{text!r} is out of range: must be {what}")
    return value


def version_number(text: str) -> int:
    """``--version V``, ``--base V``, ``pin URL V``: versions are numbered from 1."""
    return _integer(text, 1, "a version number, ≥ 1")


def positive_int(text: str) -> int:
    """``--keep-last N``, ``--anchor-every N``, ``--max-versions N``, ``--quorum K``: ≥ 1."""
    return _integer(text, 1, "≥ 1")


def nonnegative_int(text: str) -> int:
    """``--rounds N``: ≥ 0 (0: no limit)."""
    return _integer(text, 0, "≥ 0; 0 runs until Ctrl-C")


def step_number(text: str) -> int:
    """``--step N``: the trainer's step, a signed 64-bit integer as manifests store it."""
    value = _integer(text, -(2**63), "a signed 64-bit integer")
    if value >= 2**63:
        raise argparse.ArgumentTypeError(f"{text!r} is out of range: must be a signed 64-bit integer")
    return value


def poll_interval(text: str) -> float:
    """``--interval S``: seconds between polls, > 0 (0 would poll in a busy loop) and at most
    what a thread's wait accepts."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds (e.g. 2 or 0.5)") from None
    if not 0 < value <= threading.TIMEOUT_MAX:
        raise argparse.ArgumentTypeError(
            f"{text!r} is out of range: must be a number of seconds > 0 and ≤ {threading.TIMEOUT_MAX:.0f}"
        )
    return value


def options(args: argparse.Namespace) -> dict[str, Any]:
    """The backend options of a command line: ``--storage-option`` pairs and ``--endpoint-url``."""
    opts: dict[str, Any] = dict(getattr(args, "storage_option", None) or [])
    if getattr(args, "endpoint_url", None):
        opts["endpoint_url"] = args.endpoint_url
    return opts


# --- stores -------------------------------------------------------------------------------------


def open_store(args: argparse.Namespace, *, write: bool = False, url: str | None = None) -> Any:
    """Open ``url`` (default ``args.url``): the URL checked first (a typo is never taken for a
    directory), nothing created unless ``write`` (only ``publish`` and ``aggregate`` create a
    local store), and an ``s3://`` endpoint checked to speak S3 (a web or filer port would look
    like an empty store; one that is down is reported at once)."""
    from deltastore.storage import check_url
    from deltastore.storage import open_store as _open
    from deltastore.storage.probe import check_endpoint

    url = url or args.url
    check_url(url)
    if url.startswith("s3://") and not getattr(args, "endpoint_url", None):
        for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
            value = os.environ.get(name)
            if value and not re.match(r"^https?://", value):
                raise UnsupportedURLError(f"{name}={value!r} has no scheme; set it to http://{value} (or https://)")
    store = _open(url, storage_options=options(args), create=write)
    try:
        check_endpoint(store)
    except BaseException:
        store.close()
        raise
    return store


def trusted_keys(args: argparse.Namespace) -> Any:
    """The ``--trusted-key`` files, loaded (before any IO: a bad key fails first), or None."""
    if not getattr(args, "trusted_key", None):
        return None
    from deltastore.format.signing import TrustedKeys

    return TrustedKeys(args.trusted_key)


def read_history(store: Any, keys: Any) -> Any:
    """A :class:`~deltastore.format.history.History` of ``store`` for the commands that read versions
    but move no tensors (a Subscriber imports torch). With ``keys`` every manifest read must be
    signed by one of them, and an unsigned one above a signed parent is named for what it is
    (UnsignedVersionError), as a Subscriber names it."""
    from deltastore.format.history import History

    if keys is None:
        return History(store)
    from deltastore.format.signing import signed_parent, unsigned_version_error

    def check(key: str, m: Any) -> None:
        try:
            keys.verify(key, m)
        except SignatureError:
            below = signed_parent(keys, history, m) if m.signature is None else None
            if below is None:
                raise
            raise unsigned_version_error(store.url, key, m, *below) from None

    history = History(store, check)
    return history


# --- errors ------------------------------------------------------------------------------------

#: Python spellings in library messages → the flags a CLI user types.
_PY_TO_CLI = (
    (re.compile(r"\ballow_unsafe_store=True\b"), "--allow-unsafe-store"),
    (re.compile(r"\bstorage_options\b"), "--storage-option KEY=VALUE"),
    (re.compile(r"\bendpoint_url="), "--endpoint-url "),
    (re.compile(r"\bendpoint_url\b"), "--endpoint-url"),
    (re.compile(r"\banchor=True\b"), "--anchor"),
    (re.compile(r"\btakeover=False\b"), "--no-takeover"),
    (re.compile(r"\btrusted_keys\b"), "--trusted-key"),
    (re.compile(r"\ballow_unsigned=True\b"), "--allow-unsigned"),
    (re.compile(r"\bsigning_key\b"), "--signing-key"),
    (re.compile(r"\bfollow with on_history_replaced='reload'"), "pull --follow with --on-history-replaced reload"),
)


def cli_terms(text: str) -> str:
    """A library message with its Python argument names replaced by CLI flags."""
    for pattern, flag in _PY_TO_CLI:
        text = pattern.sub(flag, text)
    return text


def one_line(e: BaseException) -> str:
    text = str(e) if str(e) else type(e).__name__
    return f"{type(e).__name__}: {cli_terms(' '.join(text.split()))}"


def hint_for(e: BaseException, args: argparse.Namespace | None) -> str | None:
    """A fix-it line for the CLI user, or None when the message says it all."""
    url = getattr(args, "url", None) or "URL"
    text = str(e)
    if isinstance(e, UnsafeStoreError):
        return "if this is the store's only publisher, pass --allow-unsafe-store"
    if isinstance(e, HistoryReplacedError):
        return None  # the message says what happened and what to do
    if isinstance(e, FencedError):
        return "another publisher took the store over while this command ran; run it again to take it back"
    if isinstance(e, ConflictError):
        return "another writer committed first; run the command again"
    if isinstance(e, LayoutMismatchError):
        return "pass --anchor to publish tensors with other names, shapes or dtypes (a full snapshot)"
    if isinstance(e, UnsignedVersionError):
        return "the store's publisher must publish with --signing-key FILE; versions written without it stay refused"
    if isinstance(e, SignatureError):
        return "pass the publisher's public key with --trusted-key FILE (see deltastore keygen)"
    if isinstance(e, VersionNotFoundError) and getattr(args, "command", None) == "aggregate":
        return "pass --init FILE.safetensors: it is published as global version 1"
    if isinstance(e, VersionNotFoundError):
        return f"deltastore log {url} lists the versions the store has"
    if isinstance(e, CommitUnknownError):
        return "run the same publish again: it settles whether the version landed first"
    if isinstance(e, BucketNotFoundError):
        if url.startswith("s3://"):
            return "create the bucket first (e.g. aws s3 mb s3://BUCKET --endpoint-url ...) or fix the URL"
        return "check the path (publish creates a local store; pull --follow waits for one)"
    if isinstance(e, AccessDeniedError):
        if "profile" in text:
            return "list the profiles with: aws configure list-profiles; pass one with --storage-option profile=NAME or AWS_PROFILE"
        return ("set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), or pass "
                "--storage-option profile=NAME")
    if isinstance(e, UnsupportedURLError) and "AWS_ENDPOINT_URL" not in text:
        return ("a store is ./DIR, file:///DIR, s3://BUCKET/PREFIX (--endpoint-url for S3-compatible "
                "servers) or memory://NAME")
    if isinstance(e, StorageError) and "not an S3 endpoint" in text:
        return "--endpoint-url must name the S3 gateway (SeaweedFS: port 8333, MinIO: 9000), not a filer, master or web port"
    if isinstance(e, StorageError) and "cannot reach" in text:
        return "check --endpoint-url and that the server runs"
    if isinstance(e, ModuleNotFoundError):
        return f"install the missing package: pip install {e.name}"
    return None


def exit_code_for(e: BaseException) -> int:
    """EXIT_USAGE for a malformed store URL (a command-line mistake), else EXIT_FAILED."""
    return EXIT_USAGE if isinstance(e, UnsupportedURLError) else EXIT_FAILED


def report_error(e: BaseException, args: argparse.Namespace | None) -> None:
    print(f"deltastore: error: {one_line(e)}", file=sys.stderr)
    hint = hint_for(e, args)
    if hint:
        print(f"hint: {hint}", file=sys.stderr)


# --- output -------------------------------------------------------------------------------------


def emit_json(obj: Any, **kwargs: Any) -> None:
    print(json.dumps(obj, sort_keys=True, **kwargs), flush=True)


def size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def duration(s: float) -> str:
    if s < 120:
        return f"{s:.0f}s"
    if s < 7200:
        return f"{s / 60:.0f}m"
    return f"{s / 3600:.1f}h"


# --- progress -----------------------------------------------------------------------------------


def progress_enabled(quiet: bool) -> bool:
    if quiet:
        return False
    setting = os.environ.get(PROGRESS_ENV, "")
    if setting == "0":
        return False
    return setting == "1" or sys.stderr.isatty()


@contextlib.contextmanager
def byte_progress(desc: str, *, quiet: bool) -> Iterator[Callable[[int], None]]:
    """A thread-safe ``add(n_bytes)`` that feeds a tqdm bar of bytes moved (both ways: a publish
    first reads the head back to delta against it) on stderr (a no-op when bars are
    off: ``-q``, stderr not a terminal, DELTASTORE_PROGRESS=0, or tqdm missing)."""
    if not progress_enabled(quiet):
        yield lambda n: None
        return
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is a dependency, but a broken install should not stop a transfer
        yield lambda n: None
        return
    lock = threading.Lock()
    bar = tqdm(desc=desc, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr, leave=False,
               dynamic_ncols=True, mininterval=0.2)

    def add(n: int) -> None:
        with lock:
            bar.update(n)

    try:
        yield add
    finally:
        bar.close()


def counting_store(store: Any, add: Callable[[int], None]) -> Any:
    """``store`` with every byte read or written reported to ``add`` (for progress bars)."""
    from deltastore.storage.base import Store

    class CountingStore(Store):
        """Delegates to the wrapped store; counts payload bytes of get and put."""

        def __init__(self) -> None:
            self.url = store.url
            self.atomic_conditional_writes = store.atomic_conditional_writes
            self.conditional_writes_need_probe = store.conditional_writes_need_probe

        def __getattr__(self, name: str) -> Any:
            return getattr(store, name)

        def get(self, key: str, *, byte_range: tuple[int, int] | None = None) -> bytes:
            data = store.get(key, byte_range=byte_range)
            add(len(data))
            return data

        def get_with_meta(self, key: str) -> Any:
            got = store.get_with_meta(key)
            add(len(got.data))
            return got

        def get_if_changed(self, key: str, etag: str | None) -> Any:
            got = store.get_if_changed(key, etag)
            if got is not None:
                add(len(got.data))
            return got

        def put(self, key: str, data: bytes, *, mode: Any = "overwrite") -> Any:
            meta = store.put(key, data, mode=mode)
            add(len(data))
            return meta

        def head(self, key: str) -> Any:
            return store.head(key)

        def list(self, prefix: str = "") -> Any:
            return store.list(prefix)

        def delete(self, key: str) -> None:
            store.delete(key)

        def exists(self, key: str) -> bool:
            return store.exists(key)

        def close(self) -> None:  # the wrapped store is closed by its owner
            pass

        def __repr__(self) -> str:
            return f"CountingStore({store!r})"

    return CountingStore()
