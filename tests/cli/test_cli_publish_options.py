"""The Publisher options behind the CLI's ``--allow-empty`` and ``--no-takeover``."""

from __future__ import annotations

import torch

from deltastore.read.subscriber import Subscriber
from deltastore.write.policy import WriterPolicy
from deltastore.write.publisher import Publisher


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"w": torch.randn(16, 8, generator=g).bfloat16(), "z": torch.zeros(4)}


def test_identical_state_is_not_committed_by_default() -> None:
    url = "memory://e1-skip"
    state = _state()
    with Publisher(url) as pub, Subscriber(url) as sub:
        first = pub.publish(state, step=0)
        again = pub.publish({k: v.clone() for k, v in state.items()}, step=1, metadata={"note": "same"})
        assert again == first and pub.version == 1  # the head's VersionInfo, nothing new
        assert pub.publish_async(state, step=2).result(30) == first
        assert [i.version for i in sub.log()] == [1]
        # One bit is a change: -0.0 == 0.0 as numbers, not as bits.
        flipped = {**state, "z": torch.tensor([-0.0, 0.0, 0.0, 0.0])}
        assert pub.publish(flipped).version == 2
        # anchor=True always commits (a fresh full snapshot of the same state).
        assert pub.publish(flipped, anchor=True).kind == "anchor" and pub.version == 3


def test_skip_unchanged_false_commits_an_empty_delta() -> None:
    url = "memory://e1-noskip"
    with Publisher(url, writer_policy=WriterPolicy(skip_unchanged=False)) as pub:
        pub.publish(_state())
        info = pub.publish(_state())
        assert (info.version, info.kind, info.elements_changed) == (2, "delta", 0)


def test_a_restarted_publisher_skips_an_unchanged_state(tmp_path) -> None:
    url = str(tmp_path / "store")
    with Publisher(url) as pub:
        pub.publish(_state())
    with Publisher(url) as pub:  # resumes from the head (the CLI's case)
        assert pub.publish(_state()).version == 1 and pub.version == 1
