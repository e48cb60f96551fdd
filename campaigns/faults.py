"""Faults campaign: publish through a fault-injecting proxy; compare each outcome with HEAD.

A publisher (and worker processes) reach the server through :class:`testkit.proxy.FaultProxy`
injecting 500/503, 409 ConditionalRequestConflict, resets, truncated bodies, slow responses and
dropped responses after a request landed, at ``--rate`` (default 10%, all kinds mixed). After
each publish the oracle reads HEAD directly:

- the publish returned a version → HEAD's chain must hold it with our step;
- the publish raised → HEAD must not have moved to our commit (a wrong error otherwise: the
  version committed but the trainer was told it failed);
- an error that is not a DeltastoreError is a wrong error; so is, with one publisher, a
  ConflictError naming itself or a create-only clash (PreconditionFailedError) on its own
  content-addressed write: both can only come from its own earlier attempt.

After a failed publish the trainer goes on with its next step; after two failures in a row, or a
FencedError, it reopens its Publisher (as a restarted trainer would). With ``--format-churn N``
(and ``--formats``) the trainer also reopens it every N steps declaring, in turn, every format
and every format but the first, which the workers read: they keep serving that format's last
version through each pause and move to its new chain after it. At the end every committed
version must read back bit-exact and every acknowledged publish must be on the chain.

Trials = publishes.  ``python -m campaigns.faults --backend seaweedfs --trials 200 --rate 0.1``
"""

from __future__ import annotations

import json
import os
import time
import traceback
from typing import Any

from campaigns.common import (
    ChainChecker,
    Followers,
    Tally,
    campaign_options,
    committed_as_asked,
    fresh_url,
    grid_tensors,
    main,
    mp_context,
    parser,
    scratch_dir,
    verify_versions,
)
from testkit.proxy import FAULT_KINDS, OFF, FaultPlan, FaultProxy

#: Snapshots every few versions, so faults also hit anchors.
ANCHOR_EVERY = 5
#: Failed publishes in a row after which the trainer reopens its Publisher.
REOPEN_AFTER_FAILURES = 2


def _head(store: Any) -> dict[str, Any] | None:
    from deltastore.errors import NotFoundError

    try:
        return json.loads(store.get("HEAD"))
    except NotFoundError:
        return None


def run(server: Any, args: Any) -> Tally:
    from campaigns.model import CHUNK_BYTES, Model, Oracle, serving_formats, with_layout
    from deltastore import ConflictError, DeltastoreError, FencedError, PreconditionFailedError, Publisher
    from deltastore.errors import IntegrityError
    from deltastore.storage import open_store
    from deltastore.write.policy import AnchorPolicy, LayoutPolicy, WriterPolicy

    tally = Tally("faults", server.kind)
    if args.sdk_checksums:
        os.environ["AWS_REQUEST_CHECKSUM_CALCULATION"] = args.sdk_checksums  # read by botocore per client
    mix = {k: 1.0 for k in (args.kinds.split(",") if args.kinds else FAULT_KINDS)}
    methods = frozenset(args.methods.split(",")) if args.methods else None
    plan = FaultPlan(rate=args.rate, mix=mix, methods=methods, key_pattern=args.key_pattern,
                     slow_s=args.slow, seed=args.seed)  # fmt: skip
    oracle = Oracle(args.seed)
    formats = serving_formats(args.formats)
    model = Model(args.seed)
    url = fresh_url(server, "faults")
    direct = campaign_options(server)
    t0 = time.monotonic()
    acked: dict[int, int] = {}
    with scratch_dir() as work, FaultProxy(server.endpoint_url, OFF) as proxy, open_store(url, storage_options=direct) as store:
        faulty = campaign_options(server, proxy.endpoint_url)
        checker = ChainChecker(store, tally)
        pub = None
        followers = None
        failures = 0
        declared = formats
        proxy.set_plan(plan)
        for step in range(args.trials):
            if args.format_churn and formats and step and step % args.format_churn == 0:
                declared = formats[1:] if declared == formats else formats
                tally.extra["format_churns"] = tally.extra.get("format_churns", 0) + 1
                if pub is not None:
                    pub.close()
                    pub = None
            if pub is None:
                try:
                    pub = with_layout(Publisher(url, storage_options=faulty,
                                                writer_policy=WriterPolicy(threads=1, takeover=True),
                                                anchor_policy=AnchorPolicy(every=ANCHOR_EVERY),
                                                layout_policy=LayoutPolicy(chunk_bytes=CHUNK_BYTES),
                                                formats=declared), args.grid)  # fmt: skip
                except DeltastoreError as e:
                    tally.error(f"open {type(e).__name__}")
                    pub = None
                except Exception as e:  # noqa: BLE001
                    tally.wrong(f"open raised {type(e).__name__}", "".join(traceback.format_exception_only(type(e), e)).strip())
            before = _head(store)
            error: BaseException | None = None
            info = None
            if pub is not None:
                try:
                    info = pub.publish(model.state(step), step=step)
                except Exception as e:  # noqa: BLE001 - classified below
                    error = e
            tally.trials += 1
            try:
                after = _head(store)
            except IntegrityError as e:  # the store is stuck: nothing after this trial would be judged fairly
                tally.violation("HEAD unreadable", f"step {step}: after a publish that "
                                f"{'raised ' + type(error).__name__ if error else 'returned'}: {' '.join(str(e).split())[:300]}")
                break
            links = checker.check()
            ours = next((l for l in reversed(links) if l.step == step), None)
            if info is not None:
                failures = 0
                if committed_as_asked(oracle, tally, step, info.version, info.step):
                    acked[step] = info.version
                if step in acked and (ours is None or ours.version != info.version):  # counted once, at the end
                    tally.note("acknowledged publish not on the chain at once", f"step {step}: returned version {info.version}; the chain has {ours}")
            elif error is not None:
                failures += 1
                tally.error(error)
                name = type(error).__name__
                tally.note(f"publish {name}", f"step {step}: {' '.join(str(error).split())[:300]}")
                if isinstance(error, ConflictError) and not isinstance(error, FencedError) and error.head_writer == pub.writer_id:
                    # One publisher: a conflict can only be with its own earlier commit (D3/D4).
                    tally.wrong("ConflictError naming itself", f"step {step}: {error}")
                if isinstance(error, PreconditionFailedError):
                    # One publisher, content-addressed keys: a create-only clash is with our own
                    # earlier attempt (an SDK retry after a lost response, D2) or a 409 (D4).
                    tally.wrong(f"spurious {name} on its own write", f"step {step}: {error}")
                if not isinstance(error, DeltastoreError):
                    tally.wrong(f"untyped {name}", "".join(traceback.format_exception_only(type(error), error)).strip())
                if ours is not None:
                    tally.wrong(f"committed but raised {name}", f"step {step} is version {ours.version}, publish raised {name}: {error}")
                elif before != after and after is not None and (before or {}).get("version") != after.get("version"):
                    tally.wrong(f"raised {name} but HEAD moved", f"step {step}: HEAD {before and before.get('version')} -> {after.get('version')}")
                if isinstance(error, FencedError) or failures >= REOPEN_AFTER_FAILURES:
                    pub.close()
                    pub = None
            if followers is None and links:
                followers = Followers(mp_context(), url, faulty, args.seed, args.workers, work, fmt=(formats or (None,))[0])
        if pub is not None:
            pub.close()
        proxy.set_plan(OFF)
        if followers is not None:
            time.sleep(0.5)
            followers.stop(tally)
        tally.faults.update(proxy.snapshot())
        tally.extra["faults_by_method"] = dict(proxy.by_method)
        tally.extra["requests"] = proxy.requests
        try:
            final = checker.check(full=True)
        except IntegrityError as e:  # HEAD left damaged: reported, nothing more to judge on this store
            tally.violation("HEAD unreadable", f"at the end: {' '.join(str(e).split())[:300]}")
            tally.seconds = time.monotonic() - t0
            return tally
        tally.extra["grid_tensors"] = grid_tensors(store, final[-1]) if final else {}
        unreadable = verify_versions(store, final, oracle, tally, formats=formats)
    on_chain = {l.step: l.version for l in final}
    for step, version in acked.items():
        if on_chain.get(step) != version and version not in unreadable:  # each loss counted once
            tally.lost(f"publish of step {step} returned version {version}; at the end the chain has {on_chain.get(step)}")
    steps = [l.step for l in final]
    if len(steps) != len(set(steps)):
        tally.wrong("step committed twice", f"{len(steps) - len(set(steps))} duplicate steps on the chain")
    tally.seconds = time.monotonic() - t0
    tally.extra.update(versions_committed=len(final), acked_publishes=len(acked),
                       seconds_per_trial=round(tally.seconds / max(1, tally.trials), 3))  # fmt: skip
    return tally


def build_parser():
    p = parser("faults", 200, __doc__ or "")
    p.add_argument("--rate", type=float, default=0.10, help="fault probability per request (default 0.10)")
    p.add_argument("--kinds", help=f"comma-separated subset of {','.join(FAULT_KINDS)} (default: all)")
    p.add_argument("--methods", help="fault only these HTTP methods, e.g. PUT")
    p.add_argument("--key-pattern", help="fault only paths matching this regex, e.g. /HEAD$")
    p.add_argument("--slow", type=float, default=0.3, help="delay of a slow response, s")
    p.add_argument("--workers", type=int, default=1, help="worker processes pulling through the proxy")
    p.add_argument("--format-churn", type=int, default=0, metavar="N",
                   help="with --formats: reopen the publisher every N steps declaring, in turn, every format and "
                        "every format but the first (the workers'); 0: never (default)")
    p.add_argument("--sdk-checksums", choices=["when_supported", "when_required"],
                   help="botocore's request checksums (AWS_REQUEST_CHECKSUM_CALCULATION); when_required turns "
                        "them off for PutObject, so only deltastore's own checks can catch a flipped body")  # fmt: skip
    return p


if __name__ == "__main__":
    raise SystemExit(main("faults", run, build_parser()))
