"""``deltastore site join|publish|run``: a federated site from the command line (design 009).

A site on another machine needs nothing but its training program: ``join`` pulls the round's
global version into a ``.safetensors`` file; ``publish`` commits a trained ``.safetensors``
file as the site's result (a based version in the site store); ``run`` does both for every
round, running a training command in between::

    deltastore site run s3://b/run/global s3://b/run/sites/a --name a -- python train.py

The command gets these environment variables (and must write the output file):

- ``DELTASTORE_BASE_FILE``: the global version to train from (``.safetensors``);
- ``DELTASTORE_OUTPUT_FILE``: where to write the trained state (``.safetensors``, same
  tensor names, shapes and dtypes; floating tensors are cast to the base's dtype);
- ``DELTASTORE_METADATA_FILE``: where it may write a JSON object recorded with the result
  (e.g. ``{"num_examples": 1200}``, the site's weight in the merge);
- ``DELTASTORE_BASE_VERSION``, ``DELTASTORE_SITE``: the round's global version, the site's name.

``--compressed DENSITY`` (``publish`` and ``run``) sends compressed results instead (the opt-in
lossy tier, SPEC §14.1), keeping the error feedback in memory (``run``) and in ``--residual``.

Every wait is bounded (``--deadline``): for the next global version, and for the training
command (killed past it, nothing published). The site store is claimed on start, so a
restarted site fences its previous process (SPEC §5).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from typing import Any

from deltastore.cli.common import (
    EXIT_OK,
    emit_json,
    endpoint_url,
    json_object,
    nonnegative_int,
    open_store,
    options,
    poll_interval,
    positive_int,
    size,
    storage_option,
    version_number,
)

logger = logging.getLogger(__name__)

#: The environment variables a training command of ``site run`` is given.
ENV_BASE_FILE = "DELTASTORE_BASE_FILE"
ENV_OUTPUT_FILE = "DELTASTORE_OUTPUT_FILE"
ENV_METADATA_FILE = "DELTASTORE_METADATA_FILE"
ENV_BASE_VERSION = "DELTASTORE_BASE_VERSION"
ENV_SITE = "DELTASTORE_SITE"
#: Seconds between two looks at the global HEAD while a site waits for the next round: the
#: aggregator's own default, so a site notices a new round as soon as the aggregator would.
DEFAULT_INTERVAL_S = 2.0


def site_name(text: str) -> str:
    """``--name``: the site's name (recorded in its writer id and every result's metadata)."""
    if not text or "/" in text or "://" in text or any(c.isspace() for c in text):
        raise argparse.ArgumentTypeError(f"--name wants a plain name (no '/', spaces or URL), got {text!r}")
    return text


def _seconds(text: str) -> float:
    from deltastore.cli.commands import parse_duration

    value = parse_duration(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a deadline must be above 0")
    return value


def _common() -> argparse.ArgumentParser:
    """The options every ``site`` verb takes (as every other command's: endpoint, storage
    options, -v/-q) plus the site's name and signing key."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("-v", "--verbose", action="count", default=0, dest="verbose_sub",
                   help="-v: deltastore's own progress and debug lines; -vv: also the libraries'")
    p.add_argument("-q", "--quiet", action="count", default=0, dest="quiet_sub", help="no warnings")
    p.add_argument("--endpoint-url", type=endpoint_url, metavar="URL",
                   help="S3 endpoint, e.g. http://127.0.0.1:8333 (default: AWS_ENDPOINT_URL or AWS)")
    p.add_argument("--storage-option", action="append", type=storage_option, metavar="KEY=VALUE",
                   help="backend option for both stores, repeatable (e.g. region_name=eu-west-1)")
    p.add_argument("url", metavar="GLOBAL_URL", help="the global store (read only)")
    p.add_argument("site_url", metavar="SITE_URL",
                   help="this site's store (written by this site only; a local directory is created)")
    p.add_argument("--name", type=site_name, required=True, help="this site's name (as the aggregator's --site NAME=URL)")
    p.add_argument("--signing-key", metavar="PRIVATE.pem",
                   help="sign every result with this Ed25519 key (for an aggregator holding its public key)")
    p.add_argument("--json", action="store_true", help="one JSON object per result, one a line")
    return p


def _compression_options(p: argparse.ArgumentParser) -> None:
    """The compressed tier's options (``publish`` and ``run``)."""
    p.add_argument("--compressed", type=_density, metavar="DENSITY",
                   help="publish compressed results (lossy, opt-in; the aggregator must --accept-compressed): the "
                        "DENSITY fraction of each tensor's largest changes, e.g. 0.01, quantized to --bits, the rest "
                        "kept and sent in later rounds (error feedback)")
    p.add_argument("--bits", type=positive_int, default=2, help="bits per sent value with --compressed, 1 to 8 (default 2)")
    p.add_argument("--residual", metavar="FILE.safetensors",
                   help="with --compressed: the file that keeps the error feedback between runs (read when it exists, "
                        "rewritten after each result); without it, `publish` sends no error feedback")


def _check_compression(args: argparse.Namespace) -> None:
    if args.compressed is None and args.residual is not None:
        raise argparse.ArgumentTypeError("--residual keeps the error feedback of --compressed: pass --compressed too")
    if not 1 <= args.bits <= 8:
        raise argparse.ArgumentTypeError(f"--bits must be 1 to 8, got {args.bits}")


def _density(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"a density is in (0, 1], e.g. 0.01 for 1 %; got {text}")
    return v


def add_parser(add: Any, json_flag: Any) -> None:
    """Register ``site`` and its verbs through the CLI's ``add(name, help, func, parents)``."""
    del json_flag  # each verb has its own --json (the verbs' parents carry it)
    p = add("site", "a federated site: join a round, publish a result, or run a training command each round",
            cmd_site, parents=())
    verbs = p.add_subparsers(dest="site_command", required=True, metavar="VERB", parser_class=_command_parser(type(p)))
    common = _common()

    j = verbs.add_parser("join", parents=[common], help="pull the global version into a .safetensors file",
                         description="pull the global version (HEAD's, or --version) into a .safetensors file")
    j.add_argument("--out", metavar="FILE.safetensors", required=True, help="the file to write (replaced atomically)")
    j.add_argument("--version", type=version_number, help="the global version (default: the latest)")
    j.set_defaults(func=cmd_join)

    pb = verbs.add_parser("publish", parents=[common], help="publish a trained .safetensors file as this site's result",
                          description="publish a trained .safetensors file as this site's result on global version --base")
    pb.add_argument("file", metavar="FILE.safetensors", help="the trained state (the base's tensor names and shapes)")
    pb.add_argument("--base", type=version_number, metavar="V",
                    help="the global version the state was trained from (default: the version --base-file "
                         "records, else the latest)")
    pb.add_argument("--base-file", metavar="FILE.safetensors", help="the file `site join` wrote: its version is the base")
    pb.add_argument("--num-examples", type=positive_int, help="the site's weight in the merge")
    pb.add_argument("--metadata", type=json_object, metavar="JSON", help="a JSON object recorded with the result")
    _compression_options(pb)
    pb.checks.append(_check_compression)
    pb.set_defaults(func=cmd_publish)

    r = verbs.add_parser("run", parents=[common], help="for each round: pull, run COMMAND, publish its output",
                         usage="deltastore site run GLOBAL_URL SITE_URL --name NAME [options] -- COMMAND ...",
                         description="for each round: pull the global version, run COMMAND on it (everything after --), "
                                     "publish its output, wait for the next global version")
    r.add_argument("--rounds", type=nonnegative_int, default=0, help="rounds to run (default 0: until Ctrl-C/SIGTERM)")
    r.add_argument("--deadline", type=_seconds, metavar="DURATION",
                   help="the longest wait for the next global version, and the longest training run (default 1h)")
    r.add_argument("--interval", type=poll_interval, default=DEFAULT_INTERVAL_S,
                   help=f"seconds between looks at the global HEAD (default {DEFAULT_INTERVAL_S:g})")
    r.add_argument("--num-examples", type=positive_int, help="the site's weight (unless the command writes its own)")
    r.add_argument("--workdir", metavar="DIR", help="where the round's files go (default: a temporary directory)")
    _compression_options(r)
    r.checks.append(_check_compression)
    r.set_defaults(func=cmd_run)
    r.takes_command = True


def _command_parser(base: type) -> type:
    """The verbs' parser class: for ``run``, everything after the first ``--`` is the training
    command, taken before argparse sees it (its own ``--`` handling would mix the command's
    words with GLOBAL_URL and SITE_URL)."""

    class _Parser(base):  # type: ignore[misc, valid-type]
        takes_command = False

        def parse_known_args(self, args: Any = None, namespace: Any = None) -> tuple[argparse.Namespace, list[str]]:
            words = list(sys.argv[1:] if args is None else args)
            command: list[str] = []
            if self.takes_command and "--" in words:
                i = words.index("--")
                words, command = words[:i], words[i + 1:]
            parsed, rest = super().parse_known_args(words, namespace)
            if self.takes_command:
                if not command:
                    self.error("site run needs a training command after --, e.g. -- python train.py")
                parsed.command = command
            return parsed, rest

    return _Parser


def cmd_site(args: argparse.Namespace) -> int:  # pragma: no cover - argparse requires a verb
    raise argparse.ArgumentTypeError("deltastore site needs a verb: join, publish or run")


@contextlib.contextmanager
def _site(args: argparse.Namespace) -> Iterator[Any]:
    """A :class:`~deltastore.federated.Site` on the command line's stores (closed after)."""
    from deltastore.federated import Compression, Site
    from deltastore.write.policy import WriterPolicy

    compression = None
    if getattr(args, "compressed", None) is not None:
        # `run` keeps the error in memory between its rounds; `publish` only through --residual
        compression = Compression(density=args.compressed, bits=args.bits,
                                  error_feedback=args.residual is not None or args.site_command == "run")
    with contextlib.ExitStack() as stack:
        global_store = stack.enter_context(open_store(args))
        site_store = stack.enter_context(open_store(args, write=True, url=args.site_url))
        writer = f"site-{args.name}-{os.getpid()}"
        site = stack.enter_context(Site(args.url, args.site_url, storage_options=options(args),
                                        site_storage_options=options(args), global_store=global_store,
                                        site_store=site_store, writer_policy=WriterPolicy(writer_id=writer),
                                        signing_key=args.signing_key, compression=compression,
                                        residual_path=getattr(args, "residual", None) if compression else None))
        yield site


def _save(state: Mapping[str, Any], path: str, url: str, version: int) -> None:
    from safetensors.torch import save_file

    tmp = f"{path}.partial"
    save_file(dict(state), tmp, metadata={"deltastore_url": url, "deltastore_version": str(version)})
    os.replace(tmp, path)  # never a half-written file under the real name


def _file_version(path: str) -> int | None:
    """The ``deltastore_version`` a file written by ``site join`` (or ``pull``) records."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        meta = f.metadata() or {}
    v = meta.get("deltastore_version")
    return int(v) if v is not None and v.isdigit() else None


def _as_base(state: Mapping[str, Any], base: Mapping[str, Any], path: str, *, cast: bool = True) -> dict[str, Any]:
    """``state``'s floating tensors in the base's dtypes (a trainer may save fp32 masters);
    with ``cast`` False, as they are (the compressed tier takes the change at full precision)."""
    from deltastore.errors import SiteLayoutError

    missing = sorted(set(base) - set(state))
    extra = sorted(set(state) - set(base))
    if missing or extra:
        raise SiteLayoutError(f"{path}: its tensors are not the base's (missing {missing[:3]}, unknown {extra[:3]}); "
                              "write every tensor of the base file, with the same names")
    out = {}
    for n, t in state.items():
        b = base[n]
        out[n] = t.to(b.dtype) if cast and t.is_floating_point() and b.is_floating_point() else t
    return out


def _publish(site: Any, state: Mapping[str, Any], path: str, args: argparse.Namespace,
             metadata: Mapping[str, Any]) -> Any:
    meta = {"site": args.name, **metadata}
    n = meta.pop("num_examples", None) if "num_examples" in meta else args.num_examples
    return site.publish_result(_as_base(state, site.weights, path, cast=site.compressor is None), num_examples=n,
                               metadata=meta)


def _line(args: argparse.Namespace, doc: dict[str, Any], text: str) -> None:
    if args.json:
        emit_json(doc)
    else:
        print(text)


def cmd_join(args: argparse.Namespace) -> int:
    with _site(args) as site:
        base, down = site.pull(args.version)
        _save(site.weights, args.out, args.url, base.version)
    _line(args, {"site": args.name, "base": base.version, "out": args.out, "bytes_down": down},
          f"site {args.name}: global version {base.version} in {args.out} ({size(down)} read)")
    return EXIT_OK


def cmd_publish(args: argparse.Namespace) -> int:
    from deltastore.cli.commands import load_state

    state = load_state(args.file)  # a bad file fails before any store is opened
    version = args.base
    if version is None and args.base_file:
        version = _file_version(args.base_file)
        if version is None:
            raise ValueError(f"{args.base_file} names no deltastore version: pass --base V")
    with _site(args) as site:
        base, _ = site.pull(version)
        info = _publish(site, state, args.file, args, args.metadata or {})
    _line(args, {"site": args.name, "base": base.version, "version": info.version, "bytes_up": info.bytes_stored},
          f"site {args.name}: version {info.version} on global version {base.version} ({size(info.bytes_stored)} up)")
    return EXIT_OK


def cmd_run(args: argparse.Namespace) -> int:
    from deltastore.fleet.deadlines import Deadlines
    from deltastore.cli.commands import load_state
    from deltastore.errors import WaitTimeoutError

    limit_s = args.deadline if args.deadline is not None else Deadlines().round
    with contextlib.ExitStack() as stack:
        workdir = args.workdir or stack.enter_context(tempfile.TemporaryDirectory(prefix="deltastore-site-"))
        os.makedirs(workdir, exist_ok=True)
        site = stack.enter_context(_site(args))
        done = site.last_base()  # a restarted site does not train its last round again
        n = 0
        while args.rounds == 0 or n < args.rounds:
            end = time.monotonic() + limit_s
            while site.global_version() <= done:
                if time.monotonic() >= end:
                    raise WaitTimeoutError(f"site {args.name}: no global version after {done} in {args.url} within "
                                           f"{limit_s:g} s; is the aggregator running? (--deadline sets the wait)")
                time.sleep(min(args.interval, max(0.0, end - time.monotonic())))
            base, down = site.pull()
            files = {k: os.path.join(workdir, f"{k}.{base.version}") for k in ("base", "output", "metadata")}
            _save(site.weights, files["base"] + ".safetensors", args.url, base.version)
            out, meta_file = files["output"] + ".safetensors", files["metadata"] + ".json"
            for f in (out, meta_file):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(f)
            env = {**os.environ, ENV_BASE_FILE: files["base"] + ".safetensors", ENV_OUTPUT_FILE: out,
                   ENV_METADATA_FILE: meta_file, ENV_BASE_VERSION: str(base.version), ENV_SITE: args.name}
            logger.info("site %s: training on global version %d: %s", args.name, base.version, " ".join(args.command))
            try:
                proc = subprocess.run(args.command, env=env, timeout=limit_s, check=False)
            except subprocess.TimeoutExpired:
                raise TimeoutError(f"site {args.name}: the training command ran past --deadline ({limit_s:g} s) on "
                                   f"global version {base.version} and was killed; nothing was published") from None
            if proc.returncode != 0:
                raise RuntimeError(f"site {args.name}: the training command exited with {proc.returncode} on global "
                                   f"version {base.version}; nothing was published")
            if not os.path.exists(out):
                raise FileNotFoundError(f"site {args.name}: the training command wrote no {out} "
                                        f"(${ENV_OUTPUT_FILE}); nothing was published")
            metadata: dict[str, Any] = {}
            if os.path.exists(meta_file):
                with open(meta_file, encoding="utf-8") as f:
                    got = json.load(f)
                if not isinstance(got, dict):
                    raise ValueError(f"{meta_file} (${ENV_METADATA_FILE}) holds {type(got).__name__}, not a JSON object")
                metadata = got
            if site.global_version() != base.version:
                logger.warning("site %s: the round on global version %d closed while training; the result is late "
                               "(the aggregator drops or carries it, design 009 D5)", args.name, base.version)
            info = _publish(site, load_state(out), out, args, metadata)
            done = base.version
            n += 1
            _line(args, {"site": args.name, "base": base.version, "version": info.version, "bytes_down": down,
                         "bytes_up": info.bytes_stored},
                  f"site {args.name}: round on global version {base.version}: published version {info.version} "
                  f"({size(down)} down, {size(info.bytes_stored)} up)")
            sys.stdout.flush()
    return EXIT_OK
