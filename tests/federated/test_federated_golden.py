"""Golden federated stores (tests/golden/make_golden.py federated, written once):
based versions written by this release are read bit for bit by every later one."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from deltastore import Subscriber
from deltastore.errors import BaseElsewhereError, CompressedVersionError
from deltastore.federated import RoundBase, read_based
from deltastore.federated.aggregator import _site_tensor
from deltastore.federated.based import specs_of
from deltastore.format.history import History
from deltastore.read.engine import ReadEngine
from deltastore.storage import open_store
from testkit.tensors import assert_bits_equal

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
STORE = GOLDEN / "store-federated"
EXPECTED = GOLDEN / "store-federated-expected"


@pytest.fixture
def stores(tmp_path: Path) -> Path:
    """A copy of the golden stores (reading must not depend on writing next to the files)."""
    shutil.copytree(STORE, tmp_path / "store")
    return tmp_path / "store"


def _global_base(g: History, version: int) -> tuple[RoundBase, dict[str, torch.Tensor]]:
    """Global ``version`` as a round's base (key, SHA-256 from the key, lineage, layout) and its bits."""
    head, _ = g.read_head()
    key, m = g.find(version, head)
    assert m.layout is not None
    sha = key.rsplit("-", 1)[1].removesuffix(".json.zst")
    base = RoundBase(version, key, sha, head.lineage, specs_of(g.layout(m.layout), what=key))
    with Subscriber(str(g.store.url)) as sub:
        return base, sub.pull(version)


@pytest.mark.parametrize("site", ["a", "b"])
@pytest.mark.parametrize("version", [1, 2])
def test_golden_based_versions_read_bit_exact(stores: Path, site: str, version: int) -> None:
    g = History(open_store(str(stores / "global")))
    st = open_store(str(stores / f"site-{site}"))
    h = History(st)
    head, _ = h.read_head()
    key, m = h.find(version, head)
    assert m.schema_ == 4 and m.base is not None and m.base.version == version and m.chain_start == version
    base, base_state = _global_base(g, version)
    engine = ReadEngine(st, 1)
    try:
        r = read_based(site, h, engine, key, m, base, base_state)
    finally:
        engine.close()
    got = {n: _site_tensor(r, base.specs[n], base_state[n]) for n in base.specs}
    assert_bits_equal(got, load_file(str(EXPECTED / f"site-{site}-v{version}.safetensors")))


@pytest.mark.parametrize("version", [1, 2])
def test_golden_global_versions(stores: Path, version: int) -> None:
    with Subscriber(str(stores / "global")) as sub:
        assert_bits_equal(sub.pull(version), load_file(str(EXPECTED / f"global-v{version}.safetensors")))


def test_golden_site_store_refuses_plain_pull(stores: Path) -> None:
    with Subscriber(str(stores / "site-a")) as sub:
        assert [i.version for i in sub.log()] == [1, 2]
        with pytest.raises(BaseElsewhereError):
            sub.pull(2)


def test_golden_inspect_names_the_base(stores: Path, capsys) -> None:
    from deltastore.cli import main

    assert main(["inspect", str(stores / "site-b"), "--version", "1"]) == 0
    out = capsys.readouterr().out
    assert "base            version 1 of another store: manifests/000000000001-" in out


COMPRESSED = GOLDEN / "store-federated-compressed"
COMPRESSED_EXPECTED = GOLDEN / "store-federated-compressed-expected"


@pytest.mark.parametrize("version", [1, 2])
def test_golden_compressed_site_versions(tmp_path: Path, version: int) -> None:
    """A compressed site version (SPEC §14.1) of the committed format: its manifest says how it
    was compressed; an opted-in reader rebuilds exactly what the site sent; any other reader
    refuses it before reading a segment."""
    shutil.copytree(COMPRESSED, tmp_path / "store")
    g = History(open_store(str(tmp_path / "store" / "global")))
    st = open_store(str(tmp_path / "store" / "site-a"))
    h = History(st)
    head, _ = h.read_head()
    key, m = h.find(version, head)
    assert m.compression is not None
    assert (m.compression.method, m.compression.density, m.compression.bits, m.compression.error_feedback) == \
        ("topk", 0.05, 2, True)
    base, base_state = _global_base(g, version)
    engine = ReadEngine(st, 1)
    try:
        with pytest.raises(CompressedVersionError, match="site-a|a \\("):
            read_based("a", h, engine, key, m, base, base_state)
        assert engine.bytes_fetched == 0
        r = read_based("a", h, engine, key, m, base, base_state, accept_compressed=True)
    finally:
        engine.close()
    assert r.compression == m.compression
    got = {n: _site_tensor(r, base.specs[n], base_state[n]) for n in base.specs}
    assert_bits_equal(got, load_file(str(COMPRESSED_EXPECTED / f"site-a-v{version}.safetensors")))
    if version == 2:
        with Subscriber(str(tmp_path / "store" / "global")) as sub:
            assert_bits_equal(sub.pull(2), load_file(str(COMPRESSED_EXPECTED / "global-v2.safetensors")))
