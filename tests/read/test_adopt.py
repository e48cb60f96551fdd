"""``Subscriber.adopt``: a subscriber holds a version with bits a target already has, every
chunk checked against its digest, no pack fetched; it then fast-forwards from there. A chunk
that does not match, a wrong layout, a subscriber that holds a version or selects a part: a
typed error, nothing held."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deltastore import LayoutMismatchError, Subscriber, TargetModifiedError
from deltastore.layout.select import Selection
from deltastore.read.follow import PollPolicy
from deltastore.storage import open_store
from testkit.stores import WrappedStore, publish_history
from testkit.tensors import assert_bits_equal


@pytest.fixture
def store(tmp_path: Path) -> tuple[str, list[dict[str, torch.Tensor]]]:
    url = str(tmp_path / "store")
    return url, publish_history(url, n=4)


def _pulled(url: str, version: int) -> dict[str, torch.Tensor]:
    with Subscriber(url) as sub:
        return sub.pull(version)


def _packs_read(store: WrappedStore) -> list[str]:
    return [k for k, _ in store.reads if k.endswith(".pack")]


def test_a_target_of_the_version_is_adopted_without_a_pack_then_fast_forwarded(store) -> None:
    url, states = store
    target = _pulled(url, 2)
    counting = WrappedStore(open_store(url))
    with Subscriber(url, store=counting) as sub:
        info = sub.adopt(target, 2)
        assert (info.version, sub.version, _packs_read(counting)) == (2, 2, [])
        assert sub.pull_into(target).version == 4
        assert_bits_equal(target, states[-1])
        # only the deltas since version 2: less than a whole load reads
        delta_bytes = sub.bytes_fetched
    with Subscriber(url) as whole:
        whole.pull()
        assert 0 < delta_bytes < whole.bytes_fetched


def test_follow_goes_on_from_the_adopted_version(store) -> None:
    url, states = store
    target = _pulled(url, 3)
    with Subscriber(url) as sub:
        assert sub.adopt(target, 3).version == 3
        rec = next(sub.follow(target, poll=PollPolicy(interval=0.01), heartbeat=None, max_versions=1))
    assert (rec.info.version, rec.from_version, rec.full_load) == (4, 3, False)
    assert_bits_equal(target, states[-1])


def test_the_latest_version_by_default_and_a_module_target(store) -> None:
    url, states = store
    module = torch.nn.Module()
    for name, t in _pulled(url, 4).items():
        module.register_buffer(name, t)
    with Subscriber(url) as sub:
        assert sub.adopt(module).version == 4 and sub.pull_into(module) is None
    assert_bits_equal(dict(module.state_dict()), states[-1])


def test_a_chunk_that_differs_is_named_and_nothing_is_held(store) -> None:
    url, states = store
    target = _pulled(url, 2)
    name = sorted(target)[1]
    target[name].view(-1)[-1] += 1
    with Subscriber(url) as sub:
        with pytest.raises(TargetModifiedError, match=rf"tensor {name!r} chunk \d+ does not match its digest"):
            sub.adopt(target, 2)
        assert sub.version is None
        assert sub.pull_into(target).version == 4  # a whole load, as for any target held by nobody
    assert_bits_equal(target, states[-1])


def test_another_versions_bits_are_refused(store) -> None:
    url, _ = store
    with Subscriber(url) as sub:
        with pytest.raises(TargetModifiedError, match="does not hold version 4"):
            sub.adopt(_pulled(url, 2))
        assert sub.version is None


def test_a_wrong_layout_is_refused(store) -> None:
    url, _ = store
    target = _pulled(url, 2)
    name = sorted(target)[0]
    target[name] = target[name][:-1].clone()
    with Subscriber(url) as sub:
        with pytest.raises(LayoutMismatchError, match=name):
            sub.adopt(target, 2)
        assert sub.version is None


def test_a_subscriber_that_holds_a_version_does_not_adopt(store) -> None:
    url, _ = store
    target = _pulled(url, 2)
    with Subscriber(url) as sub:
        sub.pull(3)
        with pytest.raises(ValueError, match="holds version 3"):
            sub.adopt(target, 2)
        assert sub.version == 3


def test_a_partial_subscriber_adopts_its_selection_unless_a_chunk_straddles_it(store) -> None:
    url, states = store
    name = sorted(states[-1])[0]
    with Subscriber(url, select=Selection(names=[name])) as part:
        target = part.pull(2)
    counting = WrappedStore(open_store(url))
    with Subscriber(url, store=counting, select=Selection(names=[name])) as part:
        assert part.adopt(target, 2).version == 2 and _packs_read(counting) == []
        assert part.pull_into(target).version == 4
    assert_bits_equal(target, {name: states[-1][name]})
    # a shard whose rows end inside a chunk: that chunk's other rows are not in the target
    shard = Selection(names=[name], shard=(0, 0, 3))
    with Subscriber(url, select=shard) as part:
        target = part.pull(2)
    with Subscriber(url, select=shard) as part:
        with pytest.raises(ValueError, match="straddles"):
            part.adopt(target, 2)
        assert part.version is None
    whole = {name: _pulled(url, 2)[name]}
    whole[name].view(-1)[-1] += 1
    with Subscriber(url, select=Selection(names=[name])) as part:
        with pytest.raises(TargetModifiedError, match=repr(name)):
            part.adopt(whole, 2)
        assert part.version is None
