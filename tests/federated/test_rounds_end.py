"""Rounds that end (design 009 D5, D9, D10): a round never waits past its deadline plus one poll
interval, a site killed mid-upload neither blocks nor corrupts a round, late results are
dropped or carried by the stated rule, signed site versions, and GC of a site store."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
import torch

from deltastore.errors import QuorumError
from deltastore.federated import Aggregator, LatePolicy, ResultPolicy, Site
from deltastore.format.history import History
from deltastore.lifecycle.gc import collect
from deltastore.storage import open_store
from deltastore.write.policy import LayoutPolicy, WriterPolicy
from testkit.federated import initial_state, reference_merge, served, trained
from testkit.tensors import assert_bits_equal

CHUNK_BYTES = 4096
#: Poll interval of these rounds: the bound under test is deadline + this.
POLL_S = 0.2


def _urls(n: int = 3, root: str | None = None) -> tuple[str, dict[str, str]]:
    root = root or f"memory://rounds-{uuid.uuid4().hex[:10]}"
    return f"{root}/global", {f"site-{i}": f"{root}/sites/site-{i}" for i in range(n)}


def _aggregator(global_url: str, sites: dict[str, str], **kw) -> Aggregator:
    return Aggregator(global_url, sites, dtype=torch.bfloat16, poll_interval_s=POLL_S,
                      writer_policy=WriterPolicy(threads=1), layout_policy=LayoutPolicy(chunk_bytes=CHUNK_BYTES), **kw)


def _site(global_url: str, site_url: str, **kw) -> Site:
    return Site(global_url, site_url, dtype=torch.bfloat16, writer_policy=WriterPolicy(threads=1), **kw)


def _current(agg: Aggregator) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in agg.state().items()}


class _Stall:
    """Makes a store's reads hang until released: a site whose endpoint stopped answering."""

    def __init__(self, store):
        self.release = threading.Event()
        for name in ("get", "get_if_changed", "get_with_meta", "head"):
            real = getattr(store, name)

            def stalled(*a, _real=real, **k):
                self.release.wait(30)
                return _real(*a, **k)

            setattr(store, name, stalled)


# --- deadlines --------------------------------------------------------------------------------


@pytest.mark.parametrize("deadline_s", [0.3, None])
def test_a_stalled_site_never_holds_a_round_past_its_deadline(monkeypatch, deadline_s) -> None:
    """One site's store hangs on every read. With a deadline the round publishes from the
    others at the deadline; without one it ends at ``Deadlines().round``; either way within
    the deadline plus one poll interval."""
    import deltastore.federated.aggregator as aggregator_module
    from deltastore.fleet.deadlines import Deadlines

    monkeypatch.setattr(aggregator_module, "Deadlines", lambda: Deadlines(round=0.3))
    global_url, site_urls = _urls()
    stuck = open_store(site_urls["site-2"])
    stall = _Stall(stuck)
    try:
        with _aggregator(global_url, site_urls, site_stores={"site-2": stuck}) as agg:
            agg.start(initial_state())
            sites = [_site(global_url, site_urls[f"site-{i}"]) for i in range(2)]
            try:
                for i, s in enumerate(sites):
                    s.run_round(lambda w, i=i: trained(w, i, 0))
                base = _current(agg)
                t0 = time.monotonic()
                if deadline_s is None:
                    with pytest.raises(QuorumError, match="2 of 3 sites accepted by the deadline"):
                        agg.run_round()  # all three wanted: the stalled one never answers
                    waited = time.monotonic() - t0
                else:
                    with _site(global_url, site_urls["site-2"]) as slow:  # its result lands; the stalled read hangs on
                        slow.run_round(lambda w: trained(w, 2, 0))
                    report = agg.run_round(quorum=2, deadline_s=deadline_s)
                    waited = report.collect_s
                    assert report.accepted == ["site-0", "site-1"]
                    assert {o.site: o.status for o in report.sites}["site-2"] == "missing"
                    results = [served(trained(base, i, 0)) for i in range(2)]
                    assert_bits_equal(agg.state(), reference_merge(base, results, [0.5, 0.5]))
                assert 0.3 <= waited < 0.3 + POLL_S, f"the round waited {waited:.3f} s"
                if deadline_s is not None:
                    # the stalled read answers during the next round: its answer (site-2 on
                    # version 1) belongs to the closed round and is not merged into this one
                    stall.release.set()
                    base = _current(agg)
                    for i, s in enumerate(sites):
                        s.run_round(lambda w, i=i: trained(w, i, 1))
                    report = agg.run_round(quorum=2, deadline_s=0.2)
                    assert report.accepted == ["site-0", "site-1"]
                    assert [(o.site, o.status) for o in report.late] == [("site-2", "dropped")]
                    results = [served(trained(base, i, 1)) for i in range(2)]
                    assert_bits_equal(agg.state(), reference_merge(base, results, [0.5, 0.5]))
            finally:
                for s in sites:
                    s.close()
    finally:
        stall.release.set()


def test_a_site_killed_mid_upload_never_blocks_or_corrupts_a_round() -> None:
    """site-2 dies after uploading its packs, before its manifest and HEAD; then its restarted
    process leaves a torn pack behind too. The round merges the others at its deadline, bit
    for bit, and the restarted site is accepted the round after."""
    global_url, site_urls = _urls()

    class Killed(BaseException):
        """Stands in for SIGKILL: nothing after it runs in the site."""

    with _aggregator(global_url, site_urls) as agg:
        agg.start(initial_state())
        sites = [_site(global_url, site_urls[f"site-{i}"]) for i in range(3)]
        try:
            store = sites[2]._site_store
            real_put = store.put

            def put(key, data, **kw):
                if key.startswith("manifests/"):
                    raise Killed()
                return real_put(key, data, **kw)

            store.put = put
            with pytest.raises(Killed):
                sites[2].run_round(lambda w: trained(w, 2, 0))
            store.put = real_put
            assert any(m.key.endswith(".pack") for m in store.list("objects/")), "its packs were uploaded"
            store.put("objects/torn/" + "0" * 64 + ".pack", b"\x28\xb5\x2f")  # a half-written object
            for i, s in enumerate(sites[:2]):
                s.run_round(lambda w, i=i: trained(w, i, 0))
            base = _current(agg)
            report = agg.run_round(quorum=2, deadline_s=0.3)
            assert report.collect_s < 0.3 + POLL_S
            assert {o.site: o.status for o in report.sites} == {"site-0": "accepted", "site-1": "accepted",
                                                                "site-2": "missing"}
            assert_bits_equal(agg.state(), reference_merge(base, [served(trained(base, i, 0)) for i in range(2)], [0.5, 0.5]))

            sites[2].close()
            sites[2] = _site(global_url, site_urls["site-2"])  # restarted: takes its store over
            base = _current(agg)
            for i, s in enumerate(sites):
                s.run_round(lambda w, i=i: trained(w, i, 1))
            report = agg.run_round()
            assert report.accepted == ["site-0", "site-1", "site-2"]
            assert_bits_equal(agg.state(), reference_merge(base, [served(trained(base, i, 1)) for i in range(3)], [1 / 3] * 3))
        finally:
            for s in sites:
                s.close()


# --- late results -----------------------------------------------------------------------------


def _late_round(agg: Aggregator, sites: list[Site]) -> tuple[dict, dict]:
    """Round 1: site-2 is slow, the round closes without it; its result on version 1 lands
    after. Returns (version 1's state, site-2's late result)."""
    for i, s in enumerate(sites[:2]):
        s.run_round(lambda w, i=i: trained(w, i, 0))
    sites[2].pull()
    old = _current(agg)
    agg.run_round(quorum=2, deadline_s=0.2)
    late = served(trained(sites[2].weights, 2, 0))
    sites[2].publish_result(late)
    return old, late


def test_late_result_dropped_by_default_and_reported() -> None:
    global_url, site_urls = _urls()
    with _aggregator(global_url, site_urls) as agg:
        assert agg.late == LatePolicy("drop")
        agg.start(initial_state())
        sites = [_site(global_url, u) for u in site_urls.values()]
        try:
            _late_round(agg, sites)
            base = _current(agg)
            for i, s in enumerate(sites[:2]):
                s.run_round(lambda w, i=i: trained(w, i, 1))
            report = agg.run_round(quorum=2, deadline_s=0.2)
            assert [(o.site, o.status, o.version, o.base) for o in report.late] == [("site-2", "dropped", 1, 1)]
            assert report.to_json()["late_policy"] == "drop" and report.to_json()["late"][0]["status"] == "dropped"
            assert_bits_equal(agg.state(), reference_merge(base, [served(trained(base, i, 1)) for i in range(2)], [0.5, 0.5]))
        finally:
            for s in sites:
                s.close()


@pytest.mark.parametrize("restart", [False, True], ids=["same-aggregator", "restarted-aggregator"])
def test_late_result_carried_with_staleness_weight(restart: bool) -> None:
    """Carry: site-2's late change (on version 1) is moved onto version 2 and merged at half
    weight with the three fresh results; its fresh result (published just after the late one,
    so HEAD never showed the late one) counts too. An aggregator restarted between the rounds
    reads the previous round back from the global store and carries it the same way."""
    global_url, site_urls = _urls()
    agg = _aggregator(global_url, site_urls, late=LatePolicy("carry", weight=0.5))
    sites = [_site(global_url, u) for u in site_urls.values()]
    try:
        agg.start(initial_state())
        old, late = _late_round(agg, sites)
        if restart:
            agg.close()
            agg = _aggregator(global_url, site_urls, late=LatePolicy("carry", weight=0.5))
            assert agg.start() == 2
        base = _current(agg)
        fresh = []
        for i, s in enumerate(sites):
            s.run_round(lambda w, i=i: trained(w, i, 1))
            fresh.append(served(trained(base, i, 1)))
        report = agg.run_round()
        assert report.accepted == ["site-0", "site-1", "site-2"]
        assert [(o.site, o.status, o.version, o.base) for o in report.late] == [("site-2", "carried", 1, 1)]
        assert report.late[0].weight == pytest.approx(0.5 / 3.5)
        # the late change, moved onto version 2 element by element, independently of the code
        moved = {}
        for n, b in base.items():
            if b.is_floating_point():
                changed = late[n].view(torch.int16) != old[n].view(torch.int16)
                shifted = (b.float() + (late[n].float() - old[n].float())).to(b.dtype)
                moved[n] = torch.where(changed, shifted, b)
            else:
                moved[n] = torch.where(late[n] != old[n], late[n], b)
        assert any(not torch.equal(moved[n], base[n]) for n in base), "the late result changed something"
        expected = reference_merge(base, [*fresh, moved], [1 / 3.5, 1 / 3.5, 1 / 3.5, 0.5 / 3.5])
        assert_bits_equal(agg.state(), expected)
        head, _ = History(agg.publisher.store).read_head()
        meta = History(agg.publisher.store).head_manifest(head)[1].metadata["federated"]
        assert meta["carried"] == {"site-2": 1}
    finally:
        for s in sites:
            s.close()
        agg.close()


def test_restarted_aggregator_recognises_the_previous_rounds_results() -> None:
    """Drop: after a restart, site-2's late result is reported as dropped (not taken for a
    result of the open round), and the merged sites' results of the previous round are not
    reported as late."""
    global_url, site_urls = _urls()
    sites = [_site(global_url, u) for u in site_urls.values()]
    try:
        with _aggregator(global_url, site_urls) as agg:
            agg.start(initial_state())
            _late_round(agg, sites)
        with _aggregator(global_url, site_urls) as agg:
            agg.start()
            base = _current(agg)
            for i, s in enumerate(sites[:2]):
                s.run_round(lambda w, i=i: trained(w, i, 1))
            report = agg.run_round(quorum=2, deadline_s=0.2)
            assert [(o.site, o.status, o.version, o.base) for o in report.late] == [("site-2", "dropped", 1, 1)]
            assert report.accepted == ["site-0", "site-1"]
            assert_bits_equal(agg.state(), reference_merge(base, [served(trained(base, i, 1)) for i in range(2)], [0.5, 0.5]))
    finally:
        for s in sites:
            s.close()


def test_late_policy_is_checked() -> None:
    with pytest.raises(ValueError, match="mode"):
        LatePolicy("rebase")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="weight"):
        LatePolicy("carry", weight=0.0)


# --- signed site versions ------------------------------------------------------------------------


def test_unsigned_and_wrongly_signed_site_versions_refused_round_goes_on() -> None:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    a, b, c = (Ed25519PrivateKey.generate() for _ in range(3))
    global_url, site_urls = _urls(4)
    keys = {"site-0": [a.public_key()], "site-1": [b.public_key()], "site-2": [b.public_key()]}
    with pytest.raises(ValueError, match="site-9"):
        _aggregator(global_url, site_urls, results=ResultPolicy(site_keys={"site-9": [a.public_key()]}))
    with _aggregator(global_url, site_urls, results=ResultPolicy(site_keys=keys)) as agg:
        agg.start(initial_state())
        signing = {"site-0": a, "site-1": None, "site-2": c, "site-3": None}  # site-3: no keys configured
        sites = [_site(global_url, site_urls[n], signing_key=k) for n, k in signing.items()]
        try:
            for i, s in enumerate(sites):
                s.run_round(lambda w, i=i: trained(w, i, 0))
            base = _current(agg)
            # with a deadline the round waits for every site's answer (all four answer at once):
            # without one it would close at its quorum, perhaps before a refused site was read
            report = agg.run_round(quorum=2, deadline_s=60)
            by = {o.site: o for o in report.sites}
            assert report.accepted == ["site-0", "site-3"]
            assert (by["site-1"].status, by["site-1"].error_type) == ("refused", "SignatureError")
            assert "not signed" in by["site-1"].error
            assert (by["site-2"].status, by["site-2"].error_type) == ("refused", "SignatureError")
            assert "not trusted" in by["site-2"].error
            results = [served(trained(base, i, 0)) for i in (0, 3)]
            assert_bits_equal(agg.state(), reference_merge(base, results, [0.5, 0.5]))
        finally:
            for s in sites:
                s.close()


# --- GC of a site store -------------------------------------------------------------------------


def test_gc_of_a_site_store_keeps_what_the_round_needs(tmp_path) -> None:
    global_url, site_urls = _urls(1, str(tmp_path))
    with _aggregator(global_url, site_urls) as agg:
        agg.start(initial_state())
        with _site(global_url, site_urls["site-0"]) as site:
            for r in range(3):
                site.run_round(lambda w, r=r: trained(w, 0, r))
                agg.run_round()
            site.run_round(lambda w: trained(w, 0, 3))  # the open round's result, not yet read
            st = site._site_store
            before = {m.key for m in st.list("")}
            report = collect(st, keep_last=1, keep_versions=[1], grace_s=0.0, unsafe_grace_ok=True)
            assert report.head_version == 4 and report.floor_after == 4 and report.pins == [1]
            after = {m.key for m in st.list("")}
            gone = before - after
            assert any(k.startswith("manifests/000000000002-") for k in gone)
            assert any(k.startswith("manifests/000000000003-") for k in gone)
            assert any(k.endswith(".pack") for k in gone)
            h = History(st)
            for v in (1,):  # the pinned version: its manifest and every pack it lists are kept
                key = next(k for k in after if k.startswith(f"manifests/{v:012d}-"))
                assert set(h.manifest(key).references()) <= after
            base = _current(agg)
            report = agg.run_round()  # the head version survived: the round reads it
            assert report.accepted == ["site-0"]
            assert_bits_equal(agg.state(), reference_merge(base, [served(trained(base, 0, 3))], [1.0]))
            base = _current(agg)
            site.run_round(lambda w: trained(w, 0, 4))  # and later rounds go on
            agg.run_round()
            assert_bits_equal(agg.state(), reference_merge(base, [served(trained(base, 0, 4))], [1.0]))
