"""Values derived from an object, kept exactly as long as that object lives.

The layout code derives tables from objects that never change once made (a layout's specs, a
:class:`~deltastore.format.models.Layout`) and reuses them for every version of that layout. Module-level
dictionaries keyed by ``id()`` had to hold the object itself (so that its id could not be reused
by another) and so kept dead layouts alive, with all their objects for the cyclic collector to
walk (docs/design/006-native-kernels.md). An :class:`IdentityCache` holds a weak reference
instead: the entry goes when the object goes.
"""

from __future__ import annotations

import weakref
from typing import Any, Generic, TypeVar

V = TypeVar("V")


class IdentityCache(Generic[V]):
    """``object → value`` by identity (not equality: equal objects that are not the same one
    do not share an entry), for objects that support weak references.

    A value must not refer to its object (the entry would keep it alive). Safe across threads
    under the GIL: each operation is one dictionary operation, and a dead object's entry is
    removed (by its weak reference's callback) before its id can be given to another object.
    """

    def __init__(self) -> None:
        self._d: dict[int, tuple[weakref.ref, V]] = {}

    def get(self, obj: Any) -> V | None:
        """The value stored for ``obj``, or None."""
        hit = self._d.get(id(obj))
        if hit is not None and hit[0]() is obj:
            return hit[1]
        return None

    def put(self, obj: Any, value: V) -> V:
        """Store ``value`` for ``obj`` (replacing any) and return it."""
        key = id(obj)
        d = self._d

        def drop(ref: weakref.ref, key: int = key, d: dict = d) -> None:
            hit = d.get(key)
            if hit is not None and hit[0] is ref:
                d.pop(key, None)

        d[key] = (weakref.ref(obj, drop), value)
        return value

    def __len__(self) -> int:
        return len(self._d)
