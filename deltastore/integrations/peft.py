"""PEFT adapters (LoRA) as versions of a store: publish, materialize in PEFT's layout, check
against a base model.

A version of an adapter store holds the tensors PEFT saves in ``adapter_model.safetensors``
(``peft.get_peft_model_state_dict(model)``: names such as
``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``, in the training dtype unless
the publisher casts them), and carries the adapter's ``adapter_config.json`` in its metadata,
under one key::

    metadata["peft"] = {
        "adapter_config": {...},      # what PeftModel.save_pretrained writes
        "adapter_name": "default",    # the adapter of the PeftModel it came from
        "base": {"name_or_path": "Qwen/Qwen3-0.6B", "store": None, "version": None},
    }

The base model is not in the adapter store: it is published once to its own store (``base``
names that store and version) or not at all, when workers load it from the hub
(``name_or_path``). A worker checks that it applies the adapter to the base it was trained on
(:func:`check_base`, :func:`check_adapter`) before serving it.

:func:`materialize` writes a version as a directory in PEFT's on-disk layout
(``adapter_model.safetensors`` + ``adapter_config.json``), atomically: the directory appears
whole under its name or not at all. ``PeftModel.from_pretrained(base, path)`` loads it, and so
do vLLM's and SGLang's ``load_lora_adapter``. :mod:`deltastore.integrations.adapters` serves
versions to those engines as they are published.

Example::

    from deltastore.integrations.peft import AdapterPublisher, BaseRef, materialize

    with AdapterPublisher("s3://bucket/run-7/adapter", base=BaseRef("Qwen/Qwen3-0.6B")) as pub:
        for step in range(steps):
            train_step(peft_model)
            pub.publish_async(peft_model, step=step)

    adapter = materialize("s3://bucket/run-7/adapter", "/srv/adapters/run-7@latest")
    model = PeftModel.from_pretrained(base_model, str(adapter.path))
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from deltastore._util.files import fsync_path
from deltastore.errors import AdapterMismatchError, FormatError, InvalidStateDictError

logger = logging.getLogger(__name__)

#: The metadata key of a version that holds the adapter's config and its base (one namespaced
#: key, so that the user's own metadata keys stay free).
PEFT_KEY = "peft"
#: The file names PEFT reads and writes (peft.utils.constants SAFETENSORS_WEIGHTS_NAME, CONFIG_NAME).
WEIGHTS_NAME = "adapter_model.safetensors"
CONFIG_NAME = "adapter_config.json"
#: A materialized directory also holds which version of which store it is: a directory found
#: under a version's name is reused only when it is that very version (same manifest).
MARKER_NAME = "deltastore.json"
#: The prefix PeftModel puts before the base model's module names in the saved tensors.
PEFT_PREFIX = "base_model.model."
#: The adapter types :func:`check_adapter` understands (LoRA and its variants saved as LoRA).
CHECKED_TYPES = ("LORA",)
#: target_modules values that select modules by kind, not by name (nothing to look up).
TARGET_KEYWORDS = ("all-linear",)

#: ``<module>.<part>[.weight]`` of a LoRA tensor: the part says which factor it is.
_LORA_KEY = re.compile(r"^(?P<module>.+)\.(?P<part>lora_A|lora_B|lora_embedding_A|lora_embedding_B|lora_magnitude_vector)"
                       r"(?:\.weight)?$")


@dataclass(frozen=True)
class BaseRef:
    """What identifies the base model an adapter was trained on.

    Attributes:
        name_or_path: the hub id or path of the base (``base_model_name_or_path`` of PEFT's
            config), or None when unknown.
        store: the URL of a deltastore the base itself was published to, if any.
        version: the version of ``store`` the adapter was trained on.

    Example::

        BaseRef("Qwen/Qwen3-0.6B")                                   # workers load the base from the hub
        BaseRef("Qwen/Qwen3-0.6B", store="s3://bucket/base", version=3)
    """

    name_or_path: str | None = None
    store: str | None = None
    version: int | None = None

    def __post_init__(self) -> None:
        for what, value in (("name_or_path", self.name_or_path), ("store", self.store)):
            if value is not None and not isinstance(value, str):
                raise TypeError(f"BaseRef.{what} must be a string or None, got {type(value).__name__}")
        if self.version is not None and (isinstance(self.version, bool) or not isinstance(self.version, int)
                                         or self.version < 1):
            raise ValueError(f"BaseRef.version must be a version number (1 or more) or None, got {self.version!r}")

    def to_json(self) -> dict[str, Any]:
        """The JSON object recorded in a version's metadata."""
        return {"name_or_path": self.name_or_path, "store": self.store, "version": self.version}

    @classmethod
    def from_json(cls, obj: Any) -> BaseRef:
        """The value of :meth:`to_json` (FormatError for anything else)."""
        if not isinstance(obj, Mapping):
            raise FormatError(f"the adapter's base must be a JSON object, got {type(obj).__name__}")
        try:
            return cls(obj.get("name_or_path"), obj.get("store"), obj.get("version"))
        except (TypeError, ValueError) as e:
            raise FormatError(f"the adapter's base record is malformed: {e}") from None


def _peft() -> Any:
    try:
        import peft
    except ImportError as e:
        raise ImportError(
            f"deltastore.integrations.peft needs peft to read a PeftModel ({e}): pip install 'deltastore-weights[peft]'"
        ) from e
    return peft


def _json_safe(value: Any) -> Any:
    """``value`` with sets as sorted lists and enums as their values, as PEFT writes its config."""
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (set, frozenset)):  # sorted: the same file in every process (a set's order is not)
        return sorted((_json_safe(v) for v in value), key=lambda v: (type(v).__name__, str(v)))
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    enum_value = getattr(value, "value", None)
    if isinstance(value, str) and isinstance(enum_value, str):  # PeftType, TaskType (str enums)
        return enum_value
    return value


def adapter_state(model: torch.nn.Module, adapter_name: str = "default") -> dict[str, torch.Tensor]:
    """The tensors PEFT saves for ``adapter_name`` (``get_peft_model_state_dict``), contiguous.

    They alias the model's parameters: publish them before the next optimizer step, or with
    ``publish_async``, which copies them first.
    """
    peft = _peft()
    if adapter_name not in getattr(model, "peft_config", {}):
        raise InvalidStateDictError(f"{type(model).__name__} has no PEFT adapter named {adapter_name!r}: is it a PeftModel?")
    state = peft.get_peft_model_state_dict(model, adapter_name=adapter_name)
    return {n: t.detach().contiguous() for n, t in state.items()}


def adapter_config(model: torch.nn.Module, adapter_name: str = "default") -> dict[str, Any]:
    """The ``adapter_config.json`` that ``model.save_pretrained`` writes for ``adapter_name``, as JSON.

    As PEFT does: sets become lists, ``inference_mode`` is True, ``base_model_name_or_path`` is
    taken from the base model when the config has none, and a config without ``task_type``
    records the base model's class in ``auto_mapping``.
    """
    config = getattr(model, "peft_config", {}).get(adapter_name)
    if config is None:
        raise InvalidStateDictError(f"{type(model).__name__} has no PEFT adapter named {adapter_name!r}: is it a PeftModel?")
    out = _json_safe(config.to_dict())
    out["inference_mode"] = True
    if not out.get("base_model_name_or_path"):
        base = model.get_base_model() if hasattr(model, "get_base_model") else None
        out["base_model_name_or_path"] = getattr(base, "name_or_path", None) or None
    if out.get("task_type") is None and hasattr(model, "get_base_model"):
        cls = type(model.get_base_model())
        out["auto_mapping"] = {"base_model_class": cls.__name__, "parent_library": cls.__module__}
    return json.loads(json.dumps(out))


def adapter_metadata(config: Mapping[str, Any], *, base: BaseRef | None = None,
                     adapter_name: str = "default") -> dict[str, Any]:
    """The ``metadata["peft"]`` record of a version (see the module docstring)."""
    if base is None or base.name_or_path is None:
        name = config.get("base_model_name_or_path") or None
        base = BaseRef(name if isinstance(name, str) else None,
                       None if base is None else base.store, None if base is None else base.version)
    return {"adapter_config": dict(config), "adapter_name": adapter_name, "base": base.to_json()}


@dataclass(frozen=True)
class AdapterRecord:
    """An adapter version's ``metadata["peft"]``, read back.

    Attributes:
        config: the adapter's ``adapter_config.json``.
        base: the base model it was trained on.
        adapter_name: the adapter's name in the PeftModel it was published from.
    """

    config: dict[str, Any] = field(compare=False)
    base: BaseRef
    adapter_name: str = "default"

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any], *, where: str = "this version") -> AdapterRecord:
        """Read ``metadata["peft"]``.

        Raises:
            FormatError: the metadata holds no adapter record, or a malformed one (``where``
                names the version in the message).
        """
        rec = metadata.get(PEFT_KEY) if isinstance(metadata, Mapping) else None
        if not isinstance(rec, Mapping):
            raise FormatError(f"{where} carries no PEFT adapter (metadata {PEFT_KEY!r}): publish adapters with "
                              "deltastore.integrations.peft.AdapterPublisher")
        config = rec.get("adapter_config")
        if not isinstance(config, Mapping) or not isinstance(config.get("peft_type"), str):
            raise FormatError(f"{where}: metadata {PEFT_KEY!r} has no adapter_config with a peft_type")
        name = rec.get("adapter_name", "default")
        if not isinstance(name, str):
            raise FormatError(f"{where}: metadata {PEFT_KEY!r} has a non-string adapter_name")
        return cls(dict(config), BaseRef.from_json(rec.get("base", {})), name)


class AdapterPublisher:
    """Publishes a PEFT model's adapter as successive versions of one store.

    Each version holds ``get_peft_model_state_dict(model)`` and records the adapter's config and
    base in its metadata (``metadata["peft"]``, see the module docstring). The base model is
    never published here.

    Args:
        url: the adapter store (see :class:`deltastore.Publisher`); or None with ``publisher``.
        base: what identifies the base model (default: the config's
            ``base_model_name_or_path``).
        adapter_name: which adapter of the PeftModel to publish.
        publisher: an open :class:`deltastore.Publisher` to publish with instead of opening
            one on ``url`` (the caller keeps it: :meth:`close` does not close it).
        publisher_kwargs: further :class:`deltastore.Publisher` arguments (``dtype``,
            ``storage_options``, policies, ``signing_key``). ``dtype`` None (the default) keeps
            the adapter's training dtype, so a worker gets exactly the trained values.

    Raises:
        ValueError: neither or both of ``url`` and ``publisher``.
        The errors of :class:`deltastore.Publisher`.

    Example::

        with AdapterPublisher("s3://bucket/adapter", base=BaseRef("Qwen/Qwen3-0.6B")) as pub:
            info = pub.publish(peft_model, step=0)
    """

    def __init__(self, url: str | None = None, *, base: BaseRef | None = None, adapter_name: str = "default",
                 publisher: Any = None, **publisher_kwargs: Any):
        if (url is None) == (publisher is None):
            raise ValueError("AdapterPublisher needs a store URL or an open publisher (one of the two)")
        if base is not None and not isinstance(base, BaseRef):
            raise TypeError(f"base must be a BaseRef, got {type(base).__name__}")
        self.base = base
        self.adapter_name = adapter_name
        if publisher is None:
            from deltastore.write.publisher import Publisher  # the write path, loaded when used

            publisher = Publisher(url, **publisher_kwargs)
            self._owns = True
        else:
            if publisher_kwargs:
                raise TypeError(f"publisher arguments {sorted(publisher_kwargs)} given with an open publisher")
            self._owns = False
        self.publisher = publisher

    def publish(self, model: torch.nn.Module, *, step: int | None = None, metadata: Mapping[str, Any] | None = None,
                anchor: bool = False) -> Any:
        """Commit the adapter of ``model`` (a PeftModel) as the next version and return once
        it is visible.

        Args:
            model: the PeftModel; its adapter ``adapter_name`` is published.
            step, metadata, anchor: as for :meth:`deltastore.Publisher.publish`; ``anchor=True``
                is also how the adapter's layout (its rank, its target modules) changes.

        Returns:
            The version's :class:`deltastore.VersionInfo`.

        Raises:
            InvalidStateDictError: ``model`` has no such adapter.
            AdapterMismatchError: the adapter's tensors disagree with its own config.
            The errors of :meth:`deltastore.Publisher.publish`.
        """
        state, meta = self._prepared(adapter_state(model, self.adapter_name), adapter_config(model, self.adapter_name),
                                     metadata)
        return self.publisher.publish(state, step=step, metadata=meta, anchor=anchor)

    def publish_async(self, model: torch.nn.Module, *, step: int | None = None,
                      metadata: Mapping[str, Any] | None = None, anchor: bool = False) -> Future[Any]:
        """As :meth:`publish`, in the background (:meth:`deltastore.Publisher.publish_async`): the
        call returns once the adapter is copied, and the model may be trained on at once.

        Returns:
            A Future of the version's :class:`deltastore.VersionInfo`.
        """
        state, meta = self._prepared(adapter_state(model, self.adapter_name), adapter_config(model, self.adapter_name),
                                     metadata)
        return self.publisher.publish_async(state, step=step, metadata=meta, anchor=anchor)

    def publish_state(self, tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any], *,
                      step: int | None = None, metadata: Mapping[str, Any] | None = None,
                      anchor: bool = False) -> Any:
        """Publish an adapter given as its saved tensors and config (what
        ``adapter_model.safetensors`` and ``adapter_config.json`` hold), without a PeftModel.

        Raises:
            AdapterMismatchError: the tensors disagree with the config.
            The errors of :meth:`deltastore.Publisher.publish`.
        """
        state, meta = self._prepared(dict(tensors), json.loads(json.dumps(_json_safe(dict(config)))), metadata)
        return self.publisher.publish(state, step=step, metadata=meta, anchor=anchor)

    def _prepared(self, state: dict[str, torch.Tensor], config: dict[str, Any],
                  metadata: Mapping[str, Any] | None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        if not isinstance(config.get("peft_type"), str):
            raise InvalidStateDictError("the adapter config has no peft_type: is it a PEFT adapter_config.json?")
        if self.base is not None and self.base.name_or_path and not config.get("base_model_name_or_path"):
            config["base_model_name_or_path"] = self.base.name_or_path
        check_adapter(state, config)  # a worker would refuse it: fail here, where it can be fixed
        meta = dict(metadata or {})
        if PEFT_KEY in meta:
            raise InvalidStateDictError(f"metadata key {PEFT_KEY!r} is the adapter's record: use another key")
        meta[PEFT_KEY] = adapter_metadata(config, base=self.base, adapter_name=self.adapter_name)
        return state, meta

    def flush(self) -> None:
        """Wait for every :meth:`publish_async` (see :meth:`deltastore.Publisher.flush`)."""
        self.publisher.flush()

    def close(self) -> None:
        """Publish what is queued and close the publisher, if this object opened it."""
        if self._owns:
            self.publisher.close()
        else:
            self.publisher.flush()

    def __enter__(self) -> AdapterPublisher:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if self._owns:
            self.publisher.__exit__(exc_type, *exc)
        elif exc_type is None:
            self.publisher.flush()


# --- materializing a version ---------------------------------------------------------------


@dataclass(frozen=True)
class MaterializedAdapter:
    """A version written in PEFT's on-disk layout.

    Attributes:
        path: the directory (``adapter_model.safetensors``, ``adapter_config.json``).
        version: the store's version it holds.
        step: the trainer's step of that version.
        manifest: the version's manifest key (what identifies it in its store).
        record: its adapter config and base.
    """

    path: Path
    version: int
    step: int | None
    manifest: str
    record: AdapterRecord


def write_adapter_dir(dest: str | os.PathLike[str], tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any],
                      *, marker: Mapping[str, Any] | None = None) -> Path:
    """Write ``tensors`` and ``config`` as a PEFT adapter directory at ``dest``, atomically.

    The files are written into a fresh directory next to ``dest``, flushed to disk, and the
    directory is renamed to ``dest``: a reader (an engine, a crash) sees the whole directory or
    none. ``dest`` must not exist (a directory is never replaced under a reader).

    Args:
        dest: the directory to create.
        tensors: the adapter's tensors under PEFT's names.
        config: its ``adapter_config.json``.
        marker: a JSON record written as ``deltastore.json`` (which version this is).

    Returns:
        ``dest`` as an absolute path.

    Raises:
        FileExistsError: ``dest`` exists.
        OSError: the write failed (nothing is left behind).
    """
    from safetensors.torch import save_file

    dest = Path(dest).absolute()
    if dest.exists():
        raise FileExistsError(f"{dest} exists: an adapter directory is written once, under a new name")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 would hide it from an engine running as another user
        # Each tensor its own contiguous copy: a pulled group of small tensors shares one buffer,
        # and safetensors refuses tensors that share memory.
        flat = {n: t.detach().to("cpu").contiguous().clone() for n, t in tensors.items()}
        save_file(flat, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})  # PEFT's own metadata
        _write_text(tmp / CONFIG_NAME, json.dumps(dict(config), indent=2, sort_keys=True))
        if marker is not None:
            _write_text(tmp / MARKER_NAME, json.dumps(dict(marker), indent=2, sort_keys=True))
        for name in os.listdir(tmp):
            fsync_path(tmp / name)
        fsync_path(tmp)
        os.rename(tmp, dest)  # atomic; fails if another writer created a non-empty dest meanwhile
        fsync_path(dest.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def _write_text(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text + "\n")


def read_marker(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The ``deltastore.json`` record of a materialized directory (None if it has none or an
    unreadable one)."""
    try:
        with open(Path(path) / MARKER_NAME, encoding="utf-8") as f:
            obj = json.load(f)
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


def materialize(source: Any, dest: str | os.PathLike[str], version: int | None = None, *,
                storage_options: Mapping[str, Any] | None = None, trusted_keys: Any = None) -> MaterializedAdapter:
    """Write a version of an adapter store as a PEFT adapter directory (atomically, see
    :func:`write_adapter_dir`), loadable by ``PeftModel.from_pretrained(base, path)`` and by
    vLLM's and SGLang's ``load_lora_adapter``.

    A directory already at ``dest`` that holds this very version (its ``deltastore.json`` names
    the same manifest) is returned as it is.

    Args:
        source: the adapter store's URL, or an open :class:`deltastore.Subscriber` (not closed).
        dest: the directory to create.
        version: the version (default: the latest).
        storage_options, trusted_keys: as for :class:`deltastore.Subscriber` (with a URL).

    Returns:
        The :class:`MaterializedAdapter`.

    Raises:
        VersionNotFoundError: no such version (or an empty store).
        FormatError: the version is not an adapter (no ``metadata["peft"]``).
        AdapterMismatchError: its tensors disagree with its config.
        FileExistsError: ``dest`` holds something else.
        The read errors of :meth:`deltastore.Subscriber.pull` (IntegrityError, ...).

    Example::

        adapter = materialize("s3://bucket/adapter", "/srv/adapters/policy@12", version=12)
    """
    from deltastore.read.subscriber import Subscriber  # the read path, loaded when used

    with contextlib.ExitStack() as stack:
        if isinstance(source, Subscriber):
            sub = source
        else:
            sub = stack.enter_context(Subscriber(source, storage_options=storage_options, trusted_keys=trusted_keys))
        info = sub.info(version) if version is not None else sub.latest()
        if info is None:
            from deltastore.errors import VersionNotFoundError

            raise VersionNotFoundError(f"{sub.url} has no version yet: nothing to materialize")
        where = f"version {info.version} of {sub.url}"
        record = AdapterRecord.from_metadata(info.metadata, where=where)
        existing = _reusable(Path(dest), info.manifest)
        if existing is not None:
            return MaterializedAdapter(existing, info.version, info.step, info.manifest, record)
        tensors = sub.pull(info.version)
        check_adapter(tensors, record.config, where=where)
        path = write_adapter_dir(dest, tensors, record.config, marker=marker_of(sub.url, info))
        return MaterializedAdapter(path, info.version, info.step, info.manifest, record)


def marker_of(url: str, info: Any) -> dict[str, Any]:
    """The ``deltastore.json`` record of version ``info`` (a VersionInfo) of ``url``."""
    return {"url": url, "version": info.version, "step": info.step, "manifest": info.manifest}


def _reusable(dest: Path, manifest: str) -> Path | None:
    """``dest`` when it already holds the version of ``manifest``; FileExistsError when it holds
    something else; None when it does not exist."""
    if not dest.exists():
        return None
    found = read_marker(dest)
    if found is not None and found.get("manifest") == manifest and (dest / WEIGHTS_NAME).is_file() \
            and (dest / CONFIG_NAME).is_file():
        return dest.absolute()
    raise FileExistsError(f"{dest} exists and does not hold manifest {manifest}: choose a new directory")


# --- checking an adapter against its config and its base -----------------------------------


@dataclass(frozen=True)
class BaseLayout:
    """The parameter names and shapes of a base model: what :func:`check_adapter` checks an
    adapter against. It needs no weights: build it from a model on the ``meta`` device.

    Attributes:
        shapes: parameter name (as in the plain base model's ``state_dict()``, e.g.
            ``model.layers.0.self_attn.q_proj.weight``) → shape.
        name_or_path: the base's hub id or path, if known.

    Example::

        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained("Qwen/Qwen3-0.6B"))
        layout = BaseLayout.from_model(skeleton)
    """

    shapes: Mapping[str, tuple[int, ...]]
    name_or_path: str | None = None

    @classmethod
    def from_model(cls, model: torch.nn.Module) -> BaseLayout:
        """The layout of ``model``: a plain base model, or a PeftModel (its base, without the
        adapters' own parameters)."""
        if hasattr(model, "get_base_model"):
            model = model.get_base_model()
        shapes: dict[str, tuple[int, ...]] = {}
        for name, t in model.state_dict(keep_vars=True).items():
            if ".lora_" in name or ".modules_to_save." in name:
                continue  # the adapter's own tensors, not the base's
            # PEFT wraps a target module: its original weight lives in base_layer / original_module
            name = name.replace(".base_layer.", ".").replace(".original_module.", ".")
            shapes[name] = tuple(t.shape)
        return cls(shapes, getattr(model, "name_or_path", None) or None)

    @functools.cached_property
    def modules(self) -> frozenset[str]:
        """The module names that own a parameter."""
        return frozenset(n.rpartition(".")[0] for n in self.shapes)


def _module_rank(config: Mapping[str, Any], module: str) -> int | None:
    """The rank ``config`` gives ``module``: its ``rank_pattern`` entry (PEFT's matching: the
    pattern matches a dotted suffix of the name), else ``r``."""
    pattern = config.get("rank_pattern") or {}
    if isinstance(pattern, Mapping):
        for key, rank in pattern.items():
            try:
                if re.match(rf"(.*\.)?({key})$", module):
                    return rank if isinstance(rank, int) else None
            except re.error:
                continue
    r = config.get("r")
    return r if isinstance(r, int) and not isinstance(r, bool) else None


def check_adapter(tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any],
                  base: BaseLayout | torch.nn.Module | None = None, *, where: str = "the adapter") -> None:
    """Check an adapter's tensors against its config and, given ``base``, against the base
    model it is to be applied to, before anything is loaded.

    Checked: the config is a LoRA config; every ``lora_A`` has its ``lora_B`` and their ranks
    agree with each other and with the config's ``r`` / ``rank_pattern``; with a base: every
    module a tensor adapts exists in the base, ``lora_A`` has the base module's input features
    and ``lora_B`` its output features (transposed for ``fan_in_fan_out`` layers; embeddings as
    PEFT stores them), a DoRA magnitude has the output features, a fully saved module
    (``modules_to_save``) has the base's shape, and every name of ``target_modules`` names a
    module of the base.

    Args:
        tensors: the adapter's tensors under PEFT's saved names (or tensors of their shapes).
        config: its ``adapter_config.json``.
        base: the base model or its :class:`BaseLayout` (None: the config only).
        where: what the adapter is, for messages (e.g. "version 12 of s3://...").

    Raises:
        AdapterMismatchError: the first disagreement found, naming the tensor or module.

    Example::

        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)   # no weights allocated
        check_adapter(load_file("adapter_model.safetensors"), json.load(open("adapter_config.json")), skeleton)
    """
    peft_type = config.get("peft_type")
    if peft_type not in CHECKED_TYPES:
        raise AdapterMismatchError(f"{where}: peft_type {peft_type!r} is not supported (only {', '.join(CHECKED_TYPES)})")
    layout = base if isinstance(base, BaseLayout) or base is None else BaseLayout.from_model(base)
    transposed = bool(config.get("fan_in_fan_out"))
    factors: dict[str, dict[str, tuple[str, tuple[int, ...]]]] = {}
    for name, t in tensors.items():
        key = name.removeprefix(PEFT_PREFIX)
        shape = tuple(t.shape)
        m = _LORA_KEY.match(key)
        if m is None:
            if layout is not None:
                _check_saved_whole(name, key, shape, layout, where)
            continue
        factors.setdefault(m["module"], {})[m["part"]] = (name, shape)
    modules = layout.modules if layout is not None else frozenset()
    for module, parts in sorted(factors.items()):
        _check_module(module, parts, config, layout, modules, transposed, where)
    if layout is not None:
        _check_targets(config, modules, where)


def _check_saved_whole(name: str, key: str, shape: tuple[int, ...], layout: BaseLayout, where: str) -> None:
    """A tensor that is not a LoRA factor: a module saved whole (``modules_to_save``) has the
    base parameter's shape; another PEFT tensor (trainable tokens) hangs off a base module,
    one level below it at most."""
    if key in layout.shapes:
        if layout.shapes[key] != shape:
            raise AdapterMismatchError(f"{where}: tensor {name} has shape {list(shape)}, the base's {key} has "
                                       f"{list(layout.shapes[key])}: the adapter was trained on another base model")
        return
    owner = key.rpartition(".")[0]
    modules = layout.modules
    if owner not in modules and owner.rpartition(".")[0] not in modules:
        raise AdapterMismatchError(f"{where}: tensor {name} belongs to {owner}, which the base model does not have: "
                                   "the adapter was trained on another base model")


def _check_module(module: str, parts: dict[str, tuple[str, tuple[int, ...]]], config: Mapping[str, Any],
                  layout: BaseLayout | None, modules: frozenset[str], transposed: bool, where: str) -> None:
    embedding = "lora_embedding_A" in parts or "lora_embedding_B" in parts
    a_key, b_key = ("lora_embedding_A", "lora_embedding_B") if embedding else ("lora_A", "lora_B")
    if a_key not in parts or b_key not in parts:
        have, missing = (a_key, b_key) if a_key in parts else (b_key, a_key)
        raise AdapterMismatchError(f"{where}: module {module} has {parts[have][0]} but no {missing}: "
                                   "the adapter is incomplete")
    (a_name, a), (b_name, b) = parts[a_key], parts[b_key]
    if len(a) < 2 or len(b) < 2:
        raise AdapterMismatchError(f"{where}: {a_name} {list(a)} / {b_name} {list(b)} are not LoRA factors")
    if a[0] != b[1]:
        raise AdapterMismatchError(f"{where}: {a_name} has rank {a[0]} but {b_name} has rank {b[1]}")
    rank = _module_rank(config, module)
    if rank is not None and a[0] != rank:
        raise AdapterMismatchError(f"{where}: {a_name} has rank {a[0]}, the adapter config says r={rank} for {module} "
                                   "(r / rank_pattern): the tensors and the config are of different adapters")
    if layout is None:
        return
    weight = layout.shapes.get(f"{module}.weight")
    if module not in modules or weight is None:
        raise AdapterMismatchError(f"{where}: tensor {a_name} adapts module {module}, which the base model does not have: "
                                   "the adapter was trained on another base model")
    if len(weight) < 2:
        return
    if embedding:  # PEFT stores lora_embedding_A as (r, num_embeddings), lora_embedding_B as (dim, r)
        want_in, want_out = weight[0], weight[1]
    elif transposed:  # Conv1D-style weights (GPT-2): (in, out)
        want_in, want_out = weight[0], weight[1]
    else:  # Linear (out, in), ConvNd (out, in, ...)
        want_in, want_out = weight[1], weight[0]
    if a[1] != want_in:
        raise AdapterMismatchError(f"{where}: {a_name} has {a[1]} input features, the base's {module} has {want_in}: "
                                   "the adapter was trained on another base model")
    if b[0] != want_out:
        raise AdapterMismatchError(f"{where}: {b_name} has {b[0]} output features, the base's {module} has {want_out}: "
                                   "the adapter was trained on another base model")
    magnitude = parts.get("lora_magnitude_vector")
    if magnitude is not None and magnitude[1] != (want_out,):
        raise AdapterMismatchError(f"{where}: {magnitude[0]} has shape {list(magnitude[1])}, the base's {module} has "
                                   f"{want_out} output features")


def _check_targets(config: Mapping[str, Any], modules: frozenset[str], where: str) -> None:
    """Every name of a list ``target_modules`` matches a module of the base (PEFT's rule: the
    name itself or a dotted suffix of it); a string is a regular expression to match in full."""
    targets = config.get("target_modules")
    if targets is None or targets in TARGET_KEYWORDS:
        return
    if isinstance(targets, str):
        try:
            if not any(re.fullmatch(targets, m) for m in modules):
                raise AdapterMismatchError(f"{where}: target_modules {targets!r} matches no module of the base model")
        except re.error as e:
            raise AdapterMismatchError(f"{where}: target_modules {targets!r} is not a regular expression: {e}") from None
        return
    for target in targets if isinstance(targets, (list, tuple)) else ():
        if target in TARGET_KEYWORDS:
            continue
        if not any(m == target or m.endswith(f".{target}") for m in modules):
            raise AdapterMismatchError(f"{where}: target module {target!r} of the adapter config is missing from the "
                                       "base model: the adapter was trained on another base model")


def check_base(record: AdapterRecord, expected: str | BaseRef | None, *, where: str = "the adapter") -> None:
    """Check that an adapter was trained on the base ``expected``: a hub id or path (as the
    engine was started with), or a :class:`BaseRef` (a base published to a store: its URL and
    version are compared too). A field unknown on either side is not compared.

    Raises:
        AdapterMismatchError: the adapter names another base (or another version of it).

    Example::

        check_base(AdapterRecord.from_metadata(info.metadata), "Qwen/Qwen3-0.6B")
        check_base(record, BaseRef("my-base", store="s3://bucket/base", version=3))
    """
    want = BaseRef(expected) if isinstance(expected, str) else expected
    if want is None:
        return
    have = record.base
    for what, mine, theirs in (("base", have.name_or_path, want.name_or_path), ("base store", have.store, want.store),
                               ("base version", have.version, want.version)):
        if mine is not None and theirs is not None and mine != theirs:
            raise AdapterMismatchError(
                f"{where} was trained on {what} {mine!r}, not {theirs!r}: serve it on that base (or pass the base "
                "this engine serves, if it is the same model under another name)"
            )


__all__ = [
    "CONFIG_NAME",
    "MARKER_NAME",
    "PEFT_KEY",
    "WEIGHTS_NAME",
    "AdapterPublisher",
    "AdapterRecord",
    "BaseLayout",
    "BaseRef",
    "MaterializedAdapter",
    "adapter_config",
    "adapter_metadata",
    "adapter_state",
    "check_adapter",
    "check_base",
    "marker_of",
    "materialize",
    "read_marker",
    "write_adapter_dir",
]
