"""What the registry asks of a worker's adapter tiers, and the bookkeeping of it.

Every heartbeat answer (gpu_worker/registry_client.py) carries the versions to retire and the
operators' and the placement plan's orders for this worker, all of them; the worker's engine thread (or
the simulated worker) applies each answer to its residency (`OrderBook.apply`, residency.py).
Pins follow the orders exactly: a pin missing from an answer is lifted.
A preload happens once per order: an adapter preloaded, then evicted for lack of room, is not loaded
again at the next heartbeat, only if the operator orders it again (or the worker restarts). A preload
refused because its load failed lately is tried again at the first answer after the failure expires.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from policy.residency import MAX_PINNED_SHARE, Residency
from policy.residency_edge import VersionRef

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Preload:
    ref: VersionRef
    rate: float = 0.0  # requests/s a placement plan expects of it here; 0: an operator's order


@dataclass(frozen=True)
class PlacementOrders:
    retire: tuple[tuple[str, str], ...] = ()  # (name, digest) the registry no longer serves under that name
    pins: tuple[VersionRef, ...] = ()
    preloads: tuple[Preload, ...] = ()
    host_preloads: tuple[Preload, ...] = ()  # into host memory only (the placement's warm adapters)


class OrderBook:
    """The worker's engine thread only."""

    def __init__(self, adapters: Residency) -> None:
        self._adapters = adapters
        self._preloaded: set[tuple[str, str]] = set()  # (name, digest) of the preload orders carried out
        self._refused: set[str] = set()  # digests of the pins refused (logged once each)

    def apply(self, orders: PlacementOrders) -> None:
        adapters = self._adapters
        pins = {ref.sha256: ref for ref in orders.pins}
        for digest in adapters.operator_pins - pins.keys():
            adapters.unpin(digest)
        refused = {digest for digest, ref in pins.items() if not adapters.pin(ref)}  # a no-op where pinned already
        for digest in refused - self._refused:
            log.warning("pin of adapter %s not applied: its load failed lately, or pins would hold more than %d%% "
                        "of GPU adapter memory (the placements report it unpinned)",
                        pins[digest].name, MAX_PINNED_SHARE * 100)
        self._refused = refused
        ordered = {(p.ref.name, p.ref.sha256): (p, adapters.preload_host) for p in orders.host_preloads}
        ordered |= {(p.ref.name, p.ref.sha256): (p, adapters.preload) for p in orders.preloads}  # the GPU wins
        # Carried out once; one refused (a failure remembered, or declined for hotter adapters) next time again.
        self._preloaded = {key for key, (p, preload) in ordered.items()
                           if (key in self._preloaded and adapters.status(p.ref).failure is None) or preload(p.ref, p.rate)}
        for name, digest in orders.retire:
            adapters.retire(name, digest)
