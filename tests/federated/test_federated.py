"""Federated rounds (design 009, SPEC §14): based site versions, the aggregator's checks,
quorum, fencing, GC of the round's base, a site killed mid-upload."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from deltastore import Subscriber
from deltastore.errors import (
    BaseElsewhereError,
    CorruptObjectError,
    FencedError,
    QuorumError,
    SiteLayoutError,
    VersionCollectedError,
)
from deltastore.federated import (
    Aggregator,
    BasedWriter,
    RoundBase,
    Site,
    weighted_average,
)
from deltastore.format.history import History
from deltastore.format.models import BaseRef, Manifest
from deltastore.lifecycle.gc import collect
from deltastore.lifecycle.index import pinned, read_index
from deltastore.storage import open_store
from deltastore.write.policy import LayoutPolicy, WriterPolicy
from testkit.federated import initial_state, reference_merge, served, trained
from testkit.tensors import assert_bits_equal, mp_context

#: Small chunks, so that results touch some chunks of a tensor and not others.
CHUNK_BYTES = 4096
N_SITES = 3


def urls(target, n: int = N_SITES) -> tuple[str, dict[str, str]]:
    return f"{target.url}/global", {f"site-{i}": f"{target.url}/sites/site-{i}" for i in range(n)}


@pytest.fixture
def memory_target():
    import uuid

    class T:
        url = f"memory://fed-{uuid.uuid4().hex[:10]}"
        storage_options = None

    return T


def open_aggregator(global_url, sites, options=None, **kw) -> Aggregator:
    return Aggregator(global_url, sites, dtype=torch.bfloat16, storage_options=options, site_storage_options=options,
                      poll_interval_s=0.05, writer_policy=WriterPolicy(threads=2),
                      layout_policy=LayoutPolicy(chunk_bytes=CHUNK_BYTES), **kw)


def open_sites(global_url, sites, options=None) -> list[Site]:
    return [Site(global_url, u, dtype=torch.bfloat16, storage_options=options, site_storage_options=options,
                 writer_policy=WriterPolicy(threads=2))
            for u in sites.values()]


# --- the round trip ---------------------------------------------------------------------------


@pytest.mark.integration
def test_rounds_bit_exact_on_moto(moto_s3_url) -> None:
    global_url, site_urls = urls(moto_s3_url)
    opts = moto_s3_url.storage_options
    with open_aggregator(global_url, site_urls, opts) as agg:
        agg.start(initial_state())
        sites = open_sites(global_url, site_urls, opts)
        model_bytes = sum(t.numel() * t.element_size() for t in initial_state().values())
        try:
            for rnd in range(2):
                base_state = {n: t.clone() for n, t in agg.state().items()}
                results = []
                for i, s in enumerate(sites):
                    r = s.run_round(lambda w, i=i, rnd=rnd: trained(w, i, rnd), num_examples=10 * (i + 1))
                    assert r.base == agg.version
                    assert_bits_equal(s.weights, base_state)  # the site trained on the global version
                    assert r.bytes_up < model_bytes / 4, "a site uploads its change, not the model"
                    results.append(served(trained(s.weights, i, rnd)))
                report = agg.run_round()
                assert report.accepted == list(site_urls)
                weights = [10 / 60, 20 / 60, 30 / 60]
                assert [o.weight for o in report.sites] == pytest.approx(weights)
                want = reference_merge(base_state, results, weights)
                assert_bits_equal(agg.state(), want)
                with Subscriber(global_url, storage_options=opts) as sub:  # what the fleet serves
                    assert_bits_equal(sub.pull(), want)
                untouched = torch.stack([r["w"].view(torch.int16) == base_state["w"].view(torch.int16)
                                         for r in results]).all(0)
                assert untouched.sum() > 0
                assert torch.equal(want["w"].view(torch.int16)[untouched], base_state["w"].view(torch.int16)[untouched])
            for s in sites:  # every site fast-forwards to the last global version
                s.pull()
                assert_bits_equal(s.weights, agg.state())
        finally:
            for s in sites:
                s.close()


def test_site_store_is_its_own_history_and_refuses_plain_reads(memory_target) -> None:
    global_url, site_urls = urls(memory_target, 1)
    with open_aggregator(global_url, site_urls) as agg:
        agg.start(initial_state())
        (site,) = open_sites(global_url, site_urls)
        with site:
            for rnd in range(3):
                site.run_round(lambda w, rnd=rnd: trained(w, 0, rnd))
                agg.run_round()
        st = open_store(site_urls["site-0"])
        h = History(st)
        head, _ = h.read_head()
        assert head.version == 3
        _, m = h.head_manifest(head)
        assert m.base is not None and m.base.version == 3 and m.parent == 2 and m.chain_start == 3
        assert all(b.role == "d" for b in m.blobs), "a based version holds delta packs only"
        with Subscriber(site_urls["site-0"]) as sub:
            assert [i.version for i in sub.log()] == [1, 2, 3]
            with pytest.raises(BaseElsewhereError, match="based version"):
                sub.pull()
            with pytest.raises(BaseElsewhereError):
                sub.verify()
            with pytest.raises(BaseElsewhereError):
                sub.verify(all_versions=True)
        report = collect(st, keep_last=1, grace_s=1.0, unsafe_grace_ok=True)  # a site store is collected (D8)
        assert report.head_version == 3 and h.read_head()[0].manifest == head.manifest


# --- refused sites ---------------------------------------------------------------------------


def test_wrong_base_and_other_layout_refused_round_goes_on(memory_target) -> None:
    global_url, site_urls = urls(memory_target)
    with open_aggregator(global_url, site_urls) as agg:
        agg.start(initial_state())
        good = open_sites(global_url, {k: v for k, v in site_urls.items() if k != "site-2"})
        try:
            for i, s in enumerate(good):
                s.run_round(lambda w, i=i: trained(w, i, 0))
            # site-1 again, but against a base that is not the global version: another SHA-256
            base, _ = good[1].pull()
            forged = RoundBase(base.version, base.manifest.replace(base.sha256, "0" * 64), "0" * 64, base.lineage, base.specs)
            st = open_store(site_urls["site-1"])
            w = BasedWriter(st)
            w.publish(served(trained(good[1].weights, 1, 0)), forged, good[1].weights)
            w.close()
            # site-2: another layout (one more row in "b"), against the right base
            other = dict(base.specs)
            from deltastore.layout.tensors import TensorSpec

            other["b"] = TensorSpec("b", "bfloat16", (65,), 65)
            st2 = open_store(site_urls["site-2"])
            w2 = BasedWriter(st2)
            state2 = dict(good[0].weights)
            state2["b"] = torch.ones(65, dtype=torch.bfloat16)
            base2 = dict(good[0].weights)
            base2["b"] = torch.zeros(65, dtype=torch.bfloat16)  # what a site with another model computes against
            w2.publish(state2, RoundBase(base.version, base.manifest, base.sha256, base.lineage, other), base2)
            w2.close()

            report = agg.run_round(quorum=1, deadline_s=5)
            by = {o.site: o for o in report.sites}
            assert by["site-0"].status == "accepted"
            assert by["site-1"].status == "refused" and by["site-1"].error_type == "WrongBaseError"
            assert "site-1" in by["site-1"].error and "0000000000" in by["site-1"].error
            assert by["site-2"].status == "refused" and by["site-2"].error_type == "SiteLayoutError"
            assert "'b'" in by["site-2"].error
            want = reference_merge(base_stateless(good[0]), [served(trained(good[0].weights, 0, 0))], [1.0])
            assert_bits_equal(agg.state(), want)
        finally:
            for s in good:
                s.close()


def base_stateless(site: Site) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in site.weights.items()}


def test_site_helper_refuses_other_layout_before_writing(memory_target) -> None:
    global_url, site_urls = urls(memory_target, 1)
    with open_aggregator(global_url, site_urls) as agg:
        agg.start(initial_state())
        (site,) = open_sites(global_url, site_urls)
        with site:
            site.pull()
            bad = dict(site.weights)
            bad["extra"] = torch.zeros(3, dtype=torch.bfloat16)
            with pytest.raises(SiteLayoutError, match="extra"):
                site.publish_result(bad)
        h = History(open_store(site_urls["site-0"]))
        assert h.read_head()[0].version == 0, "nothing committed"


def test_corrupt_site_pack_refused_named(memory_target) -> None:
    global_url, site_urls = urls(memory_target, 2)
    with open_aggregator(global_url, site_urls) as agg:
        agg.start(initial_state())
        sites = open_sites(global_url, site_urls)
        try:
            for i, s in enumerate(sites):
                s.run_round(lambda w, i=i: trained(w, i, 0))
            st = open_store(site_urls["site-1"])
            h = History(st)
            _, m = h.head_manifest(h.read_head()[0])
            pack = m.blobs[0].key
            data = bytearray(st.get(pack))
            data[len(data) // 2] ^= 0xFF
            st.put(pack, bytes(data))
            report = agg.run_round(quorum=1, deadline_s=5)
            by = {o.site: o for o in report.sites}
            assert by["site-1"].status == "refused" and by["site-1"].error_type == "IntegrityError"
            assert "site-1" in by["site-1"].error
            assert report.accepted == ["site-0"]
        finally:
            for s in sites:
                s.close()


# --- quorum, lateness, fencing ------------------------------------------------------------------


def test_a_round_without_a_deadline_ends_at_the_default_one(memory_target, monkeypatch) -> None:
    """No deadline given: the round waits for its quorum, but never past ``Deadlines().round``."""
    import deltastore.federated.aggregator as aggregator_module
    from deltastore.fleet.deadlines import Deadlines

    monkeypatch.setattr(aggregator_module, "Deadlines", lambda: Deadlines(round=0.3))
    global_url, site_urls = urls(memory_target)
    with open_aggregator(global_url, site_urls) as agg:
        agg.start(initial_state())
        sites = open_sites(global_url, site_urls)
        try:
            sites[0].run_round(lambda w: trained(w, 0, 0))
            t0 = time.monotonic()
            with pytest.raises(QuorumError, match=r"1 of 3 sites accepted by the deadline \(0.3 s\)"):
                agg.run_round(quorum=2)
            assert time.monotonic() - t0 < 5
        finally:
            for s in sites:
                s.close()


def test_quorum_k_of_n_with_deadline_and_late_result_dropped(memory_target) -> None:
    global_url, site_urls = urls(memory_target)
    with open_aggregator(global_url, site_urls) as agg:
        agg.start(initial_state())
        sites = open_sites(global_url, site_urls)
        try:
            for i, s in enumerate(sites[:2]):
                s.run_round(lambda w, i=i: trained(w, i, 0))
            slow = sites[2]
            slow.pull()  # site-2 starts the round on version 1 and is slow
            with pytest.raises(QuorumError, match="2 of 3"):
                agg.run_round(quorum=3, deadline_s=0.3)
            h = History(agg.publisher.store)
            head, _ = h.read_head()
            assert head.version == 1, "nothing published without the quorum"
            assert 1 not in pinned(read_index(h, head)), "an abandoned round unpins its base"

            t0 = time.monotonic()
            report = agg.run_round(quorum=2, deadline_s=0.5)
            assert time.monotonic() - t0 >= 0.5, "with a deadline the round waits for every site until then"
            assert report.accepted == ["site-0", "site-1"]
            assert {o.site: o.status for o in report.sites}["site-2"] == "missing"
            # site-2's result arrives late: against version 1, while the next round is on version 2
            late = slow.publish_result(served(trained(slow.weights, 2, 0)))
            assert slow.base.version == 1 and late.version == 1
            for i, s in enumerate(sites[:2]):
                s.run_round(lambda w, i=i: trained(w, i, 1))
            report = agg.run_round(quorum=2, deadline_s=0.3)
            assert report.accepted == ["site-0", "site-1"], "a result against an older base is dropped"
            assert {o.site: o.status for o in report.sites}["site-2"] == "missing"
            r = slow.run_round(lambda w: trained(w, 2, 2))  # the late site catches up at its next round
            assert r.base == 3
        finally:
            for s in sites:
                s.close()


def test_two_aggregators_one_is_fenced(memory_target) -> None:
    global_url, site_urls = urls(memory_target, 2)
    first = open_aggregator(global_url, site_urls)
    first.start(initial_state())
    second = open_aggregator(global_url, site_urls)  # takes the global store over
    second.start()
    sites = open_sites(global_url, site_urls)
    try:
        for i, s in enumerate(sites):
            s.run_round(lambda w, i=i: trained(w, i, 0))
        with pytest.raises(FencedError):
            first.run_round()
        h = History(second.publisher.store)
        head, _ = h.read_head()
        assert head.version == 1 and 1 not in pinned(read_index(h, head))
        report = second.run_round()
        assert report.published.version == 2 and report.accepted == ["site-0", "site-1"]
    finally:
        for s in sites:
            s.close()
        first.close()
        second.close()


# --- GC -------------------------------------------------------------------------------------


def test_gc_during_a_round_keeps_the_base(tmp_path) -> None:
    global_url, site_urls = f"{tmp_path}/global", {"site-0": f"{tmp_path}/sites/site-0"}
    with open_aggregator(global_url, site_urls) as agg:
        agg.start(initial_state())
        base = agg.open_round()
        assert base.version in pinned(read_index(History(agg.publisher.store), History(agg.publisher.store).read_head()[0]))
        # something else is published during the round (an operator's anchors), then GC keeps 1
        for k in range(2):
            agg.publisher.publish(served(trained(agg.state(), 0, 10 + k)), anchor=True)
        time.sleep(1.2)
        collect(agg.publisher.store, keep_last=1, grace_s=1.0, unsafe_grace_ok=True)
        with Subscriber(global_url) as sub:
            assert_bits_equal(sub.pull(base.version), agg.state())  # the round's base survived
        agg.close_round(base)
        time.sleep(1.2)
        collect(agg.publisher.store, keep_last=1, grace_s=1.0, unsafe_grace_ok=True)
        with Subscriber(global_url) as sub, pytest.raises(VersionCollectedError):
            sub.pull(base.version)  # unpinned after the round: the pin was what kept it


# --- a site killed mid-upload ------------------------------------------------------------------


def _site_killed_mid_upload(global_url: str, site_url: str, options: dict | None) -> None:
    site = Site(global_url, site_url, dtype=torch.bfloat16, storage_options=options, site_storage_options=options)
    store = site._site_store
    real_put = store.put

    def put(key, data, **kw):
        if key.startswith("manifests/"):  # packs and layout are up; die before the manifest and HEAD
            os.kill(os.getpid(), signal.SIGKILL)
        return real_put(key, data, **kw)

    store.put = put  # type: ignore[method-assign]
    site.run_round(lambda w: trained(w, 2, 0))


@pytest.mark.slow
@pytest.mark.integration
def test_site_killed_mid_upload_is_invisible(moto_s3_url) -> None:
    global_url, site_urls = urls(moto_s3_url)
    opts = moto_s3_url.storage_options
    with open_aggregator(global_url, site_urls, opts) as agg:
        agg.start(initial_state())
        proc = mp_context().Process(target=_site_killed_mid_upload,
                                               args=(global_url, site_urls["site-2"], opts))
        proc.start()
        proc.join(timeout=120)
        assert proc.exitcode == -signal.SIGKILL
        st = open_store(site_urls["site-2"], storage_options=opts)
        assert any(k.key.endswith(".pack") for k in st.list("objects/")), "the site died after uploading packs"
        assert History(st).read_head()[0].version == 0, "nothing committed"
        sites = open_sites(global_url, {k: site_urls[k] for k in ("site-0", "site-1")}, opts)
        try:
            for i, s in enumerate(sites):
                s.run_round(lambda w, i=i: trained(w, i, 0))
            # site-2 never uploads: the round waits out the deadline for it, which must also cover
            # reading the two sites that did, on a loaded two-core CI machine too
            report = agg.run_round(quorum=2, deadline_s=4)
            assert report.accepted == ["site-0", "site-1"]
            assert {o.site: o.status for o in report.sites}["site-2"] == "missing"
        finally:
            for s in sites:
                s.close()


# --- format and merge units -------------------------------------------------------------------


def test_base_field_only_in_schema_4() -> None:
    ref = BaseRef(version=1, manifest="manifests/000000000001-" + "a" * 64 + ".json.zst", sha256="a" * 64,
                  lineage="b" * 32)
    common = dict(version=1, parent=None, parent_manifest=None, kind="delta", anchor=1, created="x", writer="w",
                  epoch=1, commit_id="c" * 32, lineage="d" * 32, chain_start=1, base=ref)
    with pytest.raises(ValueError, match="schema-4 field"):
        Manifest(schema_=3, **common)
    assert Manifest(schema_=4, **common).base == ref


def test_based_manifest_rules_checked_on_read() -> None:
    from deltastore.format.checks import check_manifest

    ref = BaseRef(version=2, manifest="manifests/000000000002-" + "a" * 64 + ".json.zst", sha256="a" * 64,
                  lineage="b" * 32)
    from deltastore.format.models import ObjectRef

    common = dict(schema_=4, version=3, parent=2, parent_manifest="manifests/000000000002-" + "e" * 64 + ".json.zst",
                  kind="delta", created="x", writer="w", epoch=1, commit_id="c" * 32, lineage="d" * 32,
                  layout=ObjectRef(key="objects/x/" + "f" * 64 + ".layout.json.zst", sha256="f" * 64))
    check_manifest(Manifest(anchor=3, chain_start=3, base=ref, **common), "k")
    with pytest.raises(CorruptObjectError, match="own chain"):
        check_manifest(Manifest(anchor=3, chain_start=2, base=ref, **common), "k")
    with pytest.raises(CorruptObjectError, match="delta_base null"):
        check_manifest(Manifest(anchor=2, chain_start=3, base=ref, **common), "k")
    bad_ref = ref.model_copy(update={"sha256": "9" * 64})
    with pytest.raises(CorruptObjectError, match="base.manifest"):
        check_manifest(Manifest(anchor=3, chain_start=3, base=bad_ref, **common), "k")


def test_weighted_average_keeps_untouched_bits() -> None:
    base = torch.tensor([-0.0, float("nan"), 1.0, 2.0, 3.0], dtype=torch.bfloat16)
    a, b = base.clone(), base.clone()
    a[2], b[2], b[3] = 1.5, 2.0, 4.0
    out = weighted_average("t", base, [a, b], [0.25, 0.75])
    assert out.view(torch.int16)[:2].tolist() == base.view(torch.int16)[:2].tolist()  # -0.0 and the NaN payload
    assert out[2].item() == pytest.approx(1.0 + 0.25 * 0.5 + 0.75 * 1.0)
    assert out[3].item() == 2.0 + 0.75 * 2.0 and out[4].item() == 3.0
    ints = torch.tensor([1, 2, 3])
    assert weighted_average("i", ints, [torch.tensor([1, 5, 3]), torch.tensor([7, 6, 3])], [0.5, 0.5]).tolist() == [7, 5, 3]
