"""What every campaign shares: the tally, the chain checker (SPEC §5 I1–I3), the command line,
processes started from a fork server, and the worker that follows a store with ``pull_into``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import multiprocessing
import os
import sys
import tempfile
import time
import traceback
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

#: Examples kept per category in a tally: enough to name a defect, not a log.
EXAMPLES_PER_KIND = 5
#: Retries of the campaign's S3 clients: the library's default (the faults must meet the SDK
#: behaviour users get), not the test suite's fail-fast 2.
CAMPAIGN_RETRIES = 5


@dataclass
class Tally:
    """What one campaign run counted."""

    campaign: str
    backend: str
    trials: int = 0
    seconds: float = 0.0
    faults: Counter[str] = field(default_factory=Counter)
    versions_lost: int = 0
    corrupt_applies: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    wrong_errors: Counter[str] = field(default_factory=Counter)
    invariant_violations: Counter[str] = field(default_factory=Counter)
    examples: dict[str, list[str]] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    command: str = ""

    def note(self, category: str, text: str) -> None:
        ex = self.examples.setdefault(category, [])
        if len(ex) < EXAMPLES_PER_KIND:
            ex.append(text[:500])

    def error(self, e: BaseException | str) -> None:
        self.errors[e if isinstance(e, str) else type(e).__name__] += 1

    def wrong(self, reason: str, detail: str) -> None:
        self.wrong_errors[reason] += 1
        self.note(f"wrong: {reason}", detail)

    def violation(self, kind: str, detail: str) -> None:
        self.invariant_violations[kind] += 1
        self.note(f"violation: {kind}", detail)

    def lost(self, detail: str, n: int = 1) -> None:
        self.versions_lost += n
        self.note("lost", detail)

    def corrupt(self, detail: str) -> None:
        self.corrupt_applies += 1
        self.note("corrupt", detail)

    def merge_worker(self, w: dict[str, Any]) -> None:
        """Add a worker's report (see :func:`follow`)."""
        self.corrupt_applies += w.get("corrupt", 0)
        for k, v in w.get("errors", {}).items():
            self.errors[f"worker {k}"] += v
        for k, v in w.get("wrong", {}).items():
            self.wrong_errors[k] += v
        for cat, texts in w.get("examples", {}).items():
            for t in texts:
                self.note(cat, t)
        self.extra["worker_updates"] = self.extra.get("worker_updates", 0) + w.get("updates", 0)

    @property
    def clean(self) -> bool:
        return not (self.versions_lost or self.corrupt_applies or self.wrong_errors or self.invariant_violations)

    def to_json(self) -> dict[str, Any]:
        return {
            "campaign": self.campaign, "backend": self.backend, "trials": self.trials,
            "seconds": round(self.seconds, 1), "faults": dict(self.faults),
            "versions_lost": self.versions_lost, "corrupt_applies": self.corrupt_applies,
            "errors": dict(self.errors), "wrong_errors": dict(self.wrong_errors),
            "invariant_violations": dict(self.invariant_violations), "examples": self.examples,
            "extra": self.extra, "command": self.command,
        }  # fmt: skip

    def summary(self) -> str:
        lines = [
            f"{self.campaign} on {self.backend}: {self.trials} trials in {self.seconds:.1f} s",
            f"  faults injected: {dict(self.faults) or '-'}",
            f"  versions lost: {self.versions_lost}   corrupt applies: {self.corrupt_applies}",
            f"  errors surfaced: {dict(self.errors) or '-'}",
            f"  wrong errors: {dict(self.wrong_errors) or '-'}",
            f"  invariant violations: {dict(self.invariant_violations) or '-'}",
            f"  extra: {self.extra}",
        ]
        for cat, texts in sorted(self.examples.items()):
            lines.append(f"  e.g. {cat}:")
            lines.extend(f"    - {t}" for t in texts)
        return "\n".join(lines)


# --- the chain, read directly ------------------------------------------------------------


@dataclass(frozen=True)
class Link:
    """One committed version as the oracle reads it (raw JSON, independent of the library)."""

    version: int
    key: str
    step: int | None
    writer: str
    epoch: int
    commit_id: str
    parent: int | None
    kind: str


class ChainChecker:
    """Walks HEAD's chain straight from the store and checks SPEC §5 I1–I3.

    Manifests and packs once verified are not fetched again (they are immutable), except by
    ``check(full=True)``. I3 is checked as "the chain seen last time is a prefix of this one":
    nothing reachable was removed or replaced.
    """

    def __init__(self, store: Any, tally: Tally):
        self.store = store
        self.tally = tally
        self._verified: dict[str, Link] = {}
        self._below: dict[str, str | None] = {}  # manifest key -> parent manifest key
        self._reported: set[tuple[str, str]] = set()  # a broken object is counted once
        self.chain: list[Link] = []

    def _violation(self, kind: str, detail: str) -> None:
        if (kind, detail) not in self._reported:
            self._reported.add((kind, detail))
            self.tally.violation(kind, detail)

    def _get(self, key: str) -> bytes | None:
        from deltastore.errors import NotFoundError

        try:
            return self.store.get(key)
        except NotFoundError:
            return None

    def check(self, *, full: bool = False) -> list[Link]:
        head_bytes = self._get("HEAD")
        if head_bytes is None:
            if self.chain:
                self._violation("I3 HEAD deleted", f"HEAD missing after version {self.chain[-1].version}")
            return []
        try:
            head = json.loads(head_bytes)
        except ValueError as e:
            self._violation("I1 HEAD unreadable", str(e))
            return self.chain
        key, expected = head.get("manifest"), head.get("manifest_sha256")
        links: list[Link] = []
        walked: list[tuple[str, Link, str | None]] = []  # remembered only once the walk succeeds
        while key is not None:
            if key in self._verified and not full:
                links.extend(self._cached_chain(key))
                break
            data = self._get(key)
            if data is None:
                self._violation("I1 manifest missing", f"{key} (reachable from HEAD v{head.get('version')})")
                return self.chain
            digest = hashlib.sha256(data).hexdigest()
            if not key.endswith((f"-{digest}.json", f"-{digest}.json.zst")) or (expected is not None and expected != digest):
                self._violation("I1 manifest hash", f"{key} hashes to {digest}")
                return self.chain
            m = manifest_json(key, data)
            self._check_packs(m, key, "")
            for ref in m.get("streams") or ():
                self._check_stream(m, ref)
            link = Link(m["version"], key, m.get("step"), m.get("writer", ""), m.get("epoch", 0),
                        m.get("commit_id", ""), m.get("parent"), m.get("kind", ""))  # fmt: skip
            walked.append((key, link, m.get("parent_manifest")))
            links.append(link)
            key, expected = m.get("parent_manifest"), None
        for k, link, parent in walked:
            self._verified[k], self._below[k] = link, parent
        links.reverse()
        versions = [l.version for l in links]
        if versions != list(range(1, len(versions) + 1)):
            self._violation("I2 not consecutive", f"chain versions {versions[:5]}…{versions[-5:]}")
        if links and links[-1].version != head.get("version"):
            self._violation("I1 HEAD version", f"HEAD says {head.get('version')}, its manifest is {links[-1].version}")
        old = [l.key for l in self.chain]
        if [l.key for l in links[: len(old)]] != old:
            self._violation("I3 history rewritten", f"chain up to v{len(old)} changed")
        self.chain = links
        return links

    def _check_packs(self, m: dict[str, Any], key: str, prefix: str) -> None:
        """Every pack manifest ``m`` (at ``key``) names is there with its size and SHA-256; a
        stream's pack keys are under its ``prefix``."""
        for b in m.get("blobs", m.get("packs", [])):
            pack = self._get(prefix + b["key"])
            if pack is None:
                self._violation("I1 pack missing", f"{prefix}{b['key']} of version {m['version']} ({key})")
            elif hashlib.sha256(pack).hexdigest() != b["sha256"] or len(pack) != b["size"]:
                self._violation("I1 pack hash", f"{prefix}{b['key']} of version {m['version']}")

    def _check_stream(self, m: dict[str, Any], ref: dict[str, Any]) -> None:
        """A serving stream the version ``m`` names (SPEC §15): its manifest is there, hashes to
        the SHA-256 named, is of the same version, and every pack of it is there intact."""
        key = ref["key"]
        data = self._get(key)
        if data is None:
            self._violation("I1 stream manifest missing", f"{key} (the {ref['format']} stream of version {m['version']})")
            return
        if hashlib.sha256(data).hexdigest() != ref["sha256"]:
            self._violation("I1 stream manifest hash", f"{key} of version {m['version']}")
            return
        sm = manifest_json(key, data)
        if sm.get("version") != m["version"]:
            self._violation("I1 stream version", f"{key} is version {sm.get('version')}, named by version {m['version']}")
        self._check_packs(sm, key, key[: key.index("manifests/")])

    def _cached_chain(self, key: str | None) -> list[Link]:
        out = []
        while key is not None:
            out.append(self._verified[key])
            key = self._below[key]
        return out


def manifest_json(key: str, data: bytes) -> dict[str, Any]:
    """A stored manifest's JSON document: the decompressed columnar document (its packs are
    under ``packs``, each with a ``role``)."""
    import zstandard

    return json.loads(zstandard.ZstdDecompressor().decompress(data))


def grid_tensors(store: Any, link: Link) -> dict[str, int]:
    """Tensor name → ``chunk_cols`` of each column-grid tensor of version ``link``, read from its
    layout object directly: ``--grid`` took effect."""
    import zstandard

    doc = manifest_json(link.key, store.get(link.key))
    ref = doc.get("layout")
    if not isinstance(ref, dict):
        return {}
    layout = json.loads(zstandard.ZstdDecompressor().decompress(store.get(ref["key"])))
    return {n: c for n, c in zip(layout["name"], layout["chunk_cols"]) if c}


def verify_versions(store: Any, links: list[Link], oracle: Any, tally: Tally, threads: int = 1,
                    formats: tuple[Any, ...] = ()) -> set[int]:
    """Pull each version directly and compare with the oracle, then each version in each of
    ``formats`` (``ServingFormat``s: its stream against the reference derivation of its step);
    returns the versions that failed.

    A committed version that cannot be read, or reads other bits than its step's, in its own
    format or any other it was published in, is lost. A version published without a format
    (``--format-churn``) must be refused in it (VersionNotFoundError).
    ``tally.extra["versions_checked"]`` counts the versions read back, per format (``"own"``: as
    published).
    """
    from deltastore import Subscriber, VersionNotFoundError

    failed: set[int] = set()
    checked = tally.extra.setdefault("versions_checked", {})
    with Subscriber(store.url, store=store, threads=threads) as sub:
        carried = {i.version: set(i.formats) for i in sub.log()}

    def refused(sub: Any, fmt: Any, link: Link) -> None:
        """A version published without ``fmt``: its reader must refuse it as not there."""
        try:
            sub.pull(link.version)
            tally.wrong(f"version without {fmt.name} read in it", f"version {link.version} (step {link.step})")
        except VersionNotFoundError:
            pass
        except Exception as e:  # noqa: BLE001 - counted, with its type
            tally.wrong(f"version without {fmt.name} refused with {type(e).__name__}",
                        f"version {link.version} (step {link.step}): {e}")

    for fmt in (None, *formats):
        name = "" if fmt is None else f" in {fmt.name}"
        checked.setdefault("own" if fmt is None else fmt.name, 0)
        with Subscriber(store.url, store=store, threads=threads, format=None if fmt is None else fmt.name) as sub:
            for link in links:
                if fmt is not None and fmt.name not in carried.get(link.version, {fmt.name}):
                    refused(sub, fmt, link)
                    continue
                try:
                    state = sub.pull(link.version)
                except Exception as e:  # noqa: BLE001 - counted, with its type
                    if link.version not in failed:
                        tally.lost(f"committed version {link.version} (step {link.step}){name} unreadable: "
                                   f"{type(e).__name__}: {e}")
                    failed.add(link.version)
                    continue
                checked["own" if fmt is None else fmt.name] += 1
                why = oracle.differs_in(fmt, state, link.step)
                if why is not None:
                    if link.version not in failed:
                        tally.lost(f"committed version {link.version}{name} reads wrong bits: {why}")
                    failed.add(link.version)
    return failed


def committed_as_asked(oracle: Any, tally: Tally, step: int, version: int, returned_step: int | None) -> bool:
    """Whether a publish of ``step`` that returned ``version`` (whose step is ``returned_step``)
    committed that step. A publisher given a state bit-identical to its head's commits nothing
    and returns the head's version (``WriterPolicy.skip_unchanged``, the default): counted in
    ``tally.extra["unchanged_skipped"]``, and a wrong answer unless the bits really are the same."""
    if returned_step == step:
        return True
    if returned_step is not None and oracle.same_bits(step, returned_step):
        tally.extra["unchanged_skipped"] = tally.extra.get("unchanged_skipped", 0) + 1
    else:
        tally.wrong("publish returned another step's version",
                    f"step {step}: returned version {version} of step {returned_step}, whose bits differ")
    return False


# --- command line ------------------------------------------------------------------------


def parser(name: str, default_trials: int, doc: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m campaigns.{name}", description=doc)
    p.add_argument("--backend", choices=["moto", "seaweedfs"], default="moto")
    p.add_argument("--trials", type=int, default=default_trials)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="OUT", help="write the tally as JSON here")
    p.add_argument("--grid", action="store_true", help="publishers write column grids (campaigns.model.GRID_SPECS)")
    p.add_argument("--formats", metavar="NAMES",
                   help="publishers also publish these serving formats (comma-separated, e.g. fp8-block128,mxfp8; "
                        "campaigns.model.serving_formats), workers read the first, and every version is checked in it")
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def main(name: str, run: Callable[..., Tally], p: argparse.ArgumentParser, argv: list[str] | None = None) -> int:
    """Parse arguments, start the backend, run, print the summary (and write --json)."""
    from testkit.servers import backend

    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if not args.verbose:  # the library logs every rolled-back pull and lost response at WARNING+
        logging.getLogger("deltastore").setLevel(logging.CRITICAL)
        logging.getLogger("urllib3").setLevel(logging.CRITICAL)  # a traceback per truncated header
    with backend(args.backend) as server:
        tally = run(server, args)
    tally.command = f"python -m campaigns.{name} " + " ".join(argv if argv is not None else sys.argv[1:])
    print(tally.summary())
    if args.json:
        Path(args.json).write_text(json.dumps(tally.to_json(), indent=1, sort_keys=True))
    return 0


def campaign_options(server: Any, endpoint_url: str | None = None) -> dict[str, Any]:
    """storage_options for a campaign client (library-default retries)."""
    s = server.with_endpoint(endpoint_url) if endpoint_url else server
    return s.storage_options(retries=CAMPAIGN_RETRIES)


def fresh_url(server: Any, name: str) -> str:
    return f"s3://{server.bucket}/{name}-{uuid.uuid4().hex[:10]}"


@contextlib.contextmanager
def scratch_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="campaign-") as d:
        yield Path(d)


def mp_context() -> multiprocessing.context.BaseContext:
    """Processes forked from a server that has torch, boto3 and deltastore imported already:
    a trial's process starts in milliseconds instead of paying the ~2 s imports."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["campaigns._preload"])
    return ctx


# --- a worker following the store ---------------------------------------------------------


def follow(url: str, options: dict[str, Any], seed: int, stop_path: str, out_path: str, interval: float = 0.05,
           fmt: Any = None) -> None:
    """Follow ``url`` with ``pull_into`` until ``stop_path`` exists; write a report to ``out_path``.

    After every successful update the weights must be the exact bits of the version reported
    (with ``fmt``, a ``ServingFormat``: of its stream, the reference derivation of the step);
    after every failed ``pull_into`` they must still be the last good version's. Every error must
    be a DeltastoreError. The report: updates, corrupt, errors by type, wrong errors, examples.
    """
    from campaigns.model import Oracle
    from deltastore import DeltastoreError, Subscriber

    logging.getLogger("deltastore").setLevel(logging.CRITICAL)
    logging.getLogger("urllib3").setLevel(logging.CRITICAL)
    oracle = Oracle(seed)
    report: dict[str, Any] = {"updates": 0, "corrupt": 0, "errors": Counter(), "wrong": Counter(), "examples": {}}

    def note(cat: str, text: str) -> None:
        ex = report["examples"].setdefault(cat, [])
        if len(ex) < EXAMPLES_PER_KIND:
            ex.append(text[:500])

    sub = None
    target = None
    good_step: int | None = None
    try:
        while not os.path.exists(stop_path):
            try:
                if sub is None:
                    sub = Subscriber(url, storage_options=options, threads=1, format=None if fmt is None else fmt.name)
                if target is None:
                    target = sub.pull()
                    info = sub.info(sub.version)
                else:
                    info = sub.pull_into(target)
                    if info is None:
                        time.sleep(interval)
                        continue
                report["updates"] += 1
                why = oracle.differs_in(fmt, target, info.step)
                if why is not None:
                    report["corrupt"] += 1
                    note("corrupt", f"worker holds wrong bits after updating to version {info.version}: {why}")
                    target = None
                    sub.close()
                    sub = None
                else:
                    good_step = info.step
            except DeltastoreError as e:
                report["errors"][type(e).__name__] += 1
                if target is not None and good_step is not None:
                    # SPEC §7.6: a failed pull_into leaves the target as it was.
                    why = oracle.differs_in(fmt, target, good_step)
                    if why is not None:
                        report["corrupt"] += 1
                        note("corrupt", f"failed pull_into ({type(e).__name__}) changed the weights: {why}")
                        target = None
            except Exception as e:  # noqa: BLE001 - the point: an untyped error escaped
                report["wrong"][f"worker {type(e).__name__}"] += 1
                note(f"wrong: worker {type(e).__name__}", "".join(traceback.format_exception_only(type(e), e)).strip())
                target = None
                if sub is not None:
                    sub.close()
                sub = None
            time.sleep(interval)
    finally:
        if sub is not None:
            sub.close()
        report["errors"] = dict(report["errors"])
        report["wrong"] = dict(report["wrong"])
        tmp = out_path + ".tmp"
        Path(tmp).write_text(json.dumps(report))
        os.replace(tmp, out_path)


class Followers:
    """Worker processes following a store; :meth:`stop` returns their merged reports."""

    def __init__(self, ctx: Any, url: str, options: dict[str, Any], seed: int, n: int, workdir: Path, fmt: Any = None):
        self.workdir = workdir
        self.stop_path = str(workdir / f"stop-{uuid.uuid4().hex[:6]}")
        self.outs = [str(workdir / f"worker-{uuid.uuid4().hex[:6]}.json") for _ in range(n)]
        self.procs = [ctx.Process(target=follow, args=(url, options, seed, self.stop_path, out),
                                  kwargs={"fmt": fmt}, daemon=True) for out in self.outs]
        for p in self.procs:
            p.start()

    def stop(self, tally: Tally, timeout: float = 60.0) -> None:
        Path(self.stop_path).touch()
        for p, out in zip(self.procs, self.outs):
            p.join(timeout)
            if p.is_alive():
                p.kill()
                p.join()
                tally.wrong("worker hung", f"worker did not stop within {timeout:.0f} s")
                continue
            try:
                tally.merge_worker(json.loads(Path(out).read_text()))
            except (OSError, ValueError):
                tally.wrong("worker died", f"worker exit code {p.exitcode}, no report")
