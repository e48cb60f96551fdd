"""infra/policies/*.json grant each role what the code writes and deletes, and no more.

The policies are examples users copy; these checks tie them to the key prefixes the code
uses, so that a new kind of object (or a moved one) cannot leave them silently wrong.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deltastore.fleet.ledger import LEDGER_PREFIX
from deltastore.format.keys import HEAD_KEY, OBJECT_PREFIX
from deltastore.lifecycle.gc import DELETABLE_PREFIXES, GC_PREFIX
from deltastore.lifecycle.index import INDEX_SUFFIX
from deltastore.storage.probe import PROBE_PREFIX

POLICIES = Path(__file__).resolve().parents[2] / "infra" / "policies"
RUN = "arn:aws:s3:::BUCKET/RUN/"


def _grants(role: str) -> dict[str, set[str]]:
    """action → the resources it is allowed on (every statement must be an Allow)."""
    doc = json.loads((POLICIES / f"{role}.json").read_text())
    out: dict[str, set[str]] = {}
    for st in doc["Statement"]:
        assert st["Effect"] == "Allow", st
        actions = [st["Action"]] if isinstance(st["Action"], str) else st["Action"]
        resources = [st["Resource"]] if isinstance(st["Resource"], str) else st["Resource"]
        for a in actions:
            out.setdefault(a, set()).update(resources)
    return out


@pytest.mark.parametrize("role", ["trainer", "worker", "gc", "compactor"])
def test_every_role_may_list_and_read_the_run_only(role: str) -> None:
    g = _grants(role)
    assert g["s3:GetObject"] == {RUN + "*"}  # GetObject also covers HEAD requests
    assert g["s3:ListBucket"] == {"arn:aws:s3:::BUCKET"}  # limited to the run by a prefix condition


def test_worker_writes_only_its_heartbeat() -> None:
    g = _grants("worker")
    assert g.get("s3:PutObject") == {RUN + LEDGER_PREFIX + "*"}
    assert "s3:DeleteObject" not in g


def test_trainer_deletes_only_its_probe_keys() -> None:
    g = _grants("trainer")
    assert g["s3:PutObject"] == {RUN + "*"}
    assert g["s3:DeleteObject"] == {RUN + PROBE_PREFIX + "*"}


def test_gc_deletes_exactly_what_gc_may_delete() -> None:
    g = _grants("gc")
    assert g["s3:DeleteObject"] == {RUN + p + "*" for p in DELETABLE_PREFIXES}
    assert g["s3:PutObject"] == {RUN + HEAD_KEY, RUN + OBJECT_PREFIX + "*" + INDEX_SUFFIX, RUN + GC_PREFIX + "*"}


def test_compactor_writes_objects_and_head_and_deletes_nothing() -> None:
    g = _grants("compactor")
    assert g["s3:PutObject"] == {RUN + OBJECT_PREFIX + "*", RUN + HEAD_KEY}
    assert "s3:DeleteObject" not in g
