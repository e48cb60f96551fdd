"""deltastore.integrations.flower: Flower rounds whose messages carry version references only.

In process: the strategy's configure/aggregate calls and the nodes' FlowerSite, over memory
stores, on the miniature round of testkit.federated (the Flower runtime itself is not started).
"""

from __future__ import annotations

import dataclasses
import uuid
from types import SimpleNamespace

import pytest
import torch

flwr_app = pytest.importorskip("flwr.app", reason="Flower is not installed (the [flower] extra)")
task_identity = pytest.importorskip("flwr.supercore.task_identity", reason="Flower is not installed")

from deltastore import Subscriber  # noqa: E402
from deltastore.integrations.flower import (  # noqa: E402
    DeltastoreFedAvg,
    FlowerSite,
    InlineFedAvg,
    VersionRef,
    arrays_to_state,
    inline_reply,
    reference_of,
    state_to_arrays,
)
from testkit.federated import initial_state, trained  # noqa: E402
from testkit.tensors import assert_bits_equal  # noqa: E402

N_SITES = 3
NODES = [101, 102, 103]


@pytest.fixture(autouse=True)
def flower_task():
    """Flower stamps messages with the running task's identity (set by its runtime)."""
    T = task_identity.TaskIdentity
    saved = (T._run_id, T._task_id, T._node_id)
    T.run_id, T.task_id, T.node_id = 7, 1, 1
    yield
    T._run_id, T._task_id, T._node_id = saved


@pytest.fixture
def run_urls():
    root = f"memory://flower-{uuid.uuid4().hex[:10]}"
    return f"{root}/global", {f"site-{i}": f"{root}/sites/site-{i}" for i in range(N_SITES)}


def grid():
    return SimpleNamespace(get_node_ids=lambda: list(NODES))


def fedavg_args():
    return dict(min_available_nodes=N_SITES, min_train_nodes=N_SITES, fraction_evaluate=0.0)


def by_node(messages):
    return {m.metadata.dst_node_id: m for m in messages}


def site_of(node: int) -> int:
    return NODES.index(node)


def test_round_through_references_is_bit_exact_and_same_as_flower_transport(run_urls):
    global_url, sites = run_urls
    init = state_to_arrays(initial_state())
    ds = DeltastoreFedAvg(global_url, sites, dtype=torch.bfloat16, **fedavg_args())
    inline = InlineFedAvg(dtype=torch.bfloat16, **fedavg_args())
    nodes = {n: FlowerSite(sites[f"site-{site_of(n)}"], name=f"site-{site_of(n)}", dtype=torch.bfloat16) for n in NODES}
    cfg = flwr_app.ConfigRecord
    try:
        arrays_ds, arrays_in = init, init
        for rnd in (1, 2):
            store, reads = ds.aggregator.publisher.store, []
            get = store.get
            store.get = lambda key, **kw: (reads.append(key), get(key, **kw))[1]
            sent = by_node(ds.configure_train(rnd, arrays_ds, cfg(), grid()))
            store.get = get
            # the strategy holds what it published: the next round reads no pack of it back
            assert rnd == 1 or not [k for k in reads if k.endswith(".pack")], reads
            sent_in = by_node(inline.configure_train(rnd, arrays_in, cfg(), grid()))
            replies, replies_in = [], []
            for node in NODES:
                msg = sent[node]
                assert not msg.content.array_records  # only a reference travels
                weights = nodes[node].pull(msg)
                flower_weights = arrays_to_state(next(iter(sent_in[node].content.array_records.values())))
                assert_bits_equal(weights, flower_weights)
                i = site_of(node)
                replies.append(nodes[node].reply(msg, trained(weights, i, rnd), num_examples=10 + i, metrics={"loss": 1.0}))
                replies_in.append(inline_reply(sent_in[node], trained(flower_weights, i, rnd), site=f"site-{i}",
                                               num_examples=10 + i, metrics={"loss": 1.0}, dtype=torch.bfloat16))
                assert not replies[-1].content.array_records
            # replies arrive in any order: the merge order is the sites'
            arrays_ds, metrics = ds.aggregate_train(rnd, list(reversed(replies)))
            arrays_in, _ = inline.aggregate_train(rnd, replies_in)

            assert metrics is not None and metrics["loss"] == pytest.approx(1.0)
            assert ds.rounds[-1].accepted == ("site-0", "site-1", "site-2") and not ds.rounds[-1].failures
        final = arrays_to_state(arrays_ds)
        assert_bits_equal(final, arrays_to_state(arrays_in))
        assert not torch.equal(final["emb"], initial_state()["emb"])
        with Subscriber(global_url) as sub:  # the global store holds exactly what was merged
            assert sub.latest().version == 3
            assert_bits_equal(sub.pull(3), final)
    finally:
        ds.close()
        for s in nodes.values():
            s.close()


def test_bad_references_drop_their_nodes_and_the_round_goes_on(run_urls):
    global_url, sites = run_urls
    ds = DeltastoreFedAvg(global_url, sites, dtype=torch.bfloat16, **fedavg_args())
    nodes = {n: FlowerSite(sites[f"site-{site_of(n)}"], name=f"site-{site_of(n)}", dtype=torch.bfloat16) for n in NODES}
    try:
        sent = by_node(ds.configure_train(1, state_to_arrays(initial_state()), flwr_app.ConfigRecord(), grid()))
        replies = {}
        for node in NODES:
            w = nodes[node].pull(sent[node])
            replies[node] = nodes[node].reply(sent[node], trained(w, site_of(node), 1), num_examples=5)

        def forged(node, **change):
            ref = dataclasses.replace(reference_of(replies[node]), **change)
            content = flwr_app.RecordDict({"deltastore": ref.to_record(),
                                           "metrics": flwr_app.MetricRecord({"num-examples": 5})})
            return flwr_app.Message(content, reply_to=sent[node])

        missing = forged(102, version=9)
        other_lineage = forged(103, lineage="0" * 32)
        other_digest = forged(103, sha256="0" * 64)
        arrays, _ = ds.aggregate_train(1, [replies[101], missing, other_lineage, other_digest])
        rnd = ds.rounds[-1]
        assert rnd.accepted == ("site-0",) and rnd.published is not None and rnd.published.version == 2
        errors = [(f.node_id, f.site, f.error_type) for f in rnd.failures]
        assert errors == [(102, "site-1", "VersionNotFoundError"), (103, "site-2", "HistoryReplacedError"),
                          (103, "site-2", "IntegrityError")]
        # the global version is site-0's result alone, bit for bit
        expect = {n: t.to(torch.bfloat16) if t.is_floating_point() else t
                  for n, t in trained(arrays_to_state(state_to_arrays(initial_state())), 0, 1).items()}
        assert_bits_equal(arrays_to_state(arrays), expect)

        # next round: a stale reference (last round's version, another base), a store outside
        # the run and an error reply are dropped; a good node still makes the round
        sent = by_node(ds.configure_train(2, arrays, flwr_app.ConfigRecord(), grid()))
        w = nodes[101].pull(sent[101])
        good = nodes[101].reply(sent[101], trained(w, 0, 2), num_examples=5)
        stale = flwr_app.Message(replies[102].content, reply_to=sent[102])
        outside = forged(103, store=global_url.replace("/global", "/elsewhere"))
        outside = flwr_app.Message(outside.content, reply_to=sent[103])
        err = flwr_app.Message(flwr_app.Error(code=0, reason="node crashed"), reply_to=sent[103])
        ds.aggregate_train(2, [good, stale, outside, err])
        rnd = ds.rounds[-1]
        assert rnd.accepted == ("site-0",) and rnd.published.version == 3
        kinds = sorted(f.error_type for f in rnd.failures)
        assert kinds == ["FlowerError", "VersionNotFoundError", "WrongBaseError"]
    finally:
        ds.close()
        for s in nodes.values():
            s.close()


def test_a_round_with_no_valid_reply_publishes_nothing(run_urls):
    global_url, sites = run_urls
    with DeltastoreFedAvg(global_url, sites, dtype=torch.bfloat16, **fedavg_args()) as ds:
        sent = by_node(ds.configure_train(1, state_to_arrays(initial_state()), flwr_app.ConfigRecord(), grid()))
        junk = flwr_app.Message(flwr_app.RecordDict({"deltastore": flwr_app.ConfigRecord({"store": sites["site-0"]})}),
                                reply_to=sent[101])
        assert ds.aggregate_train(1, [junk]) == (None, None)
        assert ds.rounds[-1].published is None and ds.rounds[-1].failures[0].error_type == "FormatError"
        assert ds.current().version == 1


def test_raw_arrays_round_trip_every_dtype_bit_for_bit():
    state = {"bf": torch.tensor([1.0, -0.0, float("nan")], dtype=torch.bfloat16),
             "i": torch.arange(6, dtype=torch.int64).reshape(2, 3), "e": torch.empty(0, 4)}
    back = arrays_to_state(state_to_arrays(state))
    assert_bits_equal(back, state)
    ref = VersionRef("memory://x", 3, "manifests/k", "a" * 64, "b" * 32)
    assert VersionRef.from_record(ref.to_record()) == ref


def test_signed_sites_and_compressed_results_through_flower(run_urls, tmp_path):
    """site_keys: site-0 signs with its key and is merged; site-1 signs with another key and
    site-2 does not sign: both dropped as SignatureError. accept_compressed: a compressed reply
    is dropped (CompressedVersionError) unless the strategy accepts it, then merged exactly."""
    from deltastore.federated import Compression, Compressor, ResultPolicy
    from deltastore.format.signing import generate_key_files

    global_url, sites = run_urls
    keys = {i: generate_key_files(tmp_path / f"site-{i}.pem") for i in range(3)}
    trusted = {f"site-{i}": [keys[i][1]] for i in range(2)} | {"site-2": [keys[2][1]]}
    signer = {101: keys[0][0], 102: keys[2][0], 103: None}  # site-1 signs with site-2's key
    nodes = {n: FlowerSite(sites[f"site-{site_of(n)}"], name=f"site-{site_of(n)}", dtype=torch.bfloat16,
                           signing_key=signer[n]) for n in NODES}
    with pytest.raises(ValueError, match="no site"):
        DeltastoreFedAvg(global_url, sites, results=ResultPolicy(site_keys={"site-9": [keys[0][1]]}), **fedavg_args())
    try:
        with DeltastoreFedAvg(global_url, sites, dtype=torch.bfloat16, results=ResultPolicy(site_keys=trusted),
                              **fedavg_args()) as ds:
            sent = by_node(ds.configure_train(1, state_to_arrays(initial_state()), flwr_app.ConfigRecord(), grid()))
            replies = [nodes[n].reply(sent[n], trained(nodes[n].pull(sent[n]), site_of(n), 1), num_examples=5)
                       for n in NODES]
            ds.aggregate_train(1, replies)
            rnd = ds.rounds[-1]
            assert rnd.accepted == ("site-0",)
            assert [(f.site, f.error_type) for f in rnd.failures] == [("site-1", "SignatureError"),
                                                                     ("site-2", "SignatureError")]
    finally:
        for s in nodes.values():
            s.close()

    comp = Compression(density=0.05)
    global_url = global_url.replace("/global", "/global-c")
    site = FlowerSite(sites["site-0"].replace("site-0", "c-0"), name="site-0", dtype=torch.bfloat16, compression=comp)
    try:
        for accept in (False, True):
            with DeltastoreFedAvg(global_url, {"site-0": site.site_url}, dtype=torch.bfloat16,
                                  results=ResultPolicy(accept_compressed=accept), min_available_nodes=1, min_train_nodes=1,
                                  fraction_evaluate=0.0) as ds:
                g1 = SimpleNamespace(get_node_ids=lambda: [101])
                sent = by_node(ds.configure_train(1, state_to_arrays(initial_state()), flwr_app.ConfigRecord(), g1))
                w = site.pull(sent[101])
                mirror = Compressor(comp)
                mirror.load_state_dict(site.compressor.state_dict())
                expect = mirror.compress(trained(w, 0, 1), w)
                arrays, _ = ds.aggregate_train(1, [site.reply(sent[101], trained(w, 0, 1), num_examples=5)])
                rnd = ds.rounds[-1]
                if accept:
                    assert rnd.accepted == ("site-0",) and not rnd.failures
                    assert_bits_equal(arrays_to_state(arrays), expect)
                else:
                    assert arrays is None and [f.error_type for f in rnd.failures] == ["CompressedVersionError"]
    finally:
        site.close()
