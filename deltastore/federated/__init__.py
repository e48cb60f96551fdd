"""Federated rounds (design 009, SPEC §14).

Sites train locally and publish only their change, as *based versions* in their own stores;
an :class:`Aggregator` waits for a round's quorum, verifies every result against the round's
base, merges them (weighted average in fp32 of the changes by default) and publishes the next
global version; each :class:`Site` fast-forwards to it. A round ends by its deadline; late
results are dropped or carried (:class:`LatePolicy`); sites may sign their results, and may
opt in to sending compressed results (:class:`Compression`, which the aggregator must accept).
"""

from deltastore.federated.accept import ResultPolicy
from deltastore.federated.aggregator import Aggregator, Gathered, RoundReport, SiteOutcome
from deltastore.federated.based import BasedResult, BasedWriter, RoundBase, read_based
from deltastore.federated.compress import Compression, Compressor
from deltastore.federated.late import LatePolicy
from deltastore.federated.lora import LoraMerge, LoraModule, lora_modules
from deltastore.federated.merge import MergeFn, StateMerge, weighted_average
from deltastore.federated.site import Site, SiteRound

__all__ = [
    "Aggregator",
    "BasedResult",
    "BasedWriter",
    "Compression",
    "Compressor",
    "Gathered",
    "LatePolicy",
    "LoraMerge",
    "LoraModule",
    "MergeFn",
    "StateMerge",
    "ResultPolicy",
    "RoundBase",
    "RoundReport",
    "Site",
    "SiteOutcome",
    "SiteRound",
    "lora_modules",
    "read_based",
    "weighted_average",
]
