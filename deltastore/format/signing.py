"""Ed25519 signatures of manifests (docs/SPEC.md §3.1, design 004).

A publisher given a private key signs each manifest it writes; a subscriber given trusted
public keys verifies every manifest it uses. ``cryptography`` is imported only here and only
when a key is used (``pip install 'deltastore-weights[signing]'``).

Keys are accepted as key objects, PEM bytes, or a path to a PEM file (PKCS#8 private keys,
SubjectPublicKeyInfo public keys, as written by ``deltastore keygen`` or ``openssl genpkey
-algorithm ed25519``).
"""

from __future__ import annotations

import base64
import hashlib
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from deltastore.errors import DeltastoreError, SignatureError, UnsignedVersionError
from deltastore.format.models import Manifest, Signature, dump

#: Hex digits of SHA-256(raw public key) in ``key_id``: 64 bits tell keys apart without
#: making manifests longer than needed (the id selects a key; trust comes from the key).
KEY_ID_HEX = 16

KeyLike = Any  # a cryptography key object, PEM bytes, or a path (str / os.PathLike)


def _ed25519() -> Any:
    try:
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError:  # pragma: no cover - depends on the environment
        raise ImportError("signing manifests needs the 'cryptography' package: pip install 'deltastore-weights[signing]'") from None
    return ed25519


def _pem(key: KeyLike, what: str) -> bytes:
    if isinstance(key, (bytes, bytearray)):
        return bytes(key)
    if isinstance(key, (str, os.PathLike)):
        try:
            return Path(key).read_bytes()
        except OSError as e:
            raise ValueError(f"cannot read {what} {os.fspath(key)!r}: {e.strerror or e}") from None
    raise TypeError(f"{what} must be an Ed25519 key object, PEM bytes or a path, not {type(key).__name__}")


def load_private_key(key: KeyLike) -> Any:
    """An ``Ed25519PrivateKey`` from a key object, PEM bytes or a PEM file path.

    Raises:
        ValueError: not an (unencrypted) Ed25519 private key.
    """
    ed25519 = _ed25519()
    if isinstance(key, ed25519.Ed25519PrivateKey):
        return key
    from cryptography.hazmat.primitives import serialization

    try:
        loaded = serialization.load_pem_private_key(_pem(key, "signing key"), password=None)
    except (ValueError, TypeError) as e:
        raise ValueError(f"the signing key is not an unencrypted PEM private key: {e}") from None
    if not isinstance(loaded, ed25519.Ed25519PrivateKey):
        raise ValueError(f"the signing key is a {type(loaded).__name__}, not an Ed25519 key")
    return loaded


def load_public_key(key: KeyLike) -> Any:
    """An ``Ed25519PublicKey`` from a key object (a private key gives its public half), PEM
    bytes or a PEM file path.

    Raises:
        ValueError: not an Ed25519 public key.
    """
    ed25519 = _ed25519()
    if isinstance(key, ed25519.Ed25519PublicKey):
        return key
    if isinstance(key, ed25519.Ed25519PrivateKey):
        return key.public_key()
    from cryptography.hazmat.primitives import serialization

    try:
        loaded = serialization.load_pem_public_key(_pem(key, "trusted key"))
    except (ValueError, TypeError) as e:
        raise ValueError(f"the trusted key is not a PEM public key: {e}") from None
    if not isinstance(loaded, ed25519.Ed25519PublicKey):
        raise ValueError(f"the trusted key is a {type(loaded).__name__}, not an Ed25519 key")
    return loaded


def key_id(public_key: Any) -> str:
    """First KEY_ID_HEX hex digits of SHA-256 of the raw 32-byte public key."""
    from cryptography.hazmat.primitives import serialization

    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:KEY_ID_HEX]


def signed_bytes(m: Manifest) -> bytes:
    """What a signature covers: the canonical manifest with ``signature`` null."""
    return dump(m.model_copy(update={"signature": None}))


def sign_manifest(m: Manifest, private_key: Any) -> Manifest:
    """``m`` with an Ed25519 ``signature`` by ``private_key``."""
    value = private_key.sign(signed_bytes(m))
    sig = Signature(alg="ed25519", key_id=key_id(private_key.public_key()), value=base64.b64encode(value).decode())
    return m.model_copy(update={"signature": sig})


def generate_key_files(private_path: str | os.PathLike) -> tuple[Path, Path]:
    """Write a new private key (PEM, mode 0600) and its public key beside it (``.pub``).

    Returns:
        (private key path, public key path). Existing files are never overwritten.
    """
    from cryptography.hazmat.primitives import serialization

    priv_path = Path(private_path)
    pub_path = priv_path.with_suffix(".pub")
    if priv_path == pub_path:
        raise ValueError(f"{priv_path}: the private key file must not end in .pub")
    for p in (priv_path, pub_path):
        if p.exists():
            raise FileExistsError(f"{p} already exists; not overwriting a key")
    key = _ed25519().Ed25519PrivateKey.generate()
    priv = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    pub = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    fd = os.open(priv_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # never readable by others
    with os.fdopen(fd, "wb") as f:
        f.write(priv)
    with open(pub_path, "xb") as f:
        f.write(pub)
    return priv_path, pub_path


class TrustedKeys:
    """The public keys a subscriber accepts manifests from; :meth:`verify` checks one."""

    def __init__(self, keys: Iterable[KeyLike]):
        self._keys = {}
        for k in keys:
            pub = load_public_key(k)
            self._keys[key_id(pub)] = pub
        if not self._keys:
            raise ValueError("trusted_keys is empty: pass at least one public key, or None to read unsigned stores")

    @property
    def key_ids(self) -> list[str]:
        return sorted(self._keys)

    def verify(self, key: str, m: Manifest) -> None:
        """Raise SignatureError unless manifest ``m`` (stored under ``key``) is validly signed
        by one of these keys."""
        from cryptography.exceptions import InvalidSignature

        sig = m.signature
        if sig is None:
            raise SignatureError(f"manifest {key!r} is not signed, but this subscriber only accepts manifests signed by {self.key_ids}")
        pub = self._keys.get(sig.key_id)
        if pub is None:
            raise SignatureError(f"manifest {key!r} is signed by key {sig.key_id}, which is not trusted (trusted: {self.key_ids})")
        try:
            pub.verify(base64.b64decode(sig.value, validate=True), signed_bytes(m))
        except (InvalidSignature, ValueError):
            raise SignatureError(f"manifest {key!r} has an invalid signature for key {sig.key_id}: it was altered after signing") from None


def signed_parent(keys: TrustedKeys, history: Any, m: Manifest) -> tuple[str, Manifest] | None:
    """``m``'s parent when it is the version and history ``m`` names and is signed by one of
    ``keys``: read through ``history.unchecked`` (one read, not cached); None on any error.
    What tells an unsigned ``m`` from a publisher without the key (:func:`unsigned_version_error`)."""
    if m.parent_manifest is None:
        return None
    try:
        p = history.unchecked(m.parent_manifest)
        if p.signature is None or p.version != m.parent or p.lineage != m.lineage:
            return None
        keys.verify(m.parent_manifest, p)
    except DeltastoreError:
        return None
    return m.parent_manifest, p


def unsigned_version_error(url: str, key: str, m: Manifest, below_key: str, below: Manifest) -> UnsignedVersionError:
    """The error for unsigned manifest ``m`` (at ``key``) when ``below``, an earlier version of
    the same history, is signed by a trusted key: the cause is a publisher without the key."""
    kid = below.signature.key_id if below.signature is not None else "?"
    return UnsignedVersionError(
        f"manifest {key!r} (version {m.version}) of {url} is not signed, but version {below.version} of the same "
        f"history ({below_key!r}) is signed by trusted key {kid}: a publisher without the signing key published to "
        "this signed store. Nothing was applied; publish to it with its signing_key (a publisher without one refuses "
        "a signed store unless allow_unsigned=True)"
    )
