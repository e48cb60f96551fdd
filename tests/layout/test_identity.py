"""deltastore._util.identity.IdentityCache: an entry per live object, by identity, gone with it."""

from __future__ import annotations

import gc
import threading
from dataclasses import dataclass

from deltastore._util.identity import IdentityCache


@dataclass(frozen=True)
class _Spec:
    name: str


def test_an_entry_is_found_by_identity_not_equality() -> None:
    cache: IdentityCache[int] = IdentityCache()
    a, b = _Spec("x"), _Spec("x")
    assert a == b
    assert cache.put(a, 1) == 1
    assert cache.get(a) == 1 and cache.get(b) is None
    cache.put(a, 2)  # replaced
    assert cache.get(a) == 2 and len(cache) == 1


def test_an_entry_goes_with_its_object_and_its_id_can_serve_another() -> None:
    cache: IdentityCache[str] = IdentityCache()
    for i in range(1000):  # ids of dead objects are reused: a new object never sees an old value
        s = _Spec(str(i))
        assert cache.get(s) is None
        cache.put(s, s.name)
        assert cache.get(s) == s.name
        del s
    gc.collect()
    assert len(cache) == 0


def test_a_value_does_not_keep_its_object_alive_and_threads_share_the_cache() -> None:
    cache: IdentityCache[tuple[int, ...]] = IdentityCache()
    live = [_Spec(str(i)) for i in range(200)]
    errors: list[str] = []

    def work(k: int) -> None:
        for _ in range(50):
            for i, s in enumerate(live):
                got = cache.get(s)
                if got is None:
                    cache.put(s, (i,))
                elif got != (i,):
                    errors.append(f"{s.name}: {got}")

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(cache) == 200
    live.clear()
    gc.collect()
    assert len(cache) == 0
