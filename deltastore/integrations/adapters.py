"""Serve the versions of an adapter store in vLLM or SGLang: stage each on local disk, swap it
in atomically, keep the old adapter serving when a load fails.

The engines load LoRA adapters at run time over HTTP (vLLM ``POST /v1/load_lora_adapter`` with
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``; SGLang ``POST /load_lora_adapter`` with
``--enable-lora``). :class:`AdapterFollower` follows an adapter store
(:mod:`deltastore.integrations.peft`) and, per new version:

1. **stage**: fetches the version (only what changed since the last one), checks it against
   the base (:func:`~deltastore.integrations.peft.check_adapter`, before the engine is
   touched) and writes it as a PEFT directory under ``stage_dir`` (atomically);
2. **load** it under a name of its own, ``f"{name}@{version}"``, and **verify** that the engine
   lists it (``GET /v1/models``);
3. **point** clients at the new name (the ``on_swap`` callback: a router, a config push);
4. **unload** the older versions of the adapter.

A request names one adapter version for its whole life: one in flight on ``policy@6`` finishes
on ``policy@6``. vLLM's unload only removes the name (running requests keep their adapter);
SGLang's waits for the requests that use it. A new request for an unloaded name is refused
(404), hence step 3 before step 4, and ``retain`` to keep older versions loaded for clients
that learn the new name late. The engines' in-place reload (vLLM ``load_inplace``) is not
used: a request running across it would mix two adapters in one completion, and vLLM keys its
prefix cache by adapter *name*, so cached blocks of the old adapter would be reused.

**Prefix cache.** A new name per version keeps cached prefixes apart without a reset (vLLM
hashes blocks with the adapter's name, ``vllm/v1/core/kv_cache_utils.py``; SGLang keys its
radix cache by a ``lora_id`` drawn per load, ``sglang/srt/lora/lora_registry.py``). Blocks of
old versions are evicted as the cache fills. ``prefix_cache="reset"`` also empties it after
each swap (vLLM ``POST /reset_prefix_cache``, dev mode; SGLang ``POST /flush_cache``); both
engines refuse while requests run, which is reported (``SwapResult.prefix_cache_reset``), not
raised.

**Failures.** A load the engine refuses, or one it accepts but does not list, raises
:class:`~deltastore.errors.EngineUpdateError` naming both versions; the old adapter was never
unloaded and keeps serving. A load whose response is lost (timeout, dropped connection) is
read back from the engine's list: it counts only if listed, and is unloaded again otherwise.
An old version that cannot be unloaded is logged and retried at the next swap.

Example::

    from deltastore.integrations.adapters import AdapterFollower, VLLMAdapterClient

    engine = VLLMAdapterClient("http://localhost:8000")
    with AdapterFollower("s3://bucket/run-7/adapter", engine, name="policy",
                         stage_dir="/var/cache/adapters", expect_base="Qwen/Qwen3-0.6B") as f:
        for result in f.run():                      # blocks; one SwapResult per version served
            log.info("serving %s", result.served)   # clients send model="policy@<version>"
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from deltastore.errors import (
    AdapterMismatchError,
    EngineUpdateError,
    FormatError,
    HeadRolledBackError,
    HistoryReplacedError,
    IntegrityError,
    LayoutMismatchError,
    StorageError,
    VersionNotFoundError,
)
from deltastore.integrations.jsonhttp import JSONClient
from deltastore.integrations.peft import (
    AdapterRecord,
    BaseLayout,
    BaseRef,
    MaterializedAdapter,
    check_adapter,
    check_base,
    marker_of,
    read_marker,
    write_adapter_dir,
)
from deltastore.read.follow import PollPolicy

logger = logging.getLogger(__name__)

#: How a version is named in the engine: a name per version is what makes the swap atomic for
#: requests and keeps the engines' prefix caches apart.
SERVED_NAME = "{name}@{version}"
#: Seconds an engine call may take: loading an adapter reads it from disk and copies it to the
#: device, seconds for large ranks; an unload or a listing is milliseconds.
DEFAULT_TIMEOUT_S = 120.0
#: Staged directories kept: the version served and the one before it. The engines may read a
#: served adapter's directory again after the load (vLLM reloads one its CPU cache evicted,
#: SGLang one it evicted from its pool), and requests may still run on the previous version.
KEEP_STAGED = 2
#: Loads of one version tried before the follower waits for a newer version instead (a load
#: the engine refuses three times is not transient).
ATTEMPTS_PER_VERSION = 3
#: Adapter names: they become engine model names and directory names.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def served_name(name: str, version: int) -> str:
    """The engine name of ``version`` of adapter ``name`` (``"policy@12"``)."""
    return SERVED_NAME.format(name=name, version=version)


def served_version(name: str, served: str) -> int | None:
    """The version in an engine name made by :func:`served_name` for ``name`` (None: another name)."""
    prefix = SERVED_NAME.format(name=name, version="")
    tail = served[len(prefix):] if served.startswith(prefix) else ""
    return int(tail) if tail.isdigit() and not tail.startswith("0") else None


# --- the engines ---------------------------------------------------------------------------


class AdapterEngine(Protocol):
    """What :func:`swap_adapter` needs from an inference engine.

    :class:`VLLMAdapterClient` and :class:`SGLangAdapterClient` implement it over HTTP; tests
    and other engines provide their own.

    ``load_adapter`` and ``unload_adapter`` raise :class:`~deltastore.errors.EngineUpdateError`
    when the engine answers with a refusal (nothing changed), and ``OSError`` when the outcome
    is unknown (no answer: a timeout, a dropped connection).
    """

    def load_adapter(self, name: str, path: str) -> None:
        """Load the PEFT adapter directory ``path`` under ``name``."""

    def unload_adapter(self, name: str) -> None:
        """Stop serving ``name``."""

    def adapters(self) -> frozenset[str]:
        """The names the engine serves now (base models and adapters)."""

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache; False when the engine declined (requests running)."""


class _HttpEngine:
    """The HTTP plumbing both clients share: JSON requests, the engine's error text, and the
    ``GET /v1/models`` listing (both engines list adapters there, with ``id`` = adapter name)."""

    kind = "engine"

    def __init__(self, url: str, *, api_key: str | None = None, timeout: float = DEFAULT_TIMEOUT_S):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"engine URL must be http:// or https://, got {url!r}")
        if not timeout > 0:
            raise ValueError(f"timeout must be positive, got {timeout!r}")
        self.url = url.rstrip("/")
        self.timeout = timeout
        self._client = JSONClient(self.url, timeout_s=timeout, api_key=api_key)

    def __str__(self) -> str:
        return f"{self.kind} at {self.url}"

    def _call(self, method: str, path: str, body: Mapping[str, Any] | None = None) -> tuple[int, bytes]:
        """(status, body) of one request; OSError when no answer came."""
        return self._client.raw(method, path, None if body is None else dict(body))

    def _refused(self, what: str, status: int, body: bytes) -> EngineUpdateError:
        return EngineUpdateError(f"{self} refused to {what} (HTTP {status}): {_message(body)}")

    def adapters(self) -> frozenset[str]:
        status, body = self._call("GET", "/v1/models")
        if status != 200:
            raise self._refused("list its models", status, body)
        try:
            data = json.loads(body)["data"]
            return frozenset(str(card["id"]) for card in data)
        except (ValueError, KeyError, TypeError) as e:
            raise EngineUpdateError(f"{self}: GET /v1/models answered something else than a model list: {e}") from None


def _message(body: bytes) -> str:
    """The error text of an engine's answer: vLLM's ``{"error": {"message"}}`` (older:
    ``{"message"}``), SGLang's ``{"error_message"}``, or the body as text."""
    text = body.decode("utf-8", errors="replace").strip()
    try:
        obj = json.loads(text)
    except ValueError:
        return text[:2000] or "(no message)"
    if isinstance(obj, dict):
        err = obj.get("error")
        for found in (err.get("message") if isinstance(err, dict) else err, obj.get("error_message"), obj.get("message")):
            if isinstance(found, str) and found:
                return found[:2000]
    return text[:2000]


class VLLMAdapterClient(_HttpEngine):
    """vLLM's runtime LoRA API (an :class:`AdapterEngine`).

    Start vLLM with ``--enable-lora --max-lora-rank R`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``
    (the load/unload routes exist only then); ``prefix_cache="reset"`` also needs
    ``VLLM_SERVER_DEV_MODE=1`` (``/reset_prefix_cache`` is a development route). Checked against
    vLLM's ``vllm/frontend/entrypoints/serve/lora/api_router.py``,
    ``.../openai/models/serving.py`` and ``.../serve/dev/cache/api_router.py``:

    - ``POST /v1/load_lora_adapter {"lora_name", "lora_path"}``: 200 with a plain-text
      "Success: ..."; 400 (name already loaded), 404 (no adapter at the path) or 500 (the
      engine failed to load it) with ``{"error": {"message", ...}}``. The name is registered
      only after every worker loaded the adapter.
    - ``POST /v1/unload_lora_adapter {"lora_name"}``: 200, or 404 for an unknown name.
    - ``GET /v1/models``: base models and adapters (``id`` = ``lora_name``).
    - ``POST /reset_prefix_cache``: ``{"success": bool}`` (false while blocks are in use).

    Args:
        url: the server, e.g. ``http://localhost:8000``.
        api_key: sent as ``Authorization: Bearer`` (``vllm serve --api-key``).
        timeout: seconds per request.

    Raises:
        ValueError: a URL that is not http(s), or a timeout that is not positive.

    Example::

        VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 vllm serve Qwen/Qwen3-0.6B --enable-lora --max-lora-rank 16

        engine = VLLMAdapterClient("http://localhost:8000")
        engine.load_adapter("policy@1", "/srv/adapters/policy@1")
    """

    kind = "vLLM"

    def load_adapter(self, name: str, path: str) -> None:
        status, body = self._call("POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
        if status != 200:
            raise self._refused(f"load adapter {name!r} from {path}", status, body)

    def unload_adapter(self, name: str) -> None:
        status, body = self._call("POST", "/v1/unload_lora_adapter", {"lora_name": name})
        if status != 200:
            raise self._refused(f"unload adapter {name!r}", status, body)

    def reset_prefix_cache(self) -> bool:
        status, body = self._call("POST", "/reset_prefix_cache")
        if status == 404:
            raise self._refused("reset its prefix cache (start vLLM with VLLM_SERVER_DEV_MODE=1)", status, body)
        if status != 200:
            return False
        try:  # older servers answer 200 with no body
            return bool(json.loads(body).get("success", True)) if body.strip() else True
        except (ValueError, AttributeError):
            return True


class SGLangAdapterClient(_HttpEngine):
    """SGLang's runtime LoRA API (an :class:`AdapterEngine`).

    Start SGLang with ``--enable-lora --max-lora-rank R --lora-target-modules ...`` (an engine
    started without adapters needs both to size its adapter pool); a ``--max-loaded-loras``
    must leave room for 2 + ``retain`` versions (old and new are loaded together in a swap).
    Checked against SGLang's ``python/sglang/srt/entrypoints/http_server.py``,
    ``managers/io_struct.py`` and ``lora/lora_registry.py``:

    - ``POST /load_lora_adapter {"lora_name", "lora_path", "pinned"}``: ``LoRAUpdateOutput``
      ``{"success", "error_message", "loaded_adapters"}``, HTTP 200 on success, 400 otherwise
      (a name already registered is refused).
    - ``POST /unload_lora_adapter {"lora_name"}``: the same; it returns once the requests
      using the adapter finished.
    - ``GET /v1/models``: the base model and the registered adapters (``id`` = ``lora_name``).
    - ``POST /flush_cache``: 200, or 400 while requests are running or waiting.

    Args:
        url: the server, e.g. ``http://localhost:30000``.
        api_key: sent as ``Authorization: Bearer`` (``--api-key``).
        timeout: seconds per request.
        pinned: load adapters pinned in GPU memory (never evicted from SGLang's adapter pool).

    Raises:
        ValueError: a URL that is not http(s), or a timeout that is not positive.

    Example::

        python -m sglang.launch_server --model-path Qwen/Qwen3-0.6B --enable-lora \\
            --max-lora-rank 16 --lora-target-modules q_proj v_proj

        engine = SGLangAdapterClient("http://localhost:30000")
    """

    kind = "SGLang"

    def __init__(self, url: str, *, api_key: str | None = None, timeout: float = DEFAULT_TIMEOUT_S,
                 pinned: bool = False):
        super().__init__(url, api_key=api_key, timeout=timeout)
        self.pinned = pinned

    def _update(self, what: str, path: str, body: Mapping[str, Any]) -> None:
        status, answer = self._call("POST", path, body)
        try:
            ok = status == 200 and bool(json.loads(answer).get("success"))
        except (ValueError, AttributeError):
            ok = False
        if not ok:
            raise self._refused(what, status, answer)

    def load_adapter(self, name: str, path: str) -> None:
        self._update(f"load adapter {name!r} from {path}", "/load_lora_adapter",
                     {"lora_name": name, "lora_path": path, "pinned": self.pinned})

    def unload_adapter(self, name: str) -> None:
        self._update(f"unload adapter {name!r}", "/unload_lora_adapter", {"lora_name": name})

    def reset_prefix_cache(self) -> bool:
        status, _ = self._call("POST", "/flush_cache")
        return status == 200


# --- one swap ------------------------------------------------------------------------------


@dataclass(frozen=True)
class SwapResult:
    """What :func:`swap_adapter` did.

    Attributes:
        name: the adapter's name.
        version: the version now served.
        served: its engine name (``f"{name}@{version}"``): what clients send as ``model``.
        previous: the engine name that served before (None: none was known).
        unloaded: older versions unloaded after the swap.
        stale: older versions that could not be unloaded (they stay loaded; the next swap
            tries again).
        prefix_cache_reset: whether the prefix cache was emptied (None: not asked).
        load_s: seconds the load and its verification took.
    """

    name: str
    version: int
    served: str
    previous: str | None
    unloaded: tuple[str, ...]
    stale: tuple[str, ...]
    prefix_cache_reset: bool | None
    load_s: float


def swap_adapter(engine: AdapterEngine, *, name: str, version: int, path: str | Path, previous: str | None = None,
                 retain: int = 0, prefix_cache: str = "keep", on_swap: Callable[[str, int], None] | None = None,
                 source: str = "") -> SwapResult:
    """Serve ``version`` of adapter ``name`` from the staged directory ``path``, atomically.

    Loads it as ``f"{name}@{version}"``, checks that the engine lists it, calls ``on_swap``,
    then unloads the older versions of ``name`` the engine lists (all but the ``retain`` newest
    of them). Nothing older is unloaded before the new version is verified.

    Args:
        engine: the :class:`AdapterEngine`.
        name, version: the adapter and the version to serve.
        path: the version's PEFT directory (absolute, readable by the engine).
        previous: the engine name serving before (for messages and the result).
        retain: older versions to keep loaded (for clients that switch names late).
        prefix_cache: ``"keep"`` or ``"reset"`` (empty it after the swap).
        on_swap: called with (engine name, version) once the new version serves, before older
            ones are unloaded: point clients at it there. An exception it raises propagates,
            and no older version is unloaded.
        source: what the version is of (a store URL), for messages.

    Returns:
        The :class:`SwapResult`.

    Raises:
        EngineUpdateError: the new version is not served; ``previous`` keeps serving (the
            message names both). An engine that cannot be reached, or whose answer to the load
            was lost and whose list does not show the adapter, is reported the same way.
        ValueError: a bad ``retain`` or ``prefix_cache``.

    Example::

        adapter = materialize("s3://bucket/adapter", "/srv/adapters/policy@12", version=12)
        swap_adapter(VLLMAdapterClient("http://localhost:8000"), name="policy", version=12,
                     path=adapter.path, previous="policy@11")
    """
    if prefix_cache not in ("keep", "reset"):
        raise ValueError(f"prefix_cache must be 'keep' or 'reset', got {prefix_cache!r}")
    if retain < 0:
        raise ValueError(f"retain must be 0 or more, got {retain}")
    new = served_name(name, version)
    what = f"version {version}" + (f" of {source}" if source else "")
    keeps = f"{previous!r} keeps serving" if previous else "no earlier version of the adapter was serving"

    def failed(why: str) -> EngineUpdateError:
        return EngineUpdateError(f"{engine}: could not serve {what} as {new!r}: {why}; {keeps}")

    if new == previous:  # already serving: reloading it would take it away from its clients
        return SwapResult(name, version, new, previous, (), (), None, 0.0)
    t0 = time.perf_counter()
    try:
        if new in engine.adapters():  # left by an earlier attempt whose answer was lost: load it afresh
            engine.unload_adapter(new)
    except (EngineUpdateError, OSError) as e:
        raise failed(f"the engine cannot be asked ({type(e).__name__}: {e})") from e
    try:
        engine.load_adapter(new, str(path))
    except EngineUpdateError as e:
        raise failed(str(e).removeprefix(f"{engine} ")) from e
    except OSError as e:  # no answer: did the load land? The engine's list says
        listed = _listed_or_none(engine)
        if listed is None or new not in listed:
            _quiet_unload(engine, new)
            raise failed(f"no answer from the engine ({type(e).__name__}: {e}) and it does not list the adapter") from e
        logger.warning("%s: the answer to loading %r was lost (%s), but the engine lists it", engine, new, e)
    listed = _listed_or_none(engine)
    if listed is None or new not in listed:
        _quiet_unload(engine, new)
        raise failed("the engine answered the load but does not list the adapter" if listed is not None
                     else "the engine's model list could not be read to verify the load")
    load_s = time.perf_counter() - t0
    logger.info("%s serves %s as %r (loaded and verified in %.3f s)", engine, what, new, load_s)
    if on_swap is not None:
        on_swap(new, version)
    older = sorted((v, n) for n in listed if (v := served_version(name, n)) is not None and v < version)
    unloaded, stale = [], []
    for _, old in older[:max(0, len(older) - retain)]:
        try:
            engine.unload_adapter(old)
            unloaded.append(old)
        except (EngineUpdateError, OSError) as e:
            logger.warning("%s: %r still loaded after the swap to %r (%s); retried at the next swap", engine, old, new, e)
            stale.append(old)
    reset = None
    if prefix_cache == "reset":
        try:
            reset = engine.reset_prefix_cache()
            if not reset:
                logger.warning("%s declined to reset its prefix cache after the swap to %r (requests running); "
                               "cached prefixes of older versions are evicted as the cache fills", engine, new)
        except (EngineUpdateError, OSError) as e:
            logger.warning("%s: prefix cache not reset after the swap to %r: %s", engine, new, e)
            reset = False
    return SwapResult(name, version, new, previous, tuple(unloaded), tuple(stale), reset, load_s)


def _listed_or_none(engine: AdapterEngine) -> frozenset[str] | None:
    try:
        return engine.adapters()
    except (EngineUpdateError, OSError) as e:
        logger.warning("%s: cannot list its models: %s", engine, e)
        return None


def _quiet_unload(engine: AdapterEngine, name: str) -> None:
    """Unload ``name`` if the engine has it; a failure only logs (the caller is reporting one)."""
    try:
        engine.unload_adapter(name)
    except (EngineUpdateError, OSError) as e:
        logger.debug("%s: unloading %r after a failed load: %s", engine, name, e)


# --- following a store ---------------------------------------------------------------------


@dataclass(frozen=True)
class AdapterStatus:
    """Where an :class:`AdapterFollower` stands.

    Attributes:
        served: the engine name serving (None: nothing served yet).
        served_version: its version.
        staged_version: the newest version staged on disk.
        failed_version: a version the engine would not load (ATTEMPTS_PER_VERSION times); the
            follower waits for a newer one.
        error: the last failure, as text (None after a successful swap).
    """

    served: str | None
    served_version: int | None
    staged_version: int | None
    failed_version: int | None
    error: str | None


class AdapterFollower:
    """Follows an adapter store and serves each new version in one engine (see the module docstring).

    Args:
        url: the adapter store.
        engine: the :class:`AdapterEngine` (:class:`VLLMAdapterClient`, :class:`SGLangAdapterClient`).
        name: the adapter's name; versions are served as ``f"{name}@{version}"``.
        stage_dir: where versions are staged (a directory per version; the ``KEEP_STAGED +
            retain`` newest are kept).
        base: the base model the engine serves, or its :class:`~deltastore.integrations.peft.BaseLayout`:
            each version is checked against it before the engine is touched.
        expect_base: the base the engine serves, as a hub id or path, or a
            :class:`~deltastore.integrations.peft.BaseRef` (with its store and version): a
            version recorded as trained on another base is refused
            (:func:`~deltastore.integrations.peft.check_base`).
        prefix_cache, retain, on_swap: as for :func:`swap_adapter`.
        poll: how often :meth:`run` polls and backs off after failures.
        storage_options, trusted_keys: as for :class:`deltastore.Subscriber`.
        subscriber: an open :class:`deltastore.Subscriber` on the store to use instead (not closed).

    On start, the newest ``f"{name}@N"`` the engine already lists is taken as served (a
    follower restarted next to a running engine does not reload it).

    Raises:
        ValueError: a ``name`` that is not 1-128 letters, digits, ``.``, ``_``, ``-``.

    Example::

        follower = AdapterFollower("s3://bucket/adapter", SGLangAdapterClient("http://localhost:30000"),
                                   name="policy", stage_dir="/var/cache/adapters",
                                   on_swap=lambda served, version: router.point("policy", served))
        threading.Thread(target=lambda: list(follower.run(stop=stopping)), daemon=True).start()
    """

    def __init__(self, url: str | None, engine: AdapterEngine, *, name: str, stage_dir: str | Path,
                 base: BaseLayout | torch.nn.Module | None = None, expect_base: str | BaseRef | None = None,
                 prefix_cache: str = "keep", retain: int = 0, on_swap: Callable[[str, int], None] | None = None,
                 poll: PollPolicy = PollPolicy(), storage_options: Mapping[str, Any] | None = None,
                 trusted_keys: Iterable[Any] | None = None, subscriber: Any = None):
        from deltastore.read.subscriber import Subscriber  # the read path, loaded when used

        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValueError(f"adapter name must be 1-128 letters, digits, '.', '_' or '-' (not first), got {name!r}")
        if prefix_cache not in ("keep", "reset") or retain < 0:
            raise ValueError(f"prefix_cache must be 'keep' or 'reset' and retain 0 or more, got {prefix_cache!r}, {retain}")
        if not isinstance(poll, PollPolicy):
            raise TypeError(f"poll must be a PollPolicy, not {type(poll).__name__}")
        self.engine = engine
        self.name = name
        self.stage_dir = Path(stage_dir).absolute()
        self.base = BaseLayout.from_model(base) if isinstance(base, torch.nn.Module) else base
        self.expect_base = expect_base
        self.prefix_cache, self.retain, self.on_swap, self.poll = prefix_cache, retain, on_swap, poll
        if subscriber is None:
            if url is None:
                raise ValueError("AdapterFollower needs a store URL or an open subscriber")
            subscriber = Subscriber(url, storage_options=storage_options, trusted_keys=trusted_keys)
            self._owns = True
        else:
            self._owns = False
        self.sub = subscriber
        self.url = self.sub.url
        self._weights: dict[str, torch.Tensor] | None = None  # the held version's tensors (pull_into target)
        self._staged: MaterializedAdapter | None = None
        self._served: str | None = None
        self._served_version: int | None = None
        self._failed: int | None = None
        self._attempts: dict[int, int] = {}
        self._error: str | None = None
        self._warned_head: str | None = None
        self._adopt_served()

    # --- public -------------------------------------------------------------------------

    @property
    def served(self) -> str | None:
        """The engine name serving now: what clients send as ``model`` (None: none yet)."""
        return self._served

    def status(self) -> AdapterStatus:
        """The follower's :class:`AdapterStatus`."""
        staged = None if self._staged is None else self._staged.version
        return AdapterStatus(self._served, self._served_version, staged, self._failed, self._error)

    def sync(self, version: int | None = None) -> SwapResult | None:
        """Serve ``version`` (default: the latest) if it is newer than the version served.

        Returns:
            The :class:`SwapResult`, or None when nothing newer is there.

        Raises:
            EngineUpdateError: the engine did not take the new version; the old one keeps
                serving (the message names both).
            AdapterMismatchError: the version does not fit the base (nothing was loaded).
            FormatError: the version is not an adapter.
            The read errors of :meth:`deltastore.Subscriber.pull` (StorageError, IntegrityError, ...).
        """
        info = self.sub.info(version) if version is not None else self.sub.latest()
        if info is None or not self._newer(info):
            return None
        try:
            staged = self._stage(info)
        except AdapterMismatchError as e:
            self._error = str(e)
            raise
        try:
            result = swap_adapter(self.engine, name=self.name, version=info.version, path=staged.path,
                                  previous=self._served, retain=self.retain, prefix_cache=self.prefix_cache,
                                  on_swap=self._on_swap, source=self.url)
        except EngineUpdateError as e:
            self._error = str(e)
            raise
        self._error, self._failed = None, None
        self._attempts.pop(info.version, None)
        self._prune()
        return result

    def run(self, *, stop: threading.Event | None = None, max_versions: int | None = None) -> Iterator[SwapResult]:
        """Poll the store and serve each new version, yielding its :class:`SwapResult`.

        Polls every ``poll.interval`` seconds (a conditional GET of HEAD). A failed load (the
        old version keeps serving), an unreadable store or a failed write to ``stage_dir`` is
        logged, recorded in :meth:`status`, and retried after ``poll``'s backoff; a version the
        engine refuses ``ATTEMPTS_PER_VERSION`` times is skipped until a newer one is published.

        Args:
            stop: a ``threading.Event``; the loop returns soon after it is set.
            max_versions: return after serving this many versions.

        Raises:
            AdapterMismatchError: a version does not fit the base (or ``expect_base``): a
                configuration to fix, not to retry. Nothing was loaded; the engine keeps serving.
        """
        stop = stop if stop is not None else threading.Event()
        served = failures = 0
        while not stop.is_set():
            try:
                result = self.sync()
                failures = 0
            except EngineUpdateError as e:
                failures += 1
                attempted = self._staged.version if self._staged is not None else None
                if attempted is not None:
                    self._attempts[attempted] = self._attempts.get(attempted, 0) + 1
                    if self._attempts[attempted] >= ATTEMPTS_PER_VERSION:
                        self._failed = attempted
                        logger.error("%s; giving up on version %d until a newer one is published", e, attempted)
                    else:
                        logger.warning("%s; retrying", e)
                stop.wait(self.poll.backoff_s(failures))
                continue
            except (StorageError, IntegrityError, FormatError, VersionNotFoundError, OSError) as e:
                failures += 1
                self._error = f"{type(e).__name__}: {e}"
                logger.warning("following %s: %s: %s; %r keeps serving, retrying", self.url, type(e).__name__, e,
                               self._served)
                stop.wait(self.poll.backoff_s(failures))
                continue
            if result is not None:
                served += 1
                yield result
                if max_versions is not None and served >= max_versions:
                    return
            else:
                stop.wait(self.poll.wait_s())

    def close(self) -> None:
        """Release the store (the engine keeps serving what it serves)."""
        if self._owns:
            self.sub.close()

    def __enter__(self) -> AdapterFollower:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- steps --------------------------------------------------------------------------

    def _adopt_served(self) -> None:
        """Take the newest version of this adapter the engine lists as served."""
        listed = _listed_or_none(self.engine)
        found = sorted(v for n in listed or () if (v := served_version(self.name, n)) is not None)
        if found:
            self._served, self._served_version = served_name(self.name, found[-1]), found[-1]
            logger.info("%s already serves %r: following %s from version %d", self.engine, self._served, self.url,
                        found[-1])

    def _newer(self, info: Any) -> bool:
        """Whether ``info`` (the store's version) should be served now."""
        if self._failed is not None and info.version <= self._failed:
            return False
        if self._served_version is None or info.version > self._served_version:
            return True
        if info.version < self._served_version and info.manifest != self._warned_head:
            logger.warning("%s: HEAD names version %d, older than the version served (%d): keeping %r",
                           self.url, info.version, self._served_version, self._served)
            self._warned_head = info.manifest
        return False

    def _stage(self, info: Any) -> MaterializedAdapter:
        """Fetch, check and write ``info``'s version under ``stage_dir`` (reusing a staged copy)."""
        where = f"version {info.version} of {self.url}"
        record = AdapterRecord.from_metadata(info.metadata, where=where)
        check_base(record, self.expect_base, where=where)
        if self._staged is not None and self._staged.manifest == info.manifest:
            return self._staged  # staged for an earlier attempt
        dest = self.stage_dir / served_name(self.name, info.version)
        tensors = self._pull(info.version)
        check_adapter(tensors, record.config, self.base, where=where)
        marker = read_marker(dest) if dest.exists() else None
        if marker is not None and marker.get("manifest") == info.manifest:
            path = dest  # staged before a restart
        else:
            if dest.exists():  # a leftover of another history with the same version number
                shutil.rmtree(dest)
            path = write_adapter_dir(dest, tensors, record.config, marker=marker_of(self.url, info))
        self._staged = MaterializedAdapter(path, info.version, info.step, info.manifest, record)
        return self._staged

    def _pull(self, version: int) -> dict[str, torch.Tensor]:
        """The tensors of ``version``: only what changed since the held one, or a full pull
        (the first version, a new layout such as another rank, a replaced history)."""
        if self._weights is not None:
            try:
                self.sub.pull_into(self._weights, version)
                return self._weights
            except (LayoutMismatchError, HistoryReplacedError, HeadRolledBackError) as e:
                logger.info("%s: loading version %d whole (%s)", self.url, version, type(e).__name__)
        self._weights = None
        self._weights = self.sub.pull(version)
        return self._weights

    def _on_swap(self, served: str, version: int) -> None:
        self._served, self._served_version = served, version
        if self.on_swap is not None:
            self.on_swap(served, version)

    def _prune(self) -> None:
        """Remove staged directories beyond the KEEP_STAGED newest, and any half-written one."""
        kept: list[tuple[int, Path]] = []
        for entry in self.stage_dir.iterdir() if self.stage_dir.is_dir() else ():
            if entry.name.startswith(f".{self.name}@") and entry.name.endswith(".tmp"):
                shutil.rmtree(entry, ignore_errors=True)  # a write cut by a crash
                continue
            v = served_version(self.name, entry.name)
            if v is not None and entry.is_dir():
                kept.append((v, entry))
        kept.sort()
        served = self._served_version
        keep = KEEP_STAGED + self.retain  # a retained version is loaded: the engine may read it again
        for v, entry in kept[:max(0, len(kept) - keep)]:
            if v != served:
                shutil.rmtree(entry, ignore_errors=True)


__all__ = [
    "ATTEMPTS_PER_VERSION",
    "DEFAULT_TIMEOUT_S",
    "KEEP_STAGED",
    "SERVED_NAME",
    "AdapterEngine",
    "AdapterFollower",
    "AdapterStatus",
    "SGLangAdapterClient",
    "SwapResult",
    "VLLMAdapterClient",
    "served_name",
    "served_version",
    "swap_adapter",
]
