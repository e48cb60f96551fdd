"""Helpers shared by the tests, the campaigns and the benchmarks (not shipped in the wheel).

=================  ===========================================================================
module             what it holds
=================  ===========================================================================
``servers``        real S3 servers on 127.0.0.1: moto, SeaweedFS, s3rver (no conditional writes)
``proxy``          fault-injecting HTTP proxies: :class:`FaultProxy` (a seeded random plan, for
                   the campaigns) and :class:`ScriptedProxy` (queued faults, for unit tests)
``shaper``         a link shaper (bandwidth, RTT, loss) in front of a server
``targets``        :class:`StoreTarget`: a store URL with a fresh prefix and its options
``contract``       :class:`StoreContract`, the suite every storage backend's tests subclass
``tensors``        bit-exact comparison, special values, the tiny trainer, small states
``stores``         a store wrapper that records or intercepts verbs; readers and re-signing
                   corruptors of a store's objects
``manifest_docs``  manifests as JSON documents (read, edit, re-encode) and random manifests
``partial``        what a selection should hold, and what a partial pull should fetch
``lifecycle``      published chains for GC and compaction tests, and their checks
``federated``      a federated round's reference states and merge
``ranks``          torch.distributed ranks in real processes and the scenarios they run
``hypo``           Hypothesis budgets as a fraction of the loaded profile's
=================  ===========================================================================

Tests import from here and never from another test module; tests/conftest.py turns the servers
into session fixtures.
"""
