"""Read path (docs/SPEC.md §7): from HEAD to verified tensors.

- :mod:`~deltastore.read.subscriber`: :class:`Subscriber`, the public face;
- :mod:`~deltastore.read.reader`: its state (HEAD, the held version) and moves (pull,
  fast-forward, stage and swap);
- :mod:`~deltastore.read.catchup`: which path from the held version to a newer one;
- :mod:`~deltastore.read.plan`: which segments a path needs, per chunk (pure);
- :mod:`~deltastore.read.fetch`: range GETs and the SHA-256 of every segment;
- :mod:`~deltastore.read.engine`: decoding, digests, applying with rollback;
- :mod:`~deltastore.read.stage`: staged updates and their swap (SPEC §7.7);
- :mod:`~deltastore.read.follow`: the follow loop and its settings; :mod:`~deltastore.read.cache`:
  the worker cache it restarts from;
- :mod:`~deltastore.read.verify`: checking whole chains;
- :mod:`~deltastore.read.targets` and :mod:`~deltastore.read.partial`: the user's tensors, whole or
  a selection's slices; :mod:`~deltastore.read.changes`: what an update changed (public).
"""
