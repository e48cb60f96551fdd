"""The ``deltastore`` command line: publish, pull, log, verify, status, inspect, gc, pin, unpin,
compact, keygen, aggregate, mirror, target, docs (``deltastore docs cli`` prints the reference).

Errors print as one line ``deltastore: error: <what>`` (naming the object), then a ``hint:``
line in CLI terms where there is one; set ``DELTASTORE_DEBUG=1`` for the full traceback. Exit
codes: 0 ok, 1 failed, 2 bad usage, 3 nothing to do (publish of an unchanged state), 130
interrupted. ``-v``/``-q`` are accepted before or after the command.

Only argparse and the error classes are imported here: ``deltastore --help`` takes ~0.1 s
(torch, boto3 and fsspec are imported by the commands that use them).

The modules of this package (``commands``, ``common``, ``aggregate``, ``plot``) are its
implementation, not API: the command line is the interface.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from deltastore.cli import commands, fleet, verify
from deltastore.cli.common import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_NOTHING_TO_DO,
    EXIT_OK,
    EXIT_USAGE,
    endpoint_url,
    exit_code_for,
    json_object,
    poll_interval,
    positive_int,
    report_error,
    step_number,
    storage_option,
    version_number,
)
from deltastore.errors import DeltastoreError

logger = logging.getLogger(__name__)

_parse_duration = commands.parse_duration  # its name before the CLI became a package

__all__ = ["EXIT_FAILED", "EXIT_INTERRUPTED", "EXIT_NOTHING_TO_DO", "EXIT_OK", "EXIT_USAGE", "build_parser", "main"]


class _Parser(argparse.ArgumentParser):
    """argparse with errors in deltastore's one-line form (exit 2), and ``checks``: functions
    of the parsed arguments that raise ``argparse.ArgumentTypeError`` for a combination no
    single flag's type can refuse (``--quorum`` above the number of ``--site``s)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.checks: list[Callable[[argparse.Namespace], None]] = []

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> tuple[argparse.Namespace, list[str]]:
        parsed, rest = super().parse_known_args(args, namespace)
        for check in self.checks:
            try:
                check(parsed)
            except argparse.ArgumentTypeError as e:
                self.error(str(e))
        return parsed, rest

    def error(self, message: str) -> NoReturn:
        print(f"deltastore: error: {message}", file=sys.stderr)
        print(f"hint: see {self.prog} --help", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def _verbosity(sub: bool) -> argparse.ArgumentParser:
    """-v/-q, accepted before and after the command (counted separately, then added)."""
    p = argparse.ArgumentParser(add_help=False)
    suffix = "_sub" if sub else ""
    p.add_argument("-v", "--verbose", action="count", default=0, dest=f"verbose{suffix}",
                   help="-v: deltastore's own progress and debug lines; -vv: also the libraries' (botocore, ...)")
    p.add_argument("-q", "--quiet", action="count", default=0, dest=f"quiet{suffix}",
                   help="no warnings and no progress bars (errors and results still print)")
    return p


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``deltastore`` command (every subcommand and flag)."""
    from deltastore import __version__

    parser = _Parser(prog="deltastore", parents=[_verbosity(False)],
                     description="Publish and pull model weights as verified deltas through object storage.",
                     epilog="Exit codes: 0 ok, 1 failed, 2 bad usage, 3 nothing to do, 130 interrupted. "
                            "Documentation: deltastore docs (this command line: deltastore docs cli). "
                            "DELTASTORE_DEBUG=1 shows tracebacks.")
    parser.add_argument("--version", action="version", version=f"deltastore {__version__}")
    verbosity = _verbosity(True)
    common = argparse.ArgumentParser(add_help=False, parents=[verbosity])
    common.add_argument("--endpoint-url", type=endpoint_url, metavar="URL",
                        help="S3 endpoint, e.g. http://127.0.0.1:8333 (default: AWS_ENDPOINT_URL or AWS)")
    common.add_argument("--storage-option", action="append", type=storage_option, metavar="KEY=VALUE",
                        help="backend option, repeatable; values are typed: retries=2, true/false, JSON "
                             "(e.g. profile=NAME, region_name=eu-west-1, read_timeout=30)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    trusted = (("--trusted-key",), {"action": "append", "metavar": "FILE",
               "help": "Ed25519 public key (PEM); every manifest must be signed by one (repeatable)"})

    def add(name: str, help_: str, func, parents=(common,)) -> argparse.ArgumentParser:
        p = sub.add_parser(name, parents=list(parents), help=help_, description=help_)
        p.set_defaults(func=func)
        return p

    def json_flag(p: argparse.ArgumentParser, what: str = "print the result as one JSON object") -> None:
        p.add_argument("--json", action="store_true", help=what)

    p = add("publish", "commit a .safetensors file as the next version", commands.cmd_publish)
    p.add_argument("url", help="store: ./DIR, s3://BUCKET/PREFIX, ... (a local directory is created)")
    p.add_argument("file", help="a .safetensors file")
    p.add_argument("--step", type=step_number, help="the trainer's step, recorded with the version")
    p.add_argument("--metadata", type=json_object, metavar="JSON", help="JSON object stored with the version")
    p.add_argument("--anchor", action="store_true", help="write a full snapshot (also allows a layout change)")
    p.add_argument("--anchor-every", type=positive_int, default=None, metavar="N",
                   help="a snapshot every N versions (default: once the deltas since the last snapshot reach its size)")
    p.add_argument("--signing-key", metavar="FILE", help="Ed25519 private key (PEM) to sign the manifest with")
    p.add_argument("--allow-unsigned", action="store_true",
                   help="publish without --signing-key to a store whose head version is signed (default: refused, exit 1)")
    p.add_argument("--allow-empty", action="store_true",
                   help="commit a new version even when the state is identical to the head (default: exit 3, nothing written)")
    p.add_argument("--no-takeover", action="store_true",
                   help="refuse (exit 1) instead of fencing a publisher that wrote HEAD in the last 5 minutes")
    p.add_argument("--allow-unsafe-store", action="store_true",
                   help="publish to an endpoint without working conditional writes (only if this is the store's only publisher)")
    p.add_argument("--format", action="append", dest="formats", metavar="NAME",
                   help="also publish the version in this serving format (repeatable): bf16, fp8-block128, mxfp8")
    json_flag(p)

    p = add("pull", "write a version to a .safetensors file", commands.cmd_pull)
    p.add_argument("url")
    p.add_argument("out", help="output .safetensors path (its directory must exist)")
    p.add_argument("--version", type=version_number, help="default: the latest (not with --follow)")
    p.add_argument("--follow", action="store_true",
                   help="keep OUT at the latest version (one line per version) until Ctrl-C/SIGTERM; "
                        "waits for a first version (or a local store directory) that is not there yet")
    p.add_argument("--interval", type=poll_interval, help="with --follow: seconds between polls of HEAD (default 2)")
    p.add_argument("--cache", metavar="DIR", help="with --follow: worker cache directory, to restart without refetching")
    p.add_argument("--metrics-port", type=positive_int, metavar="PORT",
                   help="with --follow: serve Prometheus metrics on this port (GET /metrics; needs deltastore-weights[metrics])")
    p.add_argument("--node-cache", metavar="DIR",
                   help="a directory shared by this host's workers: each pack is fetched once per node "
                        "(default: $DELTASTORE_NODE_CACHE, else none)")
    p.add_argument("--mirror", action="append", metavar="URL",
                   help="a mirror of the store to read from, nearest first (repeatable; the store itself is the last "
                        "source and vouches for every version: docs/fleet.md)")
    p.add_argument("--format", metavar="NAME", help="read this serving format's stream (e.g. fp8-block128) instead of the "
                                                    "versions as published")
    json_flag(p, "print the result as JSON (with --follow: one object per version)")
    p.add_argument("--max-versions", type=positive_int, help="with --follow: stop after this many versions")
    p.add_argument("--worker-id", help="with --follow: the id of this worker's heartbeat (default host-pid-random)")
    p.add_argument("--on-history-replaced", choices=("raise", "reload"),
                   help="with --follow: when HEAD names another run's history, exit 1 (raise) or load it whole (reload); "
                        "default raise with --trusted-key, else reload")
    p.add_argument(*trusted[0], **trusted[1])

    p = add("log", "list versions", commands.cmd_log)
    p.add_argument("url")
    json_flag(p, "one JSON object per version, one a line")
    p.add_argument("--plot", metavar="FILE.png",
                   help="also draw bytes per version by kind, changed fraction and anchors (needs deltastore-weights[plot])")
    p.add_argument(*trusted[0], **trusted[1])

    verify.add_parser(add, json_flag, trusted)  # the store's chain and its serving streams', its own module

    p = add("status", "head version, the fleet target and each following worker's version, stage, lag and last error",
            commands.cmd_status)
    p.add_argument("url")
    json_flag(p)
    p.add_argument(*trusted[0], **trusted[1])
    p.add_argument("--worker", metavar="ID",
                   help="a readiness probe for this worker: exit 0 when it is live and holds the fleet's goal version "
                        "(the target's, else HEAD's), else 1")
    p.add_argument("--ready-within", type=fleet.ready_within, metavar="N",
                   help="with --worker: also ready when N versions or fewer away from the goal (default 0)")
    p.checks.append(fleet.check_status_args)

    p = add("inspect", "print everything in one version's manifest", commands.cmd_inspect)
    p.add_argument("url")
    p.add_argument("--version", type=version_number, help="default: the latest")
    json_flag(p, "the manifest as read (tensors rebuilt from its layout), as JSON")
    p.add_argument(*trusted[0], **trusted[1])

    p = add("compact", "write squashed deltas to head for workers far behind", commands.cmd_compact)
    p.add_argument("url")
    p.add_argument("--base", type=version_number, action="append", metavar="V",
                   help="squash from version V (repeatable; default: versions live workers hold, and the latest anchor)")
    p.add_argument("--writer", help="the id recorded in the squashes and the index (default compactor-host-pid)")
    p.add_argument("--no-register", action="store_true", help="write the squashes without registering them in the index")
    json_flag(p, "one JSON object (with --follow: one per round, one a line)")
    p.add_argument("--follow", action="store_true",
                   help="keep compacting: one round each time HEAD's version moves, until Ctrl-C/SIGTERM "
                        "(the anchor squash every 8 versions)")
    p.add_argument("--interval", type=poll_interval, default=2.0, help="with --follow: seconds between polls of HEAD (default 2)")

    p = add("keygen", "write a new Ed25519 key pair for signing manifests", commands.cmd_keygen, parents=(verbosity,))
    p.add_argument("private_key", metavar="PRIVATE.pem", help="private key path (0600); the public key goes beside it as .pub")
    json_flag(p)

    p = add("docs", "print a document of the reference (cli, api, SPEC, gc, integrations, design/NNN, ...)",
            commands.cmd_docs, parents=())
    p.add_argument("name", nargs="?", help="the document; without one, the list")

    p = add("gc", "delete history the retention rules no longer need (SPEC §11)", commands.cmd_gc)
    p.add_argument("url")
    p.add_argument("--keep-last", type=positive_int, default=10, metavar="N", help="keep the last N versions readable (default 10)")
    p.add_argument("--keep-version", type=version_number, action="append", metavar="V", help="pin version V first (repeatable)")
    p.add_argument("--grace", type=commands.parse_duration, default=86400.0, metavar="DURATION",
                   help="never delete objects younger than this (store clock; e.g. 24h, 30m, 90s; default 24h, minimum 6h10m)")
    p.add_argument("--dry-run", action="store_true", help="report what would be deleted; write nothing but the run record")
    json_flag(p)

    p = add("pin", "keep version V through GC (recorded in the history index)", commands.cmd_pin)
    p.add_argument("url")
    p.add_argument("version", type=version_number)
    p.add_argument("--note", help="why it is pinned (kept in the index)")
    json_flag(p)

    p = add("unpin", "let GC collect a pinned version again", commands.cmd_unpin)
    p.add_argument("url")
    p.add_argument("version", type=version_number)
    json_flag(p)

    from deltastore.cli import aggregate  # federated rounds (design 009), its own module

    aggregate.add_parser(add, json_flag)
    from deltastore.cli import site  # a federated site's commands (design 009), its own module

    site.add_parser(add, json_flag)
    fleet.add_parser(add, json_flag, trusted)  # the fleet target, its own module

    from deltastore.cli import mirror  # replicating a store into another bucket, its own module

    mirror.add_parser(add, json_flag)
    return parser


def _not_our_errors(record: logging.LogRecord) -> bool:
    """Without -v, deltastore's own ERROR records are not shown: what failed reaches the user
    as the command's one error line (or verify's BAD lines); the log of it would repeat it."""
    return not (record.levelno >= logging.ERROR and record.name.startswith("deltastore"))


class _Logging:
    """The CLI's log output on stderr for one ``main`` call (undone after it, for callers in-process).

    Default: warnings. ``-v``: deltastore's own INFO and DEBUG lines (not botocore's flood).
    ``-vv``: every library's debug lines. ``-q``: errors only.
    """

    def __init__(self, verbose: int, quiet: int):
        self.root = logging.getLogger()
        self.ours = logging.getLogger("deltastore")
        self.saved = (self.root.level, self.ours.level)
        self.handler = logging.StreamHandler(sys.stderr)
        if verbose >= 1 and not quiet:
            self.handler.setFormatter(logging.Formatter("deltastore: %(levelname)s %(name)s: %(message)s"))
        else:
            self.handler.setFormatter(logging.Formatter("deltastore: %(levelname)s: %(message)s"))
        if verbose >= 2:
            root_level = logging.DEBUG
        elif quiet:
            root_level = logging.ERROR
        else:
            root_level = logging.WARNING
        self.handler.setLevel(logging.DEBUG if verbose >= 1 and not quiet else root_level)
        if not verbose:
            self.handler.addFilter(_not_our_errors)
        self.root.addHandler(self.handler)
        self.root.setLevel(root_level)
        self.ours.setLevel(logging.DEBUG if verbose >= 1 and not quiet else root_level)

    def close(self) -> None:
        self.root.removeHandler(self.handler)
        self.root.setLevel(self.saved[0])
        self.ours.setLevel(self.saved[1])


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``deltastore`` console script; returns the exit code."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help, --version (0) and usage errors (2)
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    args.verbose_total = args.verbose + getattr(args, "verbose_sub", 0)
    args.quiet_total = args.quiet + getattr(args, "quiet_sub", 0)
    log = _Logging(args.verbose_total, args.quiet_total)
    debug = os.environ.get("DELTASTORE_DEBUG", "") not in ("", "0")
    try:
        if getattr(args, "url", None) is not None:
            from deltastore.storage import check_url

            check_url(args.url)  # a malformed URL is a usage error, found before any command imports torch
        return args.func(args)
    except BrokenPipeError:
        # the reader of our output went away (`deltastore log URL | head`): not a failure; stdout
        # goes to devnull so that the interpreter's final flush does not raise again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except (DeltastoreError, OSError, ValueError, ImportError) as e:
        if debug:
            raise
        report_error(e, args)
        return exit_code_for(e)
    except KeyboardInterrupt:
        print("deltastore: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        log.close()
