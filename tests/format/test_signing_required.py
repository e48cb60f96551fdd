"""A publisher without a signing key refuses a signed store before writing anything, unless told
to publish unsigned; a trusted subscriber that meets such a version names the cause (SPEC §3.1)."""

from __future__ import annotations

import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from safetensors.torch import save_file

from deltastore import (
    ConflictError,
    Publisher,
    SignatureError,
    SigningRequiredError,
    Subscriber,
    UnsignedVersionError,
)
from deltastore.cli import main
from deltastore.storage import open_store
from deltastore.storage.base import Store
from deltastore.write.policy import WriterPolicy
from testkit.tensors import assert_bits_equal, small_state, sparse_edit


@pytest.fixture
def url() -> str:
    return f"memory://signing-required-{uuid.uuid4().hex}"


@pytest.fixture
def key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


def _states(n: int) -> list[dict[str, torch.Tensor]]:
    out = [small_state(0, rows=64)]
    for i in range(1, n):
        out.append(sparse_edit(out[-1], np.random.default_rng(i)))
    return out


def _objects(store: Store) -> dict[str, bytes]:
    """Every object of the store, HEAD included: what "nothing was written" compares."""
    return {m.key: store.get(m.key) for m in store.list("")}


def test_a_publisher_without_a_key_refuses_a_signed_store_and_writes_nothing(url: str, key) -> None:
    states = _states(3)
    with Publisher(url, signing_key=key, writer_policy=WriterPolicy(threads=2)) as pub:
        pub.publish(states[0])
        pub.publish(states[1])
    with open_store(url) as store:
        before = _objects(store)
        for takeover in (True, False):  # the refusal comes before the claim's HEAD write
            with pytest.raises(SigningRequiredError) as exc:
                Publisher(url, writer_policy=WriterPolicy(threads=2, takeover=takeover))
            msg = str(exc.value)
            assert url in msg and "version 2" in msg and "signing_key" in msg and "allow_unsigned=True" in msg, msg
            assert "\n" not in msg
            assert _objects(store) == before
    with Publisher(url, signing_key=key, writer_policy=WriterPolicy(threads=2)) as pub:  # the key holder goes on
        assert pub.publish(states[2]).version == 3


def test_an_unsigned_version_on_a_signed_store_is_named_for_its_cause(url: str, key) -> None:
    states = _states(4)
    with Publisher(url, signing_key=key, writer_policy=WriterPolicy(threads=2)) as pub:
        pub.publish(states[0])
        pub.publish(states[1])
    trusted = [key.public_key()]
    with Subscriber(url, threads=2, trusted_keys=trusted) as follower:
        target = follower.pull()  # holds signed version 2
        with Publisher(url, writer_policy=WriterPolicy(threads=2, allow_unsigned=True)) as pub:
            assert pub.publish(states[2]).version == 3
            # version 3's parent, version 2, is signed
            with Subscriber(url, threads=2, trusted_keys=trusted) as fresh, pytest.raises(UnsignedVersionError) as exc:
                fresh.pull()
            msg = str(exc.value)
            assert "manifests/000000000003-" in msg and "version 2" in msg and "publisher without the signing key" in msg
            assert isinstance(exc.value, SignatureError) and "\n" not in msg
            assert pub.publish(states[3]).version == 4
        with pytest.raises(UnsignedVersionError) as exc:  # version 4's parent is unsigned: the held version tells
            follower.pull_into(target)
        assert "manifests/000000000004-" in str(exc.value) and "version 2" in str(exc.value)
        assert_bits_equal(target, states[1])
    with Subscriber(url, threads=2, trusted_keys=trusted) as fresh:
        with pytest.raises(SignatureError) as exc:  # no signed version below at hand: the plain refusal
            fresh.pull()
        assert not isinstance(exc.value, UnsignedVersionError) and "not signed" in str(exc.value)


def test_a_publisher_without_a_key_refuses_a_signed_version_committed_after_it_opened(url: str, key) -> None:
    states = _states(2)
    keyless = Publisher(url, writer_policy=WriterPolicy(threads=2, takeover=False))  # an empty store: nothing to refuse yet
    try:
        with Publisher(url, signing_key=key, writer_policy=WriterPolicy(threads=2, takeover=False)) as signed:
            signed.publish(states[0])
        with pytest.raises(ConflictError):
            keyless.publish(states[0])  # HEAD was created by the signed publisher meanwhile
        with open_store(url) as store:
            before = _objects(store)
            with pytest.raises(SigningRequiredError, match="version 1"):
                keyless.publish(states[1])  # now it builds on a signed version
            assert _objects(store) == before
    finally:
        keyless.close()


def test_cli_publish_refuses_a_signed_store_without_the_key(tmp_path: Path, capsys) -> None:
    assert main(["keygen", str(tmp_path / "k.pem")]) == 0
    store = str(tmp_path / "store")
    states = _states(3)
    ckpts = []
    for i, s in enumerate(states):
        ckpts.append(str(tmp_path / f"w{i}.safetensors"))
        save_file(s, ckpts[-1])
    assert main(["publish", store, ckpts[0], "--signing-key", str(tmp_path / "k.pem")]) == 0
    capsys.readouterr()
    assert main(["publish", store, ckpts[1]]) == 1
    first, *_ = capsys.readouterr().err.strip().splitlines()
    assert "SigningRequiredError" in first and "--allow-unsigned" in first and "--signing-key" in first, first
    assert main(["publish", store, ckpts[1], "--allow-unsigned"]) == 0
    capsys.readouterr()
    assert main(["pull", store, str(tmp_path / "out.safetensors"), "--trusted-key", str(tmp_path / "k.pub")]) == 1
    first, *rest = capsys.readouterr().err.strip().splitlines()
    assert "UnsignedVersionError" in first and "publisher without the signing key" in first, first
    assert len(rest) == 1 and "--signing-key" in rest[0] and "--trusted-key" not in rest[0], rest
