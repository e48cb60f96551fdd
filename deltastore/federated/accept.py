"""Which site results a federated round accepts (design 009 D9, D11): signed by the site's own
keys, and compressed or only lossless. A value, shared by the aggregator, the Flower strategy
and ``deltastore aggregate``; the late rule is its own policy (:class:`~deltastore.federated.LatePolicy`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from deltastore.format.signing import KeyLike, TrustedKeys


@dataclass(frozen=True)
class ResultPolicy:
    """What a round accepts from its sites.

    Attributes:
        site_keys: site name → the Ed25519 public keys (key objects, PEM bytes or paths) whose
            signature that site's versions must carry (design 009 D9). A site named here whose
            version is unsigned or wrongly signed is refused (SignatureError, named in the
            round's report) and the round goes on; sites not named are read unsigned.
        accept_compressed: merge compressed site results (SPEC §14.1, the opt-in compressed
            tier). False (the default): a compressed result is refused (CompressedVersionError,
            named in the report).

    Raises:
        TypeError: ``site_keys`` is not a mapping of site names to keys.

    Example::

        Aggregator(global_url, sites, results=ResultPolicy(site_keys={"a": ["a.pub"]}, accept_compressed=True))
    """

    site_keys: Mapping[str, Iterable[KeyLike]] | None = None
    accept_compressed: bool = False

    def __post_init__(self) -> None:
        keys = self.site_keys
        if keys is not None:
            if not isinstance(keys, Mapping) or not all(isinstance(k, str) for k in keys):
                raise TypeError("ResultPolicy.site_keys maps site names to their public keys, e.g. {'a': ['a.pub']}")
            object.__setattr__(self, "site_keys", {name: tuple(v) if not isinstance(v, (str, bytes)) else (v,)
                                                   for name, v in keys.items()})
        object.__setattr__(self, "accept_compressed", bool(self.accept_compressed))

    def trusted(self, sites: Iterable[str], *, what: str = "this aggregator") -> dict[str, TrustedKeys]:
        """Site name → its loaded keys, for the sites ``site_keys`` names.

        Raises:
            ValueError: a name that is none of ``sites``, or a key that does not load.
        """
        names = set(sites)
        keys: Mapping[str, Any] = self.site_keys or {}
        unknown = sorted(set(keys) - names)
        if unknown:
            raise ValueError(f"site_keys names {', '.join(unknown)}, which is no site of {what} "
                             f"({', '.join(sorted(names))})")
        return {name: TrustedKeys(list(k)) for name, k in keys.items()}  # a bad key fails here
