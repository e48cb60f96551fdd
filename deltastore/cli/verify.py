"""``deltastore verify URL``: re-read versions and check every segment and chunk digest, of the
store's own chain and of every serving stream (SPEC §15) the checked version carries.

A stream is a chain of its own (its anchors, deltas and digests), read only by the workers that
chose its format: checking the store alone would leave a damaged FP8 pack for a worker to find.
``--all`` checks every stream a retained version carries, one no longer published included.
``--format NAME`` (repeatable) checks only the named formats; the store's own format (its
versions as published, e.g. ``bf16``) names the store's chain.
"""

from __future__ import annotations

import argparse
from typing import Any

from deltastore.cli.common import EXIT_FAILED, EXIT_OK, emit_json, open_store, version_number


def add_parser(add: Any, json_flag: Any, trusted: tuple[Any, Any]) -> None:
    """Register ``verify`` through the CLI's ``add(name, help, func)``, ``json_flag`` and the
    ``--trusted-key`` option's arguments."""
    p = add("verify", "re-read a version's chain and check every digest, its serving streams' too (exit 1 when any "
                      "is bad)", cmd_verify)
    p.add_argument("url")
    p.add_argument("--version", type=version_number, help="default: the latest")
    p.add_argument("--all", action="store_true", help="verify every version")
    p.add_argument("--format", action="append", dest="formats", metavar="NAME",
                   help="verify only this format's chain (repeatable; default: the store's and every serving stream "
                        "of the version checked; with --all, every stream of a retained version)")
    json_flag(p)
    p.add_argument(*trusted[0], **trusted[1])


def _formats(sub: Any, latest: Any, args: argparse.Namespace) -> list[str | None]:
    """The chains ``--format`` picks: None for the store's own (a name of the version's own
    format, of ``--version``, else of ``latest``), else the format's name."""
    info = sub.info(args.version) if args.version is not None else latest
    own = set(info.formats) - set(info.streams)  # the version's own format, where it declares one
    return [None if f in own else f for f in dict.fromkeys(args.formats)]


def cmd_verify(args: argparse.Namespace) -> int:
    from deltastore.read.subscriber import Subscriber

    store = open_store(args)
    reports: dict[str | None, Any] = {}
    try:
        with Subscriber(args.url, store=store, trusted_keys=args.trusted_key) as sub:
            latest = sub.latest()
            if latest is None:
                if args.json:
                    emit_json({"url": args.url, "ok": False, "versions": [], "tensors": {}, "segments": 0,
                               "problems": [], "streams": {}, "error": "no versions"})
                else:
                    print(f"{args.url}: no versions to verify")
                return EXIT_FAILED
            # Every segment (full and delta) of every manifest checked, every chunk's digest: of the
            # store's chain and of every stream of the versions checked (with --all, of every
            # retained version, so that a format no longer published is checked too) ...
            chains: list[str | None] = []
            if not args.formats:
                report = sub.verify(args.version, all_versions=args.all, streams=True)
                reports = {None: report, **report.streams}
            else:  # ... or of the chains --format picks
                chains = _formats(sub, latest, args)
                if None in chains:
                    reports[None] = sub.verify(args.version, all_versions=args.all)
        for fmt in chains:
            if fmt is not None:  # UnknownFormatError (the formats the version has) for a format it lacks
                with Subscriber(args.url, store=store, trusted_keys=args.trusted_key, format=fmt) as sub:
                    reports[fmt] = sub.verify(args.version, all_versions=args.all)
    finally:
        store.close()
    ok = all(r.ok for r in reports.values())
    if args.json:
        doc: dict[str, Any] = {"url": args.url, "ok": ok}
        if None in reports:
            doc.update(_report_doc(reports[None]))
        doc["streams"] = {f: {"ok": r.ok, **_report_doc(r)} for f, r in reports.items() if f is not None}
        emit_json(doc)
        return EXIT_OK if ok else EXIT_FAILED
    for fmt, report in reports.items():
        label = "" if fmt is None else f" ({fmt})"
        bad = {p.version for p in report.problems}
        for p in report.problems:
            print(f"BAD version {p.version}{label}: {p.message}")
        for v in report.versions if args.all else report.versions[-1:]:
            if v not in bad:
                print(f"OK version {v}{label}: {report.tensors[v]} tensors verified")
    if not ok:
        from deltastore.errors import IntegrityError

        fmt, first = next((f, r.problems[0]) for f, r in reports.items() if r.problems)
        n_problems = sum(len(r.problems) for r in reports.values())
        versions = sum(len({p.version for p in r.problems}) for r in reports.values())
        where = "" if fmt is None else f" of its {fmt} stream"
        raise IntegrityError(
            f"{n_problems} bad segment(s) or chunk(s) in {versions} version(s) of {args.url}; "
            f"first, in version {first.version}{where}: {first.message}"
        )
    return EXIT_OK


def _report_doc(report: Any) -> dict[str, Any]:
    return {"versions": report.versions, "tensors": {str(v): n for v, n in report.tensors.items()},
            "segments": report.segments,
            "problems": [{"version": p.version, "manifest": p.manifest, "message": p.message} for p in report.problems]}
