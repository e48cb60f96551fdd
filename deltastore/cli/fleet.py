"""``deltastore target`` and the fleet side of ``deltastore status`` (docs/fleet.md).

``target URL VERSION`` moves every follower of the store to VERSION (backwards too) until the
trainer commits a newer version than HEAD's now; ``--hold`` keeps them there however far HEAD
moves; ``--latest`` lets them follow HEAD again; ``target URL`` alone prints the target.
``status URL --worker ID [--ready-within N]`` is a readiness probe: exit 0 when the worker is
live and holds the fleet's goal (the target's version, else HEAD's) give or take N versions,
else 1. Nothing here imports torch.
"""

from __future__ import annotations

import argparse
from typing import Any

from deltastore.cli.common import EXIT_FAILED, EXIT_OK, emit_json, open_store, read_history, trusted_keys


def ready_within(text: str) -> int:
    """``--ready-within N``: versions of distance still called ready, ≥ 0."""
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"--ready-within must be a whole number of versions, ≥ 0, not {text!r}")
    return n


def add_parser(add: Any, json_flag: Any, trusted: tuple[tuple[str, ...], dict[str, Any]]) -> None:
    """Register ``target`` through the CLI's ``add(name, help, func)``, ``json_flag`` and the
    ``--trusted-key`` option's spelling."""
    p = add("target", "set the version every follower holds (back too), --hold it, or go back to the --latest",
            cmd_target)
    p.add_argument("url")
    p.add_argument("version", nargs="?", type=_version, metavar="VERSION",
                   help="the version followers move to (it must exist and not be collected); without it, and "
                        "without --latest or --hold, print the target")
    p.add_argument("--hold", action="store_true",
                   help="followers stay at VERSION (default: at HEAD's version now) however far HEAD moves; "
                        "without --hold a target lasts until the trainer commits a newer version than HEAD's now")
    p.add_argument("--latest", action="store_true", help="clear the target: followers follow HEAD again")
    p.add_argument("--signing-key", metavar="FILE",
                   help="Ed25519 private key (PEM) to sign the target with; required on a signed store")
    p.add_argument("--allow-unsigned", action="store_true",
                   help="write an unsigned target on a signed store (followers with trusted keys ignore it)")
    p.add_argument("--note", default="", help="why (kept in the target, shown by status)")
    json_flag(p)
    p.add_argument(*trusted[0], **trusted[1])
    p.checks.append(_check_target_args)


def _version(text: str) -> int:
    from deltastore.cli.common import version_number

    return version_number(text)


def _check_target_args(args: argparse.Namespace) -> None:
    if args.latest and (args.version is not None or args.hold):
        raise argparse.ArgumentTypeError("--latest clears the target: pass it without VERSION and --hold")


def check_status_args(args: argparse.Namespace) -> None:
    """``status``: ``--ready-within`` asks about one worker (``--worker``)."""
    if args.ready_within is not None and args.worker is None:
        raise argparse.ArgumentTypeError("--ready-within N asks about one worker: pass --worker ID too")


def _target_json(t: Any) -> dict[str, Any] | None:
    if t is None:
        return None
    return {"version": t.version, "manifest": t.manifest, "hold": t.hold, "head_version": t.head_version,
            "generation": t.generation, "lineage": t.lineage, "writer": t.writer, "created": t.created,
            "note": t.note, "signed_by": t.signed_by}


def cmd_target(args: argparse.Namespace) -> int:
    from deltastore.fleet.status import target_state
    from deltastore.fleet.target import write_target

    keys = trusted_keys(args)
    write = args.version is not None or args.hold or args.latest
    store = open_store(args)
    try:
        history = read_history(store, keys)
        if write:
            version = args.version
            if version is None and args.hold:
                head = history.latest()
                version = None if head is None else head.version  # --hold alone: where HEAD is now
                if version is None:
                    from deltastore.errors import VersionNotFoundError

                    raise VersionNotFoundError(f"{args.url} has no committed version: there is nothing to hold")
            write_target(store, version, history=history, hold=args.hold, signing_key=args.signing_key,
                         allow_unsigned=args.allow_unsigned, note=args.note)
        got = history.read_head()
        state = target_state(store, None if got is None else got[0], keys)
    finally:
        store.close()
    t = state.target
    if args.json:
        emit_json({"url": args.url, "target": _target_json(t), "goal": state.goal, "problem": state.problem})
        return EXIT_OK
    if t is None:
        print(f"{args.url}: no fleet target (followers follow HEAD, version {state.goal})"
              if state.problem is None else f"{args.url}: fleet target unreadable: {state.problem}")
        return EXIT_OK
    print(f"{args.url}: fleet target {t.describe()}; followers hold version {state.goal}")
    if state.problem is not None:
        print(f"  ignored by followers with trusted keys: {state.problem}")
    if t.note:
        print(f"  note: {t.note}")
    return EXIT_OK


def target_line(store: Any, head: Any, keys: Any) -> tuple[dict[str, Any], str]:
    """``status``'s view of the target: its JSON object and its line of text."""
    from deltastore.fleet.status import target_state

    state = target_state(store, head, keys)
    t = state.target
    doc = {"target": _target_json(t), "goal": state.goal, "problem": state.problem}
    if t is None:
        line = "fleet target: none (followers follow HEAD)" if state.problem is None else \
            f"fleet target: unreadable ({state.problem})"
    elif state.problem is not None:
        line = f"fleet target: {t.describe()}, IGNORED: {state.problem}"
    else:
        line = f"fleet target: {t.describe()}; goal version {state.goal}"
    return doc, line


def cmd_ready(args: argparse.Namespace) -> int:
    """``status URL --worker ID [--ready-within N]``: exit 0 when ready, else 1 (one line why)."""
    from deltastore.fleet.status import readiness, target_state
    from deltastore.fleet.ledger import LIVE_TTL_S, check_worker_id, read_heartbeat

    check_worker_id(args.worker)
    keys = trusted_keys(args)
    store = open_store(args)
    try:  # three small GETs (HEAD, the target, the worker's heartbeat): a probe per pod is cheap
        got = read_history(store, keys).read_head()
        head = None if got is None else got[0]
        state = target_state(store, head, keys)
        beat = read_heartbeat(store, args.worker)
    finally:
        store.close()
    within = args.ready_within if args.ready_within is not None else 0
    r = readiness([] if beat is None else [beat], args.worker, head, state.goal, within, ttl_s=LIVE_TTL_S)
    if args.json:
        emit_json({"url": args.url, "worker": r.worker, "ready": r.ready, "version": r.version, "goal": r.goal,
                   "distance": r.distance, "within": within, "reason": r.reason})
    else:
        print(f"{'ready' if r.ready else 'not ready'}: {r.reason}")
    return EXIT_OK if r.ready else EXIT_FAILED
