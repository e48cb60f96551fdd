"""Ed25519 manifest signatures (SPEC §3.1), and fetched bytes never reaching pickle."""

from __future__ import annotations

import json
import pickle
import stat
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from safetensors.torch import load_file, save_file

from deltastore import IntegrityError, Publisher, SignatureError, Subscriber
from deltastore.cli import main
from deltastore.format.keys import HEAD_KEY
from deltastore.format.signing import KEY_ID_HEX, key_id, load_private_key, load_public_key
from deltastore.storage import open_store
from deltastore.write.policy import AnchorPolicy, WriterPolicy
from testkit.stores import head_manifest, resign_manifest
from testkit.tensors import assert_bits_equal, small_state, sparse_edit


@pytest.fixture
def url() -> str:
    return f"memory://signing-{uuid.uuid4().hex}"


def _states(n: int) -> list[dict]:
    out = [small_state(0, rows=64)]
    for i in range(1, n):
        out.append(sparse_edit(out[-1], np.random.default_rng(i)))
    return out


def _publish(url: str, states: list[dict], key=None, **kw) -> None:
    with Publisher(url, signing_key=key, writer_policy=WriterPolicy(threads=2), **kw) as pub:
        for s in states:
            pub.publish(s)


def test_signed_store_verifies_for_trusted_subscribers(url: str) -> None:
    key = Ed25519PrivateKey.generate()
    states = _states(4)
    _publish(url, states, key, anchor_policy=AnchorPolicy(every=3))
    with open_store(url) as store:
        _, doc = head_manifest(store)
    sig = doc["signature"]
    assert sig["alg"] == "ed25519" and sig["key_id"] == key_id(key.public_key()) and len(sig["key_id"]) == KEY_ID_HEX
    with Subscriber(url, threads=2, trusted_keys=[key.public_key()]) as sub:
        assert [i.version for i in sub.log()] == [1, 2, 3, 4]
        target = sub.pull(1)
        assert sub.pull_into(target).version == 4
        assert_bits_equal(target, states[3])
    # Readers without keys ignore signatures.
    with Subscriber(url, threads=2) as sub:
        assert_bits_equal(sub.pull(), states[3])


def test_unsigned_store_is_refused_by_a_subscriber_with_keys(url: str) -> None:
    _publish(url, _states(2))
    with Subscriber(url, threads=2, trusted_keys=[Ed25519PrivateKey.generate().public_key()]) as sub:
        for call in (sub.pull, sub.log, sub.latest):
            with pytest.raises(SignatureError, match="not signed") as exc:
                call()
            assert "manifests/" in str(exc.value) and isinstance(exc.value, IntegrityError)
    with Subscriber(url, threads=2) as sub:  # and still works without keys
        assert sub.pull() is not None


def test_untrusted_key_is_refused(url: str) -> None:
    _publish(url, _states(2), Ed25519PrivateKey.generate())
    with Subscriber(url, threads=2, trusted_keys=[Ed25519PrivateKey.generate().public_key()]) as sub:
        with pytest.raises(SignatureError, match="not trusted"):
            sub.pull()


def test_altered_manifest_is_refused(url: str) -> None:
    """Someone with write access edits a signed manifest and re-keys it (every SHA-256 right)."""
    key = Ed25519PrivateKey.generate()
    _publish(url, _states(2), key)
    with open_store(url) as store:
        _, doc = head_manifest(store)
        doc["metadata"] = {"evil": True}
        resign_manifest(store, doc)
    with Subscriber(url, threads=2, trusted_keys=[key.public_key()]) as sub:
        with pytest.raises(SignatureError, match="invalid signature"):
            sub.pull()


def test_every_manifest_on_the_chain_is_checked(url: str) -> None:
    """An unsigned manifest below a signed head is refused when the chain reaches it."""
    key = Ed25519PrivateKey.generate()
    states = _states(3)
    _publish(url, states[:1])  # version 1 unsigned
    _publish(url, states[1:], key)  # versions 2, 3 signed
    with Subscriber(url, threads=2, trusted_keys=[key.public_key()]) as sub:
        assert sub.latest().version == 3  # HEAD's manifest alone is fine
        with pytest.raises(SignatureError) as exc:
            sub.pull()  # needs anchor 1
        assert "manifests/000000000001-" in str(exc.value)


def test_key_forms(tmp_path: Path) -> None:
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    pub_pem = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    (tmp_path / "k.pem").write_bytes(pem)
    (tmp_path / "k.pub").write_bytes(pub_pem)
    kid = key_id(key.public_key())
    for form in (key, pem, tmp_path / "k.pem", str(tmp_path / "k.pem")):
        assert key_id(load_private_key(form).public_key()) == kid
    for form in (key.public_key(), key, pub_pem, tmp_path / "k.pub"):
        assert key_id(load_public_key(form)) == kid
    with pytest.raises(ValueError):
        load_private_key(pub_pem)
    with pytest.raises(ValueError):
        load_public_key(b"not a key")
    with pytest.raises(ValueError):
        Subscriber("memory://x", trusted_keys=[])
    with pytest.raises(ValueError):
        Publisher(f"memory://{uuid.uuid4().hex}", signing_key=b"garbage")


# --- CLI ----------------------------------------------------------------------------------------


def test_cli_keygen_publish_signed_and_pull_trusted(tmp_path: Path, capsys) -> None:
    priv = tmp_path / "trainer.pem"
    assert main(["keygen", str(priv)]) == 0
    pub = tmp_path / "trainer.pub"
    assert stat.S_IMODE(priv.stat().st_mode) == 0o600
    assert b"PUBLIC KEY" in pub.read_bytes()
    assert main(["keygen", str(priv)]) == 1, "never overwrites a key"
    store = str(tmp_path / "store")
    ckpt = tmp_path / "w.safetensors"
    state = {"w": torch.randn(16, 8).bfloat16()}
    save_file(state, str(ckpt))
    assert main(["publish", store, str(ckpt), "--signing-key", str(priv)]) == 0
    out = tmp_path / "out.safetensors"
    assert main(["pull", store, str(out), "--trusted-key", str(pub)]) == 0
    assert torch.equal(load_file(str(out))["w"].view(torch.int16), state["w"].view(torch.int16))
    assert main(["log", store, "--trusted-key", str(pub)]) == 0
    assert main(["verify", store, "--trusted-key", str(pub)]) == 0
    other = tmp_path / "other.pem"
    assert main(["keygen", str(other)]) == 0
    capsys.readouterr()
    assert main(["pull", store, str(tmp_path / "x.safetensors"), "--trusted-key", str(tmp_path / "other.pub")]) == 1
    err = capsys.readouterr().err
    first, *rest = err.strip().splitlines()  # the error line, then a hint line naming --trusted-key
    assert "SignatureError" in first and "not trusted" in first and len(rest) == 1 and "--trusted-key" in rest[0]


# --- fetched bytes never reach pickle ----------------------------------------------------------


def test_fetched_bytes_never_reach_pickle_or_torch_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A store is untrusted input: nothing read from it may be unpickled (arbitrary code)."""
    calls: list[str] = []

    def refuse(name):
        def f(*a, **k):
            calls.append(name)
            raise AssertionError(f"{name} called on the read/write path")

        return f

    class NoUnpickler:
        def __init__(self, *a, **k):
            refuse("pickle.Unpickler")()

    url = str(tmp_path / "store")
    states = _states(3)
    monkeypatch.setattr(pickle, "loads", refuse("pickle.loads"))
    monkeypatch.setattr(pickle, "load", refuse("pickle.load"))
    monkeypatch.setattr(pickle, "Unpickler", NoUnpickler)
    monkeypatch.setattr(torch, "load", refuse("torch.load"))
    _publish(url, states[:2])
    with Publisher(url, writer_policy=WriterPolicy(threads=2)) as pub:  # resume reads the head back through the read path
        pub.publish(states[2])
    with Subscriber(url, threads=2) as sub:
        target = sub.pull(1)
        sub.pull_into(target)
        assert_bits_equal(target, states[2])
        assert_bits_equal(sub.pull(2), states[1])
    out = tmp_path / "out.safetensors"
    assert main(["pull", url, str(out)]) == 0
    assert main(["verify", url, "--all"]) == 0
    assert calls == []
    with open_store(url) as store:
        assert json.loads(store.get(HEAD_KEY))["version"] == 3
